"""Modal dialogs: rename, confirm, export, context full, per-chat settings.

Each is a ``ModalScreen`` that dismisses with its result (None when cancelled with Esc);
the app pushes them with a callback. Layout only; the app does the work.

A dialog that opens by itself (not on a key the user pressed to open it: the context-full
dialog, which opens when an answer fills the context) derives from :class:`_UnsolicitedDialog`:
it has no single-letter keys, its buttons are chosen with Tab or Left/Right and Enter, Enter on
its first focus closes it without doing anything, and what the user goes on typing (meant for
the message box) goes to the message box instead of being lost.
"""

from __future__ import annotations

from typing import Any, Callable

from textual import events
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, TextArea

from ..store import ChatSettings

__all__ = [
    "TextPromptScreen",
    "ConfirmScreen",
    "ContextFullScreen",
    "SettingsScreen",
    "KV_FORMATS",
    "BACKENDS",
]

KV_FORMATS = ["f16", "bf16", "f32", "int8", "int4", "int3", "int2", "fp4"]
BACKENDS = ["auto", "triton", "llamacpp", "torch"]


class _Dialog(ModalScreen):
    """Base: Esc cancels (dismisses with None)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def action_cancel(self) -> None:
        """Close without a result."""
        self.dismiss(None)


class TextPromptScreen(_Dialog):
    """Ask for one line of text (chat title, export path). Dismisses with the text or None.

    Args:
        title: the question.
        value: the text the field starts with.
        ok_label: the label of the OK button.
        submit: called with the text on Enter / OK; a string it returns is an error shown in
            the dialog, which then stays open with the text as typed (None: dismiss).
    """

    def __init__(self, title: str, value: str = "", *, ok_label: str = "OK",
                 submit: Callable[[str], str | None] | None = None) -> None:
        super().__init__()
        self._title = title
        self._value = value
        self._ok = ok_label
        self._submit = submit

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self._title, classes="dialog-title", markup=False)
            yield Input(self._value, id="dialog-input")
            yield Label("", id="dialog-error", classes="dialog-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self._ok, variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def _accept(self, value: str) -> None:
        error = self._submit(value) if self._submit is not None else None
        if error:
            label = self.query_one("#dialog-error", Label)
            label.update(error)
            label.display = True
            self.query_one(Input).focus()
            return
        self.dismiss(value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._accept(event.value)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.query_one("#dialog-error", Label).display = False

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "ok":
            self._accept(self.query_one(Input).value)
        else:
            self.dismiss(None)


class ConfirmScreen(_Dialog):
    """A yes/no question. Dismisses with True, or False/None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("y", "yes", "Yes"),
                Binding("n", "cancel", "No")]

    def __init__(self, question: str, yes_label: str = "Yes") -> None:
        super().__init__()
        self._q = question
        self._yes = yes_label

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self._q, classes="dialog-title", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self._yes, variant="error", id="yes")
                yield Button("Cancel", id="no")

    def action_yes(self) -> None:
        """Confirm."""
        self.dismiss(True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "yes")


class _UnsolicitedDialog(_Dialog):
    """Base of a dialog that opens by itself, while the user may be typing a message.

    No plain key does anything here: the buttons are picked with Tab / Shift+Tab or
    Left / Right and pressed with Enter (or a click); the first focus is the harmless
    ``#close`` button, so an Enter meant for the message box only closes the dialog; Esc
    closes it. Printable keys and Backspace go on to the chat's message box (the dialog says
    so), so text typed while it opened is kept, not lost.
    """

    AUTO_FOCUS = "#close"
    BINDINGS = [Binding("escape", "cancel", "Close"),
                Binding("left", "app.focus_previous", "Previous choice", show=False),
                Binding("right", "app.focus_next", "Next choice", show=False)]
    KEYS_HINT = ("Tab or ←/→ picks a button, Enter chooses it, Esc closes. "
                 "Letters you type go to the message box.")

    def _prompt(self):
        from ..widgets.prompt import PromptInput

        for screen in reversed(self.app.screen_stack):
            if screen is not self:
                found = screen.query(PromptInput)
                if found:
                    return found.first()
        return None

    def on_key(self, event: events.Key) -> None:
        if event.key == "backspace":
            edit = "backspace"
        elif event.is_printable and event.character:
            edit = event.character
        else:
            return
        event.stop()
        event.prevent_default()
        prompt = self._prompt()
        if prompt is None:
            return
        if edit == "backspace":
            prompt.action_delete_left()
        else:
            prompt.insert(edit)
        tail = prompt.text.replace("\n", " ")
        tail = tail if len(tail) <= 40 else "…" + tail[-39:]
        for label in self.query("#typed").results(Label):
            label.update(f"In the message box: {tail}" if tail else "The message box is empty.")
            label.display = True


