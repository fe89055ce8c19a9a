"""``localmoe chat``: the Textual terminal UI.

The :class:`ChatApp` owns the engine (loaded in a worker thread, with progress), the chat
store (SQLite, :mod:`.store`) and the generation worker. Generation runs in a thread worker
that iterates ``engine.chat_stream(...)``, writes the growing answer to the store after every
token, and hands each delta to the UI with ``App.call_from_thread`` (which also throttles the
worker to the UI's pace). Esc sets the ``cancel`` event; the engine then ends the stream with
``finish_reason="cancelled"`` and the partial answer stays.

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
"""

from __future__ import annotations

import threading
import time
from functools import partial
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import ProgressBar

from localmoe.errors import ContextOverflowError, LocalMoEError
from localmoe.io.store import DEFAULT_MODEL

from .engine_api import (
    EngineFactory,
    EngineProtocol,
    build_sampling_params,
    default_engine_factory,
    expert_stats,
    sampling_defaults,
)
from .screens.chat import ChatScreen
from .screens.dialogs import ConfirmScreen, ContextFullScreen, SettingsScreen, TextPromptScreen
from .store import ChatSettings, ChatStore, Message, slugify
from .widgets.message import MessageView, code_blocks
from .widgets.prompt import PromptInput
from .widgets.sidebar import ChatList
from .widgets.stats import StatsBar

__all__ = ["ChatApp", "run_chat", "list_chats_text"]

UI_PUSH_S = 0.08
"""Seconds between hand-overs of streamed text from the generation worker to the UI."""

NO_MODEL_HELP = (
    "Pick a model with `localmoe chat -m MODEL` (a .gguf file, an HF model folder "
    "or a name from `localmoe list`); `localmoe pull smollm2` fetches a small one to try."
)


