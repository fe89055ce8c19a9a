"""Sending prompts and streaming answers for :class:`~localmoe.tui.app.ChatApp`.

The generation worker (a thread) iterates ``engine.chat_stream(...)``, writes the growing
answer to the chat store after every token and ``put``s each delta into a :class:`_Feed`; a UI
timer moves what accumulated to the message view every :data:`UI_PUSH_S` seconds. Esc sets the
``cancel`` event; the engine then ends the stream with ``finish_reason="cancelled"`` and the
partial answer stays. A prompt over the context offers a new chat or dropping the oldest turns.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any, Iterable

from textual import work

from localmoe.errors import ContextOverflowError, LocalMoEError, StoreError
from localmoe.io.store import DEFAULT_MODEL

from .engine_api import EngineProtocol, build_sampling_params, expert_stats
from .loading import NO_MODEL_HELP
from .screens.chat import ChatScreen
from .screens.dialogs import ContextFullScreen
from .widgets.message import MessageView
from .widgets.prompt import PromptInput

UI_PUSH_S = 0.08
"""Seconds between hand-overs of streamed text from the generation worker to the UI."""


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
    """Header note of an assistant message from its stored stats (``finish`` None: an answer
    stored without an end, cut by a kill: "interrupted")."""
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
    elif finish is None:  # stored without an end: the process was killed mid-answer
        parts.append("interrupted")
    return " · ".join(parts)


class Generation:
    """Mixin of :class:`~localmoe.tui.app.ChatApp`: send a prompt, run the generation worker,
    show its stream and its end (done, failed, context full). Uses the app's state (``store``,
    ``engine``, ``chat_id``, ``settings``) and helpers (``_log``, ``_stats``, ``_show_error``)."""

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
        try:
            if self._editing_id is not None and self.chat_id is not None:
                await self._delete_from(self._editing_id)
                self._editing_id = None
            chat_id = self._ensure_saved_chat(text)
            msg = self.store.add_message(chat_id, "user", text)
        except StoreError as e:  # a full disk, a database another process keeps locked
            self._show_error(f"Not sent (your text is kept): {e}")
            return False
        # (no model given: the default one is what loaded, as _ensure_saved_chat records)
        self._saved(self.store.set_model, chat_id,
                    str(self.model) if self.model else DEFAULT_MODEL)
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
        try:
            answer = self.store.add_message(self.chat_id, "assistant", "")
        except StoreError as e:
            self._show_error(f"Generation not started: {e}")
            return
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
        except StoreError as e:  # the answer cannot be saved (per token): it stops, shown
            cancel.set()
            self._finish_failed(message_id, text)
            self._ui(self._on_generation_error, view, str(e), text)
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
        try:
            self.store.update_message(message_id, text, finish_reason=finish, stats=stats)
        except StoreError as e:
            self._ui(self._on_generation_error, view, str(e), text)
            return
        self._ui(self._on_generation_done, view, text, finish, stats)

    def _finish_failed(self, message_id: int, text: str) -> None:
        """Keep a partial answer (marked failed) or remove the empty answer row (as far as
        the database takes writes: when it refuses them, its error is the one shown)."""
        try:
            if text:
                self.store.update_message(message_id, text, finish_reason="error")
            else:
                self.store.delete_message(message_id)
        except StoreError:
            pass

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
        self._saved(self.store.touch, self.chat_id)
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
            prompt = self._chat_screen().query_one(PromptInput)
            draft = prompt.text  # what the user was typing (send_prompt clears the box)
            if await self.send_prompt(last_user.content) and draft and not prompt.text:
                prompt.load_text(draft)
                prompt.move_cursor(prompt.document.end)

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
