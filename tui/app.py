"""``localmoe chat``: the Textual terminal UI.

The :class:`ChatApp` owns the engine (loaded in a worker thread, with progress:
:mod:`.loading`), the chat store (SQLite, :mod:`.store`) and the generation worker
(:mod:`.generation`). Generation runs in a thread worker that iterates
``engine.chat_stream(...)``, writes the growing answer to the store after every token, and
hands the deltas to the UI through a feed a UI timer drains (``App.call_from_thread`` for the
rest). Esc sets the ``cancel`` event; the engine then ends the stream with
``finish_reason="cancelled"`` and the partial answer stays. What the keys do is in
:mod:`.actions`; screens and dialogs in :mod:`.screens`, widgets in :mod:`.widgets`.

No inference happens here: the engine comes from ``engine_factory`` (by default
``localmoe.LLM``; tests inject a scripted fake).

Entry points used by the CLI: :func:`run_chat` and :func:`list_chats_text`.

Keys (also in the footer, under ``?`` / F1, and as Ctrl+P commands)::

    Enter            send                    Ctrl+J / Shift+Enter  new line
    Up / Down        prompt history          Esc                   stop the answer (keeps it)
    Ctrl+R           regenerate last answer  Ctrl+G                edit and resend last message
    Ctrl+N           new chat                F2 / F8               rename / delete chat
    F3               chat settings           F4                    export chat to Markdown
    Ctrl+Up / Down   focus a message, then   c: copy it   b: copy its code blocks
    Ctrl+B           toggle the sidebar      Ctrl+P                command palette (themes too)
    Ctrl+Q           quit

Dialogs: Esc closes one. The "Context full" dialog opens by itself (an answer filled the
context), so it has no letter keys: Tab or Left/Right picks New chat / Drop oldest turns /
Close, Enter chooses (Close has the focus first), and what is typed meanwhile goes to the
message box. Export (F4) suggests a free file name and never overwrites an existing file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from textual.app import App
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import ProgressBar

from localmoe.errors import LocalMoEError, StoreError
from localmoe.io.store import DEFAULT_MODEL

from .actions import ChatActions
from .engine_api import EngineFactory, EngineProtocol, default_engine_factory
from .generation import Generation, _stats_note
from .loading import EngineLoading
from .screens.chat import ChatScreen
from .store import ChatSettings, ChatStore, Message
from .widgets.message import MessageView
from .widgets.sidebar import ChatList
from .widgets.stats import StatsBar

__all__ = ["ChatApp", "run_chat", "list_chats_text"]


class ChatApp(EngineLoading, Generation, ChatActions, App):
    """The localmoe chat application.

    Args:
        model: model path or name to load (None: the model of the continued chat, else the
            last model used, else the engine's default model, pulled on first use).
        backend: backend name or ``auto`` (a chat's own setting overrides it).
        n_ctx: context size in tokens (None: the engine's default).
        kv_cache: KV cache format, any string ``KVSpec.parse`` takes (``"int4"``,
            ``"k=int8,v=int4"``, ``"int2,sinks=4"``); a chat's own setting overrides it.
        continue_last: open the most recently updated chat.
        device: backend device (``"cpu"``, ``"cuda"``, ``"cuda:N"``; None: backend default).
        engine_factory: ``factory(model, backend=, n_ctx=, kv_cache=, progress=[, device=])
            -> engine``; defaults to ``localmoe.LLM``. ``device`` is passed only when set.
        store: a :class:`ChatStore` (default: the one under the data dir).
    """

    CSS_PATH = "app.tcss"
    TITLE = "localmoe"

    BINDINGS = [
        # Textual's own ctrl+q is hidden from the footer; a newcomer looks there for the way out
        Binding("ctrl+q", "quit", "Quit", priority=True,
                tooltip="Quit (a running answer is stopped; what was generated stays saved)"),
        Binding("escape", "stop", "Stop", tooltip="Stop generating (keeps the partial answer)"),
        # the footer shows these in this order and cuts off what does not fit: at 80 columns
        # (next to ^p palette) Quit .. Rename just fit, so Regenerate and Edit last are left to
        # F1 and Ctrl+P
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("f3", "settings", "Settings"),
        Binding("f4", "export_chat", "Export"),
        Binding("f2", "rename_chat", "Rename"),
        Binding("ctrl+r", "regenerate", "Regenerate", show=False),
        Binding("ctrl+g", "edit_last", "Edit last", show=False),
        Binding("f8", "delete_chat", "Delete", show=False),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", show=False),
        Binding("ctrl+up", "focus_message(-1)", "Previous message", show=False),
        Binding("ctrl+down", "focus_message(1)", "Next message", show=False),
        Binding("question_mark,f1", "toggle_help", "Keys", show=False),
    ]

    def __init__(self, model: str | None = None, *, backend: str = "auto",
                 n_ctx: int | None = None, kv_cache: str = "f16", continue_last: bool = False,
                 engine_factory: EngineFactory | None = None,
                 store: ChatStore | None = None, device: str | None = None) -> None:
        super().__init__()
        self.store = store if store is not None else ChatStore()
        self.engine_factory = engine_factory or default_engine_factory
        self.default_backend = backend or "auto"
        self.default_kv = kv_cache or "f16"
        self.n_ctx_arg = n_ctx
        self.device = device
        self.continue_last = continue_last
        self.model = model
        self.engine: EngineProtocol | None = None
        self.engine_key: tuple | None = None
        self.loading = False
        self.load_error: str | None = None
        self.model_defaults: dict[str, Any] = {}
        self.chat_id: int | None = None  # None: a new chat not saved yet
        self.settings = ChatSettings()
        self._generating = False
        self._cancel: threading.Event | None = None
        self._editing_id: int | None = None
        self._wanted_key: tuple | None = None
        self._started = False
        self._feed_timer = None
        self._reload_pending = False

    @property
    def generating(self) -> bool:
        """True while an answer is being generated."""
        return self._generating

    @generating.setter
    def generating(self, value: bool) -> None:
        self._generating = bool(value)
        self.refresh_bindings()  # the footer greys out Stop accordingly

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Grey out actions that do nothing right now (None = shown but disabled)."""
        if action == "stop":
            return True if (self._generating or self._editing_id is not None) else None
        if action in ("regenerate", "edit_last"):
            return None if (self._generating or self.chat_id is None) else True
        return True

    # -- setup ---------------------------------------------------------------------------

    def get_default_screen(self) -> ChatScreen:
        return ChatScreen(history=self.store.recent_prompts())

    def on_mount(self) -> None:
        """Restore the theme chosen last time (Ctrl+P > Change theme) and remember changes."""
        saved = self.store.get_meta("theme")
        if saved and saved in self.available_themes:
            self.theme = saved
        self.theme_changed_signal.subscribe(self, self._remember_theme)

    def _remember_theme(self, theme) -> None:
        self._saved(self.store.set_meta, "theme", theme.name)

    async def screen_ready(self) -> None:
        """Called by ChatScreen once its widgets exist: open the first chat, start loading."""
        chat = self.store.last_chat() if self.continue_last else None
        if chat is not None:
            if self.model is None:  # before the chat opens: its title names the model
                self.model = chat.model
            await self.open_chat(chat.id)
        else:
            await self._refresh_sidebar()
            self._update_titles()
        if self.model is None:
            self.model = self.store.get_meta("last_model")
        self._started = True
        self._ensure_engine()

    # -- chats ---------------------------------------------------------------------------

    async def open_chat(self, chat_id: int | None, settings: ChatSettings | None = None) -> None:
        """Show chat ``chat_id`` (None: a fresh unsaved chat, with ``settings`` if given)."""
        if self.generating:
            self._notify("Stop the answer being generated first (Esc).", severity="warning")
            return
        self._editing_id = None
        if chat_id is None:
            self.chat_id, self.settings = None, settings or ChatSettings()
            messages: list[Message] = []
        else:
            chat = self.store.get_chat(chat_id)
            if chat is None:
                self._notify("That chat no longer exists.", severity="warning")
                return
            self.chat_id, self.settings = chat.id, chat.settings
            messages = self.store.messages(chat.id)
        log = self._log()
        await log.remove_children()
        # an answer killed before its first token left an empty message without an end: not shown
        views = [self._view_for(m) for m in messages
                 if not (m.role == "assistant" and m.finish_reason is None and not m.content)]
        if views:
            await log.mount_all(views)
        log.scroll_end(animate=False)
        await self._refresh_sidebar()
        self._update_titles()
        self._stats(ttft_ms=None, tok_s=None, ctx_used=None)
        self.refresh_bindings()
        if self._started:
            self._ensure_engine()

    def _view_for(self, m: Message) -> MessageView:
        note = _stats_note(m.stats, m.finish_reason) if m.role == "assistant" else ""
        if m.dropped:
            note = (note + " · " if note else "") + "dropped from context"
        v = MessageView(m.role, m.content, message_id=m.id, note=note)
        if m.dropped:
            v.add_class("-dropped")
        return v

    async def _refresh_sidebar(self) -> None:
        await self._chat_screen().query_one(ChatList).set_chats(self.store.list_chats(), self.chat_id)

    def _update_titles(self) -> None:
        """Title: the model (the one loading, with "loading…", or the one loaded); sub-title:
        the chat."""
        name = getattr(self.engine, "model_name", None) or Path(
            str(self.model or self.store.get_meta("last_model") or DEFAULT_MODEL)).name
        state = " (loading…)" if self.loading else (" (not loaded)" if self.load_error else "")
        self.title = f"localmoe — {name}{state}"
        chat = self.store.get_chat(self.chat_id) if self.chat_id is not None else None
        self.sub_title = chat.title if chat else "New chat"

    def _ensure_saved_chat(self, first_prompt: str) -> int:
        if self.chat_id is None:
            title = first_prompt.strip().splitlines()[0][:48] if first_prompt.strip() else "New chat"
            chat = self.store.create_chat(title, model=self.model or DEFAULT_MODEL, settings=self.settings)
            self.chat_id = chat.id
        return self.chat_id

    # -- helpers -------------------------------------------------------------------------

    def _log(self) -> VerticalScroll:
        return self._chat_screen().query_one("#chat-log", VerticalScroll)

    def _chat_screen(self) -> ChatScreen:
        """The ChatScreen (also while a dialog is open on top of it)."""
        for s in reversed(self.screen_stack):
            if isinstance(s, ChatScreen):
                return s
        raise RuntimeError("chat screen not mounted")

    def _statsbar(self) -> StatsBar:
        return self._chat_screen().query_one(StatsBar)

    def _stats(self, **changes) -> None:
        try:
            self._statsbar().show(**changes)
        except Exception:
            pass

    def _progress(self, fraction: float | None) -> None:
        try:
            bar = self._chat_screen().query_one("#load-progress", ProgressBar)
        except Exception:
            return
        bar.display = fraction is not None
        if fraction is not None:
            bar.update(progress=max(0.0, min(1.0, fraction)) * 100)

    def _show_error(self, message: str) -> None:
        """Show an error in the chat log (not stored) and as a notification."""
        try:
            log = self._log()
        except Exception:
            log = None
        if log is not None:
            log.mount(MessageView("error", message))
            log.scroll_end(animate=False)
        self._notify(message, severity="error", timeout=8)

    def _saved(self, write, *args) -> bool:
        """Run a chat database write (``write(*args)``); when the database refuses it (a full
        disk, another process keeping it locked) show why and return False: the app goes on."""
        try:
            write(*args)
            return True
        except StoreError as e:
            self._show_error(str(e))
            return False

    def _notify(self, message: str, **kw) -> None:
        """``notify`` with markup off: messages carry user and engine text (titles, paths,
        template errors) that must be shown verbatim, never parsed as Textual markup."""
        self.notify(message, markup=False, **kw)

    def _messages(self) -> list[MessageView]:
        return [v for v in self._log().query(MessageView) if v.message_id is not None]

    async def on_unmount(self) -> None:
        if self._cancel is not None:
            self._cancel.set()


def _isatty(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def run_chat(model: str | None = None, backend: str = "auto", n_ctx: int | None = None,
             kv_cache: str = "f16", continue_last: bool = False,
             device: str | None = None) -> int:
    """Run the chat UI in the terminal until the user quits (``localmoe chat``). Returns 0,
    or 128 + the signal's number when SIGTERM / SIGHUP ended it (:func:`quit_on_signals`).

    Args:
        model: model path or name (None: the continued chat's model, the last one used, or
            the engine's default model).
        backend: backend name or ``auto``.
        n_ctx: context size in tokens (None: engine default).
        kv_cache: KV cache format (any string ``KVSpec.parse`` takes).
        continue_last: reopen the most recent chat (``--continue``).
        device: backend device (``cpu``, ``cuda``, ``cuda:N``; None: backend default).

    Raises:
        LocalMoEError: stdin or stdout is not a terminal (nothing is pulled or loaded).
    """
    if not (_isatty(sys.stdin) and _isatty(sys.stdout)):
        raise LocalMoEError("localmoe chat needs a terminal (stdin and stdout); from a script or "
                            "a pipe use `localmoe generate` or `localmoe serve`")
    app = ChatApp(model, backend=backend, n_ctx=n_ctx, kv_cache=kv_cache,
                  continue_last=continue_last, device=device)
    try:
        with quit_on_signals(app):
            app.run()
        return app.return_code or 0
    finally:
        engine = app.engine
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
        app.store.close()


#: seconds a quit signal gives the UI to exit before the process ends at once (128 + signal)
QUIT_GRACE_S = 5.0

#: the signals that quit the chat UI as Ctrl+Q does (``kill``, ``timeout``, a closed terminal)
QUIT_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def quit_on_signals(app):
    """While the block runs ``app`` (a Textual App, on the main thread), SIGTERM and SIGHUP quit
    it the way Ctrl+Q does: the app leaves the alternate screen and turns mouse reporting,
    bracketed paste and the hidden cursor back, so the terminal is usable afterwards (killed by
    the signal itself, it was left in the UI's modes). The app's return code is then 128 + the
    signal's number. A handler someone else set, or an ignored signal, is left as it is; the
    previous handlers are restored afterwards. Off the main thread: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = {s: signal.getsignal(s) for s in QUIT_SIGNALS}

    def on_signal(signum, frame):
        # the handler runs on the main thread, inside the app's event loop: hand the exit to the
        # loop through its thread-safe queue instead of touching the app from the handler
        import asyncio

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:            # before or after the loop: stop as Ctrl-C would
            raise KeyboardInterrupt from None
        loop.call_soon_threadsafe(lambda: app.exit(return_code=128 + signum))
        # the loop can be stuck where it never gets to the exit: a terminal that stopped
        # reading filled the pty, the display blocks on Textual's full write queue, and when the
        # terminal then closes Textual's writer thread dies, so the queue never drains (the
        # process stayed up for good, its input thread spinning at 100% CPU). Quit regardless.
        if not watchdog:
            t = threading.Timer(QUIT_GRACE_S, os._exit, args=(128 + signum,))
            t.daemon = True
            watchdog.append(t)
            t.start()

    watchdog: list[threading.Timer] = []
    for s, h in prev.items():
        if h is signal.SIG_DFL:
            signal.signal(s, on_signal)
    try:
        yield
    finally:
        for t in watchdog:
            t.cancel()
        for s, h in prev.items():
            if h is signal.SIG_DFL:
                signal.signal(s, h)


def list_chats_text(store: ChatStore | None = None) -> str:
    """The saved chats as a text table for ``localmoe chat --list`` (most recent first). Without
    a chat database yet, says so and creates none (listing writes nothing).

    Raises:
        localmoe.errors.StoreError: the database path is there but cannot be opened (a
            folder, an unreadable file, not a chat database).
    """
    from .store import default_db_path

    own = store is None
    if own and not default_db_path().exists():  # a folder or an unreadable file is an error
        return "No saved chats. Start one with `localmoe chat -m MODEL`."
    store = store or ChatStore()
    try:
        chats = store.list_chats()
    finally:
        if own:
            store.close()
    if not chats:
        return "No saved chats. Start one with `localmoe chat -m MODEL`."
    rows = [("ID", "UPDATED", "MSGS", "MODEL", "TITLE")]
    for c in chats:
        rows.append((str(c.id), datetime.fromtimestamp(c.updated).strftime("%Y-%m-%d %H:%M"),
                     str(c.n_messages), Path(c.model).name if c.model else "-", c.title))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    return "\n".join(lines)