class _Feed:
    """Streamed text handed from the generation worker to the UI.

    The worker ``put``s every delta (never blocking on the UI); a UI timer ``take``s what has
    accumulated every UI_PUSH_S seconds, so a fast engine cannot flood the event loop and a
    slow one is still shown token by token.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: list[str] = []
        self._live: tuple | None = None

    def put(self, delta: str, live: tuple | None) -> None:
        """Add a delta and the latest live (ttft_ms, tok/s) measurement."""
        with self._lock:
            self._parts.append(delta)
            self._live = live

    def take(self) -> tuple[str, tuple | None]:
        """Everything put since the last take, and the latest live measurement."""
        with self._lock:
            text, live = "".join(self._parts), self._live
            self._parts.clear()
            self._live = None
        return text, live


def _stats_note(stats: dict[str, Any], finish: str | None) -> str:
    """Header note of an assistant message from its stored stats."""
    parts = []
    if stats.get("ttft_ms") is not None:
        parts.append(f"TTFT {stats['ttft_ms']:.0f} ms")
    if stats.get("decode_tok_s") is not None:
        parts.append(f"{stats['decode_tok_s']:.1f} tok/s")
    if stats.get("completion_tokens") is not None:
        parts.append(f"{stats['completion_tokens']} tokens")
    if finish == "cancelled":
        parts.append("stopped")
    elif finish == "length":
        parts.append("cut at the length limit")
    elif finish == "error":
        parts.append("failed")
    return " · ".join(parts)


class ChatApp(App):
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
        Binding("escape", "stop", "Stop", tooltip="Stop generating (keeps the partial answer)"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+g", "edit_last", "Edit last"),
        Binding("f2", "rename_chat", "Rename"),
        Binding("f3", "settings", "Settings"),
        Binding("f4", "export_chat", "Export"),
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
        self.refresh_bindings()  # the footer greys out Stop / Regenerate / Edit accordingly

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
        self.store.set_meta("theme", theme.name)

    async def screen_ready(self) -> None:
        """Called by ChatScreen once its widgets exist: open the first chat, start loading."""
        chat = self.store.last_chat() if self.continue_last else None
        if chat is not None:
            await self.open_chat(chat.id)
            if self.model is None:
                self.model = chat.model
        else:
            await self._refresh_sidebar()
            self._update_titles()
        if self.model is None:
            self.model = self.store.get_meta("last_model")
        self._started = True
        self._ensure_engine()

    # -- engine --------------------------------------------------------------------------

    def _key_for(self, settings: ChatSettings) -> tuple:
        return (self.model, settings.backend or self.default_backend,
                settings.kv_cache or self.default_kv, self.n_ctx_arg)

    def _ensure_engine(self) -> None:
        """Load (or reload) the engine when the current chat needs a different one."""
        key = self._key_for(self.settings)
        if key == self.engine_key and (self.engine is not None or self.loading):
            return
        if self.generating:  # never close the engine under a running answer
            self._reload_pending = True
            return
        self._reload_pending = False
        self._wanted_key = key
        old, self.engine = self.engine, None
        self.engine_key = key
        self.loading = True
        self.load_error = None
        self._progress(0.0)
        name = Path(str(self.model)).name if self.model else "the default model"
        self._stats(status=f"loading {name}…")
        self._load_worker(key, old)

    @work(thread=True, exclusive=True, group="load")
    def _load_worker(self, key: tuple, old: EngineProtocol | None) -> None:
        model, backend, kv, n_ctx = key
        if old is not None:
            try:
                old.close()
            except Exception:
                pass

        def progress(fraction: float, message: str = "") -> None:
            self._ui(self._on_load_progress, key, fraction, message)

        try:
            extra = {"device": self.device} if self.device is not None else {}
            engine = self.engine_factory(model, backend=backend, n_ctx=n_ctx, kv_cache=kv,
                                         progress=progress, **extra)
        except LocalMoEError as e:
            hint = f" {NO_MODEL_HELP}" if model is None else ""
            self._ui(self._on_load_failed, key,
                     f"Could not load the model {model or '(default)'}: {e}{hint}")
        except Exception as e:  # a bug, but the UI must not die
            self._ui(self._on_load_failed, key,
                     f"Could not load the model {model}: unexpected {type(e).__name__}: {e}")
        else:
            self._ui(self._on_loaded, key, engine)

    def _on_load_progress(self, key: tuple, fraction: float, message: str) -> None:
        if key != self._wanted_key:
            return
        self._progress(fraction)
        self._stats(status=f"loading {fraction * 100:.0f}% {message}".rstrip())

    def _on_load_failed(self, key: tuple, message: str) -> None:
        if key != self._wanted_key:
            return
        self.loading = False
        self.load_error = message
        self._progress(None)
        self._stats(status="model not loaded")
        self._show_error(message)

    def _on_loaded(self, key: tuple, engine: EngineProtocol) -> None:
        if key != self._wanted_key:
            engine.close()
            return
        self.engine = engine
        self.loading = False
        self.load_error = None
        self._progress(None)
        try:
            self.model_defaults = sampling_defaults(getattr(engine.model_file, "metadata", None))
        except Exception:
            self.model_defaults = {}
        if self.model is not None:
            self.store.set_meta("last_model", str(self.model))
        rs = self._runner_stats()
        hit, gbps = expert_stats(rs)
        self._stats(status="", backend=getattr(engine, "backend_name", None),
                    device=rs.get("device"), n_ctx=getattr(engine, "n_ctx", None),
                    kv_bytes=rs.get("kv_bytes"), expert_hit_rate=hit, h2d_gbps=gbps)
        self._update_titles()

    def _runner_stats(self) -> dict:
        try:
            runner = getattr(self.engine, "runner", None)
            s = runner.stats() if runner is not None else {}
            return s if isinstance(s, dict) else {}
        except Exception:
            return {}

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
        views = [self._view_for(m) for m in messages]
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
        name = getattr(self.engine, "model_name", None) or (
            Path(str(self.model)).name if self.model else "no model")
        self.title = f"localmoe — {name}"
        chat = self.store.get_chat(self.chat_id) if self.chat_id is not None else None
        self.sub_title = chat.title if chat else "New chat"

    def _ensure_saved_chat(self, first_prompt: str) -> int:
        if self.chat_id is None:
            title = first_prompt.strip().splitlines()[0][:48] if first_prompt.strip() else "New chat"
            chat = self.store.create_chat(title, model=self.model or DEFAULT_MODEL, settings=self.settings)
            self.chat_id = chat.id
        return self.chat_id

    # -- sending & generation ------------------------------------------------------------

    async def send_prompt(self, text: str) -> bool:
        """Send ``text`` as the next user message and start generating the answer.

        Returns False (keeping the text in the prompt) when nothing was sent: empty text,
        an answer still running, or no model loaded (the reason is shown).
        """
        if not text.strip():
            return False
        if self.generating:
            self._notify("An answer is still being generated; Esc stops it.", severity="warning")
            return False
        if self.engine is None:
            if self.loading:
                self._notify("The model is still loading; your text is kept.", severity="warning")
            else:
                self._show_error(self.load_error or NO_MODEL_HELP)
            return False
        if self._editing_id is not None and self.chat_id is not None:
            await self._delete_from(self._editing_id)
            self._editing_id = None
        chat_id = self._ensure_saved_chat(text)
        msg = self.store.add_message(chat_id, "user", text)
        self.store.set_model(chat_id, str(self.model) if self.model else None)
        prompt = self._chat_screen().query_one(PromptInput)
        prompt.remember(text)
        prompt.clear()
        await self._log().mount(MessageView("user", text, message_id=msg.id))
        await self._refresh_sidebar()
        self._update_titles()
        await self.start_generation()
        return True

    def _conversation(self) -> list[dict]:
        msgs: list[dict] = []
        if self.settings.system_prompt.strip():
            msgs.append({"role": "system", "content": self.settings.system_prompt})
        for m in self.store.messages(self.chat_id):
            if m.dropped or m.role not in ("user", "assistant", "system") or not m.content:
                continue
            msgs.append({"role": m.role, "content": m.content})
        return msgs

    async def start_generation(self) -> None:
        """Generate an assistant answer to the current chat's messages in a worker."""
        if self.engine is None or self.chat_id is None or self.generating:
            return
        try:
            params = build_sampling_params(self.settings, self.model_defaults)
        except LocalMoEError as e:
            self._show_error(f"Invalid chat settings: {e} (F3 opens the settings).")
            return
        messages = self._conversation()
        answer = self.store.add_message(self.chat_id, "assistant", "")
        view = MessageView("assistant", "", message_id=answer.id, note="…")
        view.add_class("-streaming")
        await self._log().mount(view)
        self._log().scroll_end(animate=False)
        self.generating = True
        self._cancel = threading.Event()
        self._stats(ttft_ms=None, tok_s=None)
        feed = _Feed()
        self._feed_timer = self.set_interval(UI_PUSH_S, partial(self._pump, view, feed))
        self._generate_worker(self.engine, messages, params, answer.id, view, self._cancel, feed)

    @work(thread=True, exclusive=True, group="generate")
    def _generate_worker(self, engine: EngineProtocol, messages: list[dict], params: Any,
                         message_id: int, view: MessageView, cancel: threading.Event,
                         feed: "_Feed") -> None:
        text = ""
        t0 = time.perf_counter()
        t_first: float | None = None
        n_tokens = 0
        result = None
        try:
            for ev in engine.chat_stream(messages, params, cancel=cancel):
                if getattr(ev, "token_id", None) is not None:
                    n_tokens += 1
                delta = getattr(ev, "delta", "") or ""
                if delta:
                    now = time.perf_counter()
                    if t_first is None:
                        t_first = now
                    text += delta
                    self.store.update_message(message_id, text)  # flushed per token
                    dt = now - t_first
                    feed.put(delta, ((t_first - t0) * 1e3, (n_tokens - 1) / dt if dt > 0 else None))
                if getattr(ev, "done", False):
                    result = getattr(ev, "result", None)
                if not self.is_running:
                    cancel.set()
        except ContextOverflowError as e:
            self._finish_failed(message_id, text)
            self._ui(self._on_context_full, view, e)
            return
        except LocalMoEError as e:
            self._finish_failed(message_id, text)
            self._ui(self._on_generation_error, view, str(e), text)
            return
        except Exception as e:  # a bug in the engine must not kill the UI
            self._finish_failed(message_id, text)
            self._ui(self._on_generation_error, view,
                     f"unexpected {type(e).__name__}: {e}", text)
            return
        finish = getattr(result, "finish_reason", None) or ("cancelled" if cancel.is_set()
                                                            else "stop")
        stats: dict[str, Any] = {}
        if result is not None:
            timings = getattr(result, "timings", None)
            stats = {
                "ttft_ms": getattr(timings, "ttft_ms", None),
                "decode_tok_s": getattr(timings, "decode_tok_s", None),
                "prompt_tokens": getattr(result, "prompt_tokens", None),
                "completion_tokens": getattr(result, "completion_tokens", None),
            }
            if getattr(result, "text", None) and len(result.text) > len(text):
                text = result.text  # anything held back by stop-string checks
        self.store.update_message(message_id, text, finish_reason=finish, stats=stats)
        self._ui(self._on_generation_done, view, text, finish, stats)

    def _finish_failed(self, message_id: int, text: str) -> None:
        """Keep a partial answer (marked failed) or remove the empty answer row."""
        if text:
            self.store.update_message(message_id, text, finish_reason="error")
        else:
            self.store.delete_message(message_id)

    def _ui(self, fn, *args) -> bool:
        """Run ``fn(*args)`` on the UI thread; False when the app has gone away."""
        try:
            self.call_from_thread(fn, *args)
            return True
        except RuntimeError:
            return False

    async def _pump(self, view: MessageView, feed: "_Feed") -> None:
        """Timer (every UI_PUSH_S): move streamed text from the worker's feed to the view."""
        text, live = feed.take()
        if text:
            await view.append(text)
        if live is not None:
            self._stats(ttft_ms=live[0], tok_s=live[1])

    async def _end_stream(self, view: MessageView) -> None:
        """Stop the feed timer and show whatever was still pending."""
        timer, self._feed_timer = self._feed_timer, None
        if timer is not None:
            timer.stop()
        self.generating = False
        view.remove_class("-streaming")
        if self._reload_pending and not self._screen_gone():
            self._ensure_engine()  # settings changed during the answer

    def _screen_gone(self) -> bool:
        """True while the app is shutting down (the chat screen is no longer there)."""
        return not any(isinstance(s, ChatScreen) for s in self.screen_stack)

    async def _on_generation_done(self, view: MessageView, text: str, finish: str,
                                  stats: dict) -> None:
        await self._end_stream(view)
        if self._screen_gone():
            return
        if text != view.text:
            view._text = text
        await view.finish()
        view.set_note(_stats_note(stats, finish))
        rs = self._runner_stats()
        hit, gbps = expert_stats(rs)
        used = None
        if stats.get("prompt_tokens") is not None and stats.get("completion_tokens") is not None:
            used = stats["prompt_tokens"] + stats["completion_tokens"]
        self._stats(ttft_ms=stats.get("ttft_ms"), tok_s=stats.get("decode_tok_s"),
                    ctx_used=used, expert_hit_rate=hit, h2d_gbps=gbps)
        if "kv_bytes" in rs:
            self._stats(kv_bytes=rs["kv_bytes"])
        self.store.touch(self.chat_id)
        n_ctx = getattr(self.engine, "n_ctx", None)
        if (finish == "length" and used is not None and n_ctx and used >= n_ctx
                and not self.settings.max_tokens):
            self._offer_context_full(
                f"The answer stopped because the context ({n_ctx} tokens) is full.")

    async def _on_generation_error(self, view: MessageView, message: str, text: str) -> None:
        await self._end_stream(view)
        if self._screen_gone():
            return
        if text:
            view._text = text
            await view.finish()
            view.set_note("failed")
        else:
            await view.remove()
        self._show_error(f"Generation failed: {message}")

    async def _on_context_full(self, view: MessageView, e: ContextOverflowError) -> None:
        await self._end_stream(view)
        if self._screen_gone():
            return
        await view.remove()
        self._offer_context_full(
            f"This conversation is {e.n_prompt} tokens but the context holds {e.n_ctx}.")

    def _offer_context_full(self, why: str) -> None:
        self._show_error(f"Context full: {why} Start a new chat or drop the oldest turns.")

        def chosen(choice: str | None) -> None:
            if choice == "new":
                self.run_worker(self._continue_in_new_chat(), exclusive=False)
            elif choice == "drop":
                self.run_worker(self._drop_oldest_and_retry(), exclusive=False)

        self.push_screen(ContextFullScreen(
            why + "\n\nNew chat: ask your last question again in a fresh chat.\n"
                  "Drop oldest turns: forget the earliest exchanges of this chat and retry."),
            chosen)

    async def _continue_in_new_chat(self) -> None:
        msgs = self.store.messages(self.chat_id) if self.chat_id is not None else []
        last_user = next((m for m in reversed(msgs) if m.role == "user"), None)
        await self.open_chat(None, settings=self.settings)
        if last_user is not None:
            await self.send_prompt(last_user.content)

    def _estimate_tokens(self, messages: Iterable[str]) -> int:
        return sum(self.engine.count_tokens(t) + 8 for t in messages)

    async def _drop_oldest_and_retry(self) -> None:
        """Mark the oldest turns as dropped until the rest fits in ~3/4 of the context, then
        regenerate the answer to the last user message."""
        if self.engine is None or self.chat_id is None:
            return
        msgs = [m for m in self.store.messages(self.chat_id) if not m.dropped]
        # Remove a trailing assistant answer (it is regenerated) from the kept set.
        if msgs and msgs[-1].role == "assistant":
            await self._delete_from(msgs[-1].id)
            msgs = msgs[:-1]
        budget = int(self.engine.n_ctx * 0.75)
        fixed = [self.settings.system_prompt] if self.settings.system_prompt else []
        dropped: list[int] = []
        while len(msgs) > 1:
            # drop one turn: the first message and, if it is a user message, its answer
            first = msgs.pop(0)
            dropped.append(first.id)
            if first.role == "user" and len(msgs) > 1 and msgs[0].role == "assistant":
                dropped.append(msgs.pop(0).id)
            if self._estimate_tokens(fixed + [m.content for m in msgs]) <= budget:
                break
        if not dropped or self._estimate_tokens(fixed + [m.content for m in msgs]) > budget:
            self._show_error(
                "Even without older turns the last message does not fit in the context "
                f"({self.engine.n_ctx} tokens): shorten it, or restart with a larger --ctx-size.")
            if dropped:
                self.store.set_dropped(dropped, False)
            return
        self.store.set_dropped(dropped)
        await self.open_chat(self.chat_id)
        self._notify(f"Dropped {len(dropped)} old message(s) from the context.")
        await self.start_generation()

    async def _delete_from(self, message_id: int) -> None:
        """Delete a message and everything after it, in the store and on screen."""
        self.store.delete_messages_from(self.chat_id, message_id)
        for v in list(self._log().query(MessageView)):
            if v.message_id is not None and v.message_id >= message_id:
                await v.remove()

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

    def _notify(self, message: str, **kw) -> None:
        """``notify`` with markup off: messages carry user and engine text (titles, paths,
        template errors) that must be shown verbatim, never parsed as Textual markup."""
        self.notify(message, markup=False, **kw)

    def _messages(self) -> list[MessageView]:
        return [v for v in self._log().query(MessageView) if v.message_id is not None]

    # -- actions -------------------------------------------------------------------------

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
                self.store.rename_chat(chat.id, title)
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
                self.store.delete_chat(chat.id)
                nxt = self.store.last_chat()
                await self.open_chat(nxt.id if nxt else None)
                self._notify(f"Deleted “{chat.title}”.", timeout=3)

        self.push_screen(ConfirmScreen(f"Delete the chat “{chat.title}”?", "Delete"), done)

    def action_export_chat(self) -> None:
        """Export the current chat to a Markdown file."""
        if self.chat_id is None:
            self._notify("Nothing to export yet.", severity="warning")
            return
        chat = self.store.get_chat(self.chat_id)
        default = str(Path.cwd() / f"{slugify(chat.title)}.md")

        def done(path: str | None) -> None:
            if not path:
                return
            try:
                p = Path(path).expanduser()
                p.write_text(self.store.export_markdown(chat.id), encoding="utf-8")
            except OSError as e:
                self._show_error(f"Could not write {path}: {e}")
                return
            self._notify(f"Exported to {p}", timeout=4)

        self.push_screen(TextPromptScreen("Export chat to Markdown file", default,
                                          ok_label="Export"), done)

    def action_settings(self) -> None:
        """Edit the current chat's settings."""
        defaults = dict(self.model_defaults)
        defaults.setdefault("backend", self.default_backend)
        defaults.setdefault("kv_cache", self.default_kv)

        async def done(settings: ChatSettings | None) -> None:
            if settings is None:
                return
            self.settings = settings
            if self.chat_id is not None:
                self.store.set_settings(self.chat_id, settings)
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

    async def on_unmount(self) -> None:
        if self._cancel is not None:
            self._cancel.set()


def run_chat(model: str | None = None, backend: str = "auto", n_ctx: int | None = None,
             kv_cache: str = "f16", continue_last: bool = False,
             device: str | None = None) -> None:
    """Run the chat UI in the terminal until the user quits (``localmoe chat``).

    Args:
        model: model path or name (None: the continued chat's model, the last one used, or
            the engine's default model).
        backend: backend name or ``auto``.
        n_ctx: context size in tokens (None: engine default).
        kv_cache: KV cache format (any string ``KVSpec.parse`` takes).
        continue_last: reopen the most recent chat (``--continue``).
        device: backend device (``cpu``, ``cuda``, ``cuda:N``; None: backend default).
    """
    app = ChatApp(model, backend=backend, n_ctx=n_ctx, kv_cache=kv_cache,
                  continue_last=continue_last, device=device)
    try:
        app.run()
    finally:
        engine = app.engine
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
        app.store.close()


def list_chats_text(store: ChatStore | None = None) -> str:
    """The saved chats as a text table for ``localmoe chat --list`` (most recent first)."""
    own = store is None
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
