"""Key and command-palette actions of :class:`~localmoe.tui.app.ChatApp` (the bindings are
the app's ``BINDINGS``; the keys are listed in :mod:`localmoe.tui.app`)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from textual.app import SystemCommand

from .screens.dialogs import ConfirmScreen, SettingsScreen, TextPromptScreen
from .store import ChatSettings, slugify
from .widgets.message import MessageView, code_blocks
from .widgets.prompt import PromptInput


def free_path(path: Path) -> Path:
    """``path`` if nothing is there, else the first free ``<stem>-2<suffix>``, ``-3``, ..."""
    candidate, n = path, 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


class ChatActions:
    """Mixin of :class:`~localmoe.tui.app.ChatApp`: what the keys and the command palette do
    (stop, new chat, regenerate, edit, rename, delete, export, settings, focus, copy, quit)."""

    def action_stop(self) -> None:
        """Esc: stop generating (keeps the partial answer), or leave edit mode."""
        if self.generating and self._cancel is not None:
            self._cancel.set()
        elif self._editing_id is not None:
            self._editing_id = None
            self.refresh_bindings()
            for v in self._log().query(MessageView):
                v.remove_class("-editing")
            self._chat_screen().query_one(PromptInput).clear()
            self._notify("Edit cancelled.", timeout=2)

    async def action_new_chat(self) -> None:
        """Start a new (unsaved until the first message) chat."""
        await self.open_chat(None)
        self._chat_screen().query_one(PromptInput).focus()

    async def action_regenerate(self) -> None:
        """Replace the last answer with a new one."""
        if self.generating or self.chat_id is None:
            return
        msgs = self.store.messages(self.chat_id)
        if not msgs:
            return
        if msgs[-1].role == "assistant":
            await self._delete_from(msgs[-1].id)
        if self.engine is None:
            self._show_error(self.load_error or "The model is still loading.")
            return
        await self.start_generation()

    def action_edit_last(self) -> None:
        """Put the last user message in the prompt; sending it replaces that message and
        everything after it (Esc cancels the edit)."""
        if self.generating or self.chat_id is None:
            return
        msgs = self.store.messages(self.chat_id)
        last_user = next((m for m in reversed(msgs) if m.role == "user"), None)
        if last_user is None:
            return
        self._editing_id = last_user.id
        self.refresh_bindings()
        for v in self._log().query(MessageView):
            v.set_class(v.message_id == last_user.id, "-editing")
        prompt = self._chat_screen().query_one(PromptInput)
        prompt.load_text(last_user.content)
        prompt.move_cursor(prompt.document.end)
        prompt.focus()
        self._notify("Editing your last message: Enter resends it, Esc cancels.", timeout=3)

    def action_rename_chat(self) -> None:
        """Rename the current chat."""
        if self.chat_id is None:
            self._notify("Send a message first; new chats are saved then.", severity="warning")
            return
        chat = self.store.get_chat(self.chat_id)

        async def done(title: str | None) -> None:
            if title is not None and self.chat_id == chat.id:
                if not self._saved(self.store.rename_chat, chat.id, title):
                    return
                await self._refresh_sidebar()
                self._update_titles()

        self.push_screen(TextPromptScreen("Rename chat", chat.title, ok_label="Rename"), done)

    def action_delete_chat(self) -> None:
        """Delete the current chat (asks first)."""
        if self.chat_id is None or self.generating:
            return
        chat = self.store.get_chat(self.chat_id)

        async def done(yes: bool | None) -> None:
            if yes:
                if not self._saved(self.store.delete_chat, chat.id):
                    return
                nxt = self.store.last_chat()
                await self.open_chat(nxt.id if nxt else None)
                self._notify(f"Deleted “{chat.title}”.", timeout=3)

        self.push_screen(ConfirmScreen(f"Delete the chat “{chat.title}”?", "Delete"), done)

    def action_export_chat(self) -> None:
        """Export the current chat to a Markdown file. The suggested path is a free one
        (``<cwd>/<title>.md``, else ``<title>-2.md``, ...); an existing file is never
        overwritten: the dialog says so and keeps the path typed."""
        if self.chat_id is None:
            self._notify("Nothing to export yet.", severity="warning")
            return
        chat = self.store.get_chat(self.chat_id)
        default = str(free_path(Path.cwd() / f"{slugify(chat.title)}.md"))
        written: list[Path] = []

        def write(path: str) -> str | None:
            """Write the file; an error message (the dialog stays open) or None."""
            if not path.strip():
                return "Type a file name."
            p = Path(path).expanduser()
            if p.is_dir():
                return f"{p} is a folder: add a file name."
            if p.exists() or p.is_symlink():
                return f"{p} already exists; not overwritten. Choose another name."
            try:
                with open(p, "x", encoding="utf-8") as f:  # "x": never replace a file
                    f.write(self.store.export_markdown(chat.id))
            except FileExistsError:
                return f"{p} already exists; not overwritten. Choose another name."
            except OSError as e:
                return f"Could not write {p}: {e.strerror or e}"
            written.append(p)
            return None

        def done(path: str | None) -> None:
            if written:
                self._notify(f"Exported to {written[-1]}", timeout=4)

        self.push_screen(TextPromptScreen("Export chat to Markdown file", default,
                                          ok_label="Export", submit=write), done)

    def action_settings(self) -> None:
        """Edit the current chat's settings; empty fields show the values in force (the
        model file's recommendations over the engine's defaults, the backend ``auto`` chose)."""
        from localmoe.engine.sampling import SamplingParams

        engine_defaults = SamplingParams()
        defaults: dict = {k: getattr(engine_defaults, k) for k in ("temperature", "top_p", "top_k")}
        defaults.update(self.model_defaults)
        defaults.setdefault("max_tokens", "until the end or a full context")
        defaults.setdefault("seed", "random")
        running = getattr(self.engine, "backend_name", None)  # what `auto` chose, if it did
        defaults["backend"] = (f"{self.default_backend}: {running}" if running and not
                               self.settings.backend and running != self.default_backend
                               else self.default_backend)
        defaults["kv_cache"] = self.default_kv

        async def done(settings: ChatSettings | None) -> None:
            if settings is None:
                return
            self.settings = settings
            if self.chat_id is None or self._saved(self.store.set_settings, self.chat_id,
                                                   settings):
                self._notify("Settings saved.", timeout=2)
            self._ensure_engine()

        self.push_screen(SettingsScreen(self.settings, defaults), done)

    def action_toggle_sidebar(self) -> None:
        """Show or hide the chat list."""
        sb = self._chat_screen().query_one("#sidebar")
        sb.display = not sb.display

    def action_focus_message(self, delta: int) -> None:
        """Move focus to the previous/next message (then ``c`` copies it, ``b`` its code)."""
        views = self._messages()
        if not views:
            return
        focused = self.focused
        if focused in views:
            i = views.index(focused) + delta
        else:
            i = len(views) - 1 if delta < 0 else 0
        if 0 <= i < len(views):
            views[i].focus()
            views[i].scroll_visible()
        else:
            self._chat_screen().query_one(PromptInput).focus()

    def action_toggle_help(self) -> None:
        """Show or hide the key bindings panel."""
        from textual.widgets import HelpPanel

        panels = self.screen.query(HelpPanel)
        if panels:
            panels.remove()
        else:
            self.action_show_help_panel()

    def action_copy_last_answer(self) -> None:
        """Copy the last assistant answer."""
        views = [v for v in self._messages() if v.role == "assistant"]
        if views:
            views[-1].action_copy_message()

    def action_copy_last_code(self) -> None:
        """Copy the last code block of the conversation."""
        for v in reversed(self._messages()):
            blocks = code_blocks(v.text)
            if blocks:
                self.copy_to_clipboard(blocks[-1])
                self._notify("Copied the last code block.", timeout=2)
                return
        self._notify("No code block in this chat.", severity="warning")

    def get_system_commands(self, screen) -> Iterable[SystemCommand]:
        """Command palette (Ctrl+P): the chat actions plus Textual's own (theme, keys, quit)."""
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Start a new conversation (Ctrl+N)", self.action_new_chat)
        yield SystemCommand("Stop generating", "Stop the answer, keep what is there (Esc)",
                            self.action_stop)
        yield SystemCommand("Regenerate", "Replace the last answer (Ctrl+R)",
                            self.action_regenerate)
        yield SystemCommand("Edit last message", "Edit and resend your last message (Ctrl+G)",
                            self.action_edit_last)
        yield SystemCommand("Rename chat", "Rename this chat (F2)", self.action_rename_chat)
        yield SystemCommand("Delete chat", "Delete this chat (F8)", self.action_delete_chat)
        yield SystemCommand("Export chat", "Save this chat as Markdown (F4)",
                            self.action_export_chat)
        yield SystemCommand("Chat settings", "System prompt, sampling, KV format, backend (F3)",
                            self.action_settings)
        yield SystemCommand("Copy last answer", "Copy the last answer to the clipboard",
                            self.action_copy_last_answer)
        yield SystemCommand("Copy last code block", "Copy the last code block",
                            self.action_copy_last_code)
        yield SystemCommand("Toggle sidebar", "Show or hide the chat list (Ctrl+B)",
                            self.action_toggle_sidebar)

    async def action_quit(self) -> None:
        """Ctrl+Q: stop a running answer (what was generated stays saved) and exit."""
        if self._cancel is not None:
            self._cancel.set()
        timer, self._feed_timer = self._feed_timer, None
        if timer is not None:
            timer.stop()
        if not self._screen_gone():
            for view in self._chat_screen().query(MessageView):
                await view.stop_stream()
        self.exit()
