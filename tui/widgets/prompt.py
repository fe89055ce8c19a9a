"""The prompt editor: multi-line input with history.

Enter sends; Shift+Enter or Ctrl+J inserts a newline (most terminals send Shift+Enter as plain
Enter, so Ctrl+J is the one that always works). Up on the first line recalls older prompts,
Down on the last line newer ones (like a shell).
"""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

__all__ = ["PromptInput"]


class PromptInput(TextArea):
    """A TextArea that posts :class:`PromptInput.Submitted` on Enter and keeps a history.

    Args:
        history: earlier prompts, oldest first (the app loads them from the store).
    """

    class Submitted(Message):
        """The user pressed Enter; ``text`` is the prompt (not yet cleared)."""

        def __init__(self, prompt: "PromptInput", text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

        @property
        def control(self) -> "PromptInput":
            return self.prompt

    def __init__(self, *, history: list[str] | None = None, **kwargs) -> None:
        kwargs.setdefault("soft_wrap", True)
        kwargs.setdefault("tab_behavior", "focus")
        kwargs.setdefault("show_line_numbers", False)
        super().__init__(**kwargs)
        self.prompt_history: list[str] = list(history or [])
        self._hist_pos: int | None = None  # index into history while browsing
        self._draft = ""

    def remember(self, text: str) -> None:
        """Add a sent prompt to the history (consecutive duplicates are kept once)."""
        if text and (not self.prompt_history or self.prompt_history[-1] != text):
            self.prompt_history.append(text)
        self._hist_pos = None

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)

    def action_cursor_up(self, select: bool = False) -> None:
        """Up: move the cursor, or on the first line recall the previous prompt."""
        if select or not self.cursor_at_first_line or not self.prompt_history:
            return super().action_cursor_up(select)
        if self._hist_pos is None:
            self._draft = self.text
            self._hist_pos = len(self.prompt_history)
        if self._hist_pos > 0:
            self._hist_pos -= 1
            self._load(self.prompt_history[self._hist_pos])

    def action_cursor_down(self, select: bool = False) -> None:
        """Down: move the cursor, or on the last line step forward through the history."""
        if select or self._hist_pos is None or not self.cursor_at_last_line:
            return super().action_cursor_down(select)
        self._hist_pos += 1
        if self._hist_pos >= len(self.prompt_history):
            self._hist_pos = None
            self._load(self._draft)
        else:
            self._load(self.prompt_history[self._hist_pos])

    def _load(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)
