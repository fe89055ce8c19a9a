"""One chat message: a role header and a Markdown body that can be streamed into.

Focus a message (click it, or Ctrl+Up / Ctrl+Down from the prompt) and press ``c`` to copy
its text or ``b`` to copy its code blocks one after another; clicking a code block copies that
block. Copying goes through ``App.copy_to_clipboard`` (OSC 52, works over SSH).
"""

from __future__ import annotations

import re

from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Label, Markdown
from textual.widgets.markdown import MarkdownFence, MarkdownStream

from localmoe.text.terminal import visible_controls

__all__ = ["MessageView", "code_blocks"]

_FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System", "error": "Error"}


def code_blocks(markdown: str) -> list[str]:
    """The contents of the fenced code blocks of a Markdown text, in order (closed fences
    only; the fence lines and the final newline are not included, as in Textual's
    ``MarkdownFence.code``)."""
    return [m.group(2).removesuffix("\n") for m in _FENCE.finditer(markdown)]


class MessageView(Vertical, can_focus=True):
    """A message in the chat log. Control characters are shown, not sent to the terminal
    (Textual passes ESC sequences through; :func:`visible_controls`); :attr:`text` and
    copying keep them.

    Args:
        role: ``user``, ``assistant``, ``system`` or ``error`` (an in-app error notice, never
            stored or sent to the model).
        text: initial Markdown text.
        message_id: the store's message id (None for error notices).
        note: extra text for the header (e.g. "stopped", "dropped from context").
    """

    BINDINGS = [
        Binding("c", "copy_message", "Copy message"),
        Binding("b", "copy_code", "Copy code block"),
    ]

    class Copied(Message):
        """Posted after something was copied; ``what`` says what (for a notification)."""

        def __init__(self, what: str) -> None:
            super().__init__()
            self.what = what

    def __init__(self, role: str, text: str = "", *, message_id: int | None = None,
                 note: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.role = role
        self.message_id = message_id
        self._text = text
        self._note = note
        self._stream: MarkdownStream | None = None
        self._code_index = 0
        self.add_class(f"-{role}")

    @property
    def text(self) -> str:
        """The message's full Markdown text (including anything streamed so far)."""
        return self._text

    def compose(self):
        yield Label(self._header_text(), classes="message-header")
        yield Markdown(visible_controls(self._text), classes="message-body")

    def _header_text(self) -> str:
        title = ROLE_TITLES.get(self.role, self.role.title())
        return f"{title}  [dim]{self._note}[/dim]" if self._note else title

    def set_note(self, note: str) -> None:
        """Replace the header's note (e.g. "stopped" or the answer's TTFT and tok/s)."""
        self._note = note
        try:
            self.query_one(".message-header", Label).update(self._header_text())
        except Exception:  # not mounted yet: compose() picks the note up
            pass

    async def append(self, delta: str) -> None:
        """Append streamed Markdown; bursts are coalesced by Textual's MarkdownStream so a
        fast engine cannot flood the UI."""
        if not delta:
            return
        self._text += delta
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(visible_controls(delta))

    async def finish(self) -> None:
        """End streaming: flush what is pending and re-render the complete text once (so a
        fence closed by the last token is highlighted)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        await self.query_one(Markdown).update(visible_controls(self._text))

    async def stop_stream(self) -> None:
        """Stop streaming without re-rendering (used when the app quits mid-answer)."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.stop()

    async def set_text(self, text: str) -> None:
        """Replace the whole text."""
        self._text = text
        await self.query_one(Markdown).update(visible_controls(text))

    def action_copy_message(self) -> None:
        """Copy the whole message text."""
        self.app.copy_to_clipboard(self._text)
        self.post_message(self.Copied("message"))

    def action_copy_code(self) -> None:
        """Copy the next code block of this message (cycles through them)."""
        blocks = code_blocks(self._text)
        if not blocks:
            self.app.notify("This message has no code block.", severity="warning")
            return
        i = self._code_index % len(blocks)
        self._code_index = i + 1
        self.app.copy_to_clipboard(blocks[i])
        self.post_message(self.Copied(f"code block {i + 1}/{len(blocks)}"))

    def on_click(self, event) -> None:
        """Clicking inside a code block copies that block."""
        node = event.widget
        while node is not None and node is not self:
            if isinstance(node, MarkdownFence):
                self.app.copy_to_clipboard(node.code)
                self.post_message(self.Copied("code block"))
                event.stop()
                return
            node = node.parent