class ContextFullScreen(_UnsolicitedDialog):
    """The conversation no longer fits in the context window. Dismisses with ``"new"``
    (continue the last question in a new chat), ``"drop"`` (drop the oldest turns and retry)
    or None. It opens by itself, so it has no letter keys (see :class:`_UnsolicitedDialog`)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self._message = message

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Context full", classes="dialog-title")
            yield Label(self._message, classes="dialog-text", markup=False)
            yield Label(self.KEYS_HINT, classes="dialog-hint", markup=False)
            yield Label("", id="typed", classes="dialog-hint", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("New chat", variant="primary", id="new")
                yield Button("Drop oldest turns", variant="warning", id="drop")
                yield Button("Close", id="close")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id if event.button.id in ("new", "drop") else None)


def _fmt(v: Any) -> str:
    return "" if v is None else str(v)


class SettingsScreen(_Dialog):
    """Per-chat settings form. Dismisses with a new :class:`ChatSettings` or None.

    Empty fields mean "the default"; the placeholders show the values in force then (the
    model file's ``general.sampling.*`` metadata over the engine's defaults).

    Args:
        settings: the chat's current settings.
        defaults: the values in force for empty fields, shown as placeholders
            (``temperature``, ``top_p``, ``top_k``, ``max_tokens``, ``seed``, ``kv_cache``,
            ``backend``; numbers or short texts such as ``"random"``).
    """

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]
    KEYS_HINT = "Ctrl+S saves, Esc cancels, Tab moves on. Empty fields use the default."

    def __init__(self, settings: ChatSettings, defaults: dict[str, Any]) -> None:
        super().__init__()
        self._s = settings
        self._d = defaults

    def compose(self):
        s, d = self._s, self._d
        with Vertical(classes="dialog settings-dialog"):
            yield Label("Chat settings", classes="dialog-title")
            yield Label(self.KEYS_HINT, classes="dialog-hint")
            with VerticalScroll(classes="settings-body"):
                yield Label("System prompt")
                yield TextArea(s.system_prompt, id="system_prompt", soft_wrap=True,
                               tab_behavior="focus", compact=True,
                               placeholder="(none) e.g. You are a concise assistant.")
                with Grid(classes="settings-grid"):
                    for name, label in (("temperature", "Temperature"), ("top_p", "Top-p"),
                                        ("top_k", "Top-k"), ("max_tokens", "Max tokens"),
                                        ("seed", "Seed")):
                        yield Label(label)
                        kind = "integer" if name in ("top_k", "max_tokens", "seed") else "number"
                        yield Input(_fmt(getattr(s, name)), id=name, type=kind, compact=True,
                                    placeholder="default: " + (_fmt(d.get(name)) or "the model's"))
                    yield Label("KV cache")
                    yield Select([(k, k) for k in KV_FORMATS], id="kv_cache",
                                 value=s.kv_cache if s.kv_cache in KV_FORMATS else Select.NULL,
                                 prompt=f"default ({d.get('kv_cache', 'f16')})", compact=True)
                    yield Label("Backend")
                    yield Select([(b, b) for b in BACKENDS], id="backend",
                                 value=s.backend if s.backend in BACKENDS else Select.NULL,
                                 prompt=f"default ({d.get('backend', 'auto')})", compact=True)
            yield Label("", id="settings-error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save (ctrl+s)", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def _read(self) -> ChatSettings:
        """Collect the form; raises ValueError with a message on a bad number."""
        def num(name: str, conv):
            raw = self.query_one(f"#{name}", Input).value.strip()
            if not raw:
                return None
            try:
                return conv(raw)
            except ValueError:
                raise ValueError(f"{name}: '{raw}' is not a valid number") from None

        vals = {n: num(n, float) for n in ("temperature", "top_p")}
        vals.update({n: num(n, int) for n in ("top_k", "max_tokens", "seed")})
        if vals["temperature"] is not None and vals["temperature"] < 0:
            raise ValueError("temperature must be >= 0")
        if vals["top_p"] is not None and not 0 < vals["top_p"] <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if vals["top_k"] is not None and vals["top_k"] < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        if vals["max_tokens"] is not None and vals["max_tokens"] < 1:
            raise ValueError("max tokens must be >= 1")
        kv = self.query_one("#kv_cache", Select).value
        be = self.query_one("#backend", Select).value
        return ChatSettings(
            system_prompt=self.query_one("#system_prompt", TextArea).text,
            kv_cache=kv if isinstance(kv, str) else None,
            backend=be if isinstance(be, str) else None,
            **vals,
        )

    def action_save(self) -> None:
        """Validate and dismiss with the new settings (or show what is wrong)."""
        try:
            settings = self._read()
        except ValueError as e:
            self.query_one("#settings-error", Label).update(str(e))
            return
        self.dismiss(settings)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)
