"""The engine: text in, streamed text out, on any backend.

:class:`Engine` ties the parts together for one loaded model (DESIGN.md, "Data flow of one
request")::

    prompt/messages -> ChatTemplate -> Tokenizer.encode -> runner.forward (prefill)
    decode loop { logits -> Sampler -> token -> StopChecker -> IncrementalDetokenizer -> event;
                  runner.forward([token]) }

The backend (a *Runner*, docs/INTERFACES.md) only turns token ids into logits and keeps its KV
state; sampling, stop strings, streaming detokenization, context limits, cancellation and
metrics live here, so every backend produces the same text for the same logits.

The engine opens a model from a :class:`~localmoe.io.model_file.ModelFile` or a filesystem path;
it knows nothing of the model store or of OpenAI's request shapes. The public
:class:`localmoe.LLM` (:mod:`localmoe.api`) adds those: store names and ``chat()``.

Context rules: a prompt longer than the context raises :class:`ContextOverflowError` (with both
numbers) before any compute; generation that reaches the end of the context (prompt + generated
tokens == ``n_ctx``) or ``max_tokens`` ends with finish reason ``"length"``. A generation cut
that way (or cancelled) in the middle of a multi-byte UTF-8 character ends its text at the last
whole character.

Prefix reuse: the runner keeps one sequence; when a new prompt shares a prefix with the tokens
already cached (a chat growing turn by turn), only the new suffix is prefilled.

Threading: one generation runs at a time per engine (an internal lock queues callers). A stream
takes the lock when iteration starts and releases it when the iterator finishes, is closed
(``close()`` / garbage collection, which also cancels) or raises.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from localmoe.engine.options import (check_act_env, check_backend_device, check_device,
                                     check_n_ctx, context_size, make_sampling_params,
                                     parse_kv_request)
from localmoe.engine.limits import check_text_fits, check_token_ids, check_vocab_fits, message_chars
from localmoe.engine.results import StreamEvent
from localmoe.errors import ContextOverflowError, InvalidRequestError, LocalMoEError


def _token_id(t) -> int:
    """``t`` as a token id: an integer (Python, numpy or a 0-d tensor); TypeError for text,
    bytes, bools and floats (``[1.7]`` is not silently token 1)."""
    if isinstance(t, (str, bytes, bool, float)):
        raise TypeError(type(t).__name__)
    return int(t)


def _warn_template(template: Any, name: str) -> None:
    """One warning line for a model whose chat template (or its ``tool_use`` variant) does not
    compile and was loaded without it (``ChatTemplate.from_model(strict=False)``); nothing for
    a good template or none."""
    from localmoe.text.chat_template import BrokenChatTemplate, warn

    if isinstance(template, BrokenChatTemplate):
        warn(f"{name}: {template.error}; loaded without it: plain completions work, chat "
             f"with this model fails")
    elif getattr(template, "tool_error", None):
        warn(f"{name}: the tool-use variant of its chat template is not used, requests with "
             f"tools get the default template: {template.tool_error}")


class Engine:
    """A loaded model ready to generate (docs/INTERFACES.md, "Engine / Python API").

    Args:
        model: a :class:`~localmoe.io.model_file.ModelFile`, or the path of a .gguf file (any
            shard) or HF folder.
        backend: ``"auto"`` or a backend name (``localmoe backends``).
        n_ctx: context size in tokens; default min(model's training context, 4096).
        kv_cache: KV cache format for K and V (``f16``, ``int8``, ``int4``, ``int3``, ``int2``,
            ``fp4``, ...); ``kv_cache_k`` / ``kv_cache_v`` override one side.
        device: backend device (``"cpu"``, ``"cuda"``, ``"cuda:1"``); None = backend default.
        progress: ``progress(fraction, message)`` called while loading.
        before_load: ``before_load(engine)`` called once the tokenizer, chat template and
            context size are known, before the weights load: ``.tokenizer``, ``.template``,
            ``.n_ctx``, ``.model_file``, ``.backend_name``, :meth:`prompt_ids`,
            :meth:`count_tokens` and :meth:`render_chat` work there (generation does not yet);
            an exception it raises stops the load (``localmoe generate`` refuses a prompt
            longer than the context this way).
        **backend_options: passed to the backend's ``load`` (``n_threads``, ...).

    A chat template that does not compile does not stop the load: it is logged once as a
    warning, plain completions work and everything that needs the template (``chat_stream``,
    ``generate(raw=False)``, :meth:`render_chat`) raises its TemplateError.

    Raises:
        ModelLoadError, UnsupportedModelError, BackendUnavailableError, KVCacheFormatError,
        InvalidRequestError (bad n_ctx or device, a ``$LOCALMOE_THREADS`` that is no thread
        count, a ``model`` that is neither a ModelFile nor a path).
    """

    def __init__(self, model: Any = None, backend: str = "auto", n_ctx: int | None = None,
                 kv_cache: Any = "f16", kv_cache_k: str | None = None,
                 kv_cache_v: str | None = None, device: str | None = None,
                 progress: Callable[[float, str], None] | None = None,
                 before_load: Callable[[Any], None] | None = None, **backend_options: Any):
        from localmoe.backends.registry import check_backend_options, env_threads, select_backend

        if progress is not None and not callable(progress):
            raise InvalidRequestError("progress must be a callable progress(fraction, message), "
                                      f"got {type(progress).__name__}", param="progress")
        prog = progress or (lambda f, m: None)
        check_n_ctx(n_ctx)
        check_backend_options(backend_options)  # an option no backend takes: before any I/O
        kv_spec = parse_kv_request(kv_cache, kv_cache_k, kv_cache_v)  # errors before any I/O
        device = check_device(device)
        if backend_options.get("n_threads") is None:
            env_threads()  # a bad $LOCALMOE_THREADS is an error before any I/O
        check_act_env()    # so is a bad $LOCALMOE_ACT_PRECISION
        prog(0.0, "resolving model")
        model_file = self._open(model)
        name = self._model_name(model, model_file)   # the user's name for it
        prog(0.1, f"opened {name}")
        kv_spec.check_head_dims(model_file.spec.head_dim, model_file.spec.v_head_dim)
        be, reason = select_backend("auto" if backend is None else backend, model_file.format, kv_spec)
        check_backend_options(backend_options, be)
        check_backend_device(be, device)
        ctx = context_size(n_ctx, model_file.spec.n_ctx_train)
        from localmoe.text.chat_template import ChatTemplate
        from localmoe.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model(model_file)
        check_vocab_fits(tokenizer, model_file)
        # a template that does not compile loads as a BrokenChatTemplate: plain completions
        # work, chat raises its TemplateError (as llama.cpp and Ollama load such a model)
        template = ChatTemplate.from_model(model_file, tokenizer, strict=False)
        if before_load is not None:  # what the text helpers need; _setup sets them again
            self.tokenizer, self.template, self.n_ctx = tokenizer, template, ctx
            self.model_file, self.backend_name = model_file, be.name
            before_load(self)
        # after before_load: a command that needs the template (`generate` without --raw)
        # stops there with the error itself, not this warning and then the error
        _warn_template(template, name)
        prog(0.2, f"loading weights ({be.name} backend)")
        if be.name == "triton" and progress is not None:
            backend_options.setdefault("load_progress", lambda done, total: prog(
                0.2 + 0.8 * done / total,
                f"loading weights {done / 2**30:.1f} / {total / 2**30:.1f} GiB (triton backend)"))
        runner = be.load(model_file, n_ctx=ctx, kv_spec=kv_spec, device=device, **backend_options)
        prog(1.0, "ready")
        self._setup(runner, tokenizer, template, model_file=model_file,
                    backend_reason=reason, model_name=name)

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def _open(model: Any):
        """The ModelFile of ``model`` (a ModelFile as is, or a path to open)."""
        if hasattr(model, "spec") and hasattr(model, "format"):
            return model  # already a ModelFile
        if not isinstance(model, (str, os.PathLike)):
            raise InvalidRequestError(
                f"model must be a ModelFile or the path of a model, not {type(model).__name__}",
                param="model")
        from localmoe.io.loader import open_model

        return open_model(model)

    @staticmethod
    def _model_name(model: Any, model_file: Any) -> str:
        """The name the model is reported by: a .gguf file's name without the suffix, else
        the file or folder name."""
        src = model if isinstance(model, (str, os.PathLike)) else (
            getattr(model_file, "path", None) or model_file.name)
        p = Path(str(src).strip())
        return p.stem if p.suffix.lower() == ".gguf" else p.name

    @classmethod
    def from_parts(cls, runner: Any, tokenizer: Any, template: Any = None, *, model_file: Any = None,
                   model_name: str | None = None, backend_reason: str = ""):
        """An engine over an already built runner and tokenizer (tests, custom backends)."""
        self = cls.__new__(cls)
        self._setup(runner, tokenizer, template, model_file=model_file, backend_reason=backend_reason,
                    model_name=model_name)
        return self

    def _setup(self, runner, tokenizer, template, *, model_file=None, backend_reason="",
               model_name=None) -> None:
        self.model_file = model_file
        self.tokenizer = tokenizer
        self.template = template
        self.runner = runner
        self.backend_name = getattr(runner, "backend_name", "?")
        self.backend_reason = backend_reason or self.backend_name
        self.n_ctx = int(runner.n_ctx)
        self.spec = getattr(runner, "spec", None) or getattr(model_file, "spec", None)
        self.model_name = model_name or getattr(model_file, "name", None) or "model"
        self.kv_spec = getattr(runner, "kv_spec", None)
        self._lock = threading.Lock()
        self._owner: int | None = None   # the thread whose generation holds the lock
        self._seq = runner.new_sequence()
        self._cached: list[int] = []  # token ids whose K/V the runner holds for self._seq
        self._closed = False
        self._close_pending = False
        self._runner_closed = False
        self._abort = threading.Event()  # set by close(): ends a running generation
        self._control: set[int] | None = None
        from localmoe.engine.sampling import SamplingParams

        try:
            self._model_sampling = SamplingParams.model_defaults(getattr(model_file, "metadata", None))
        except Exception:
            self._model_sampling = {}

    def default_sampling(self):
        """SamplingParams with the model file's recommended defaults (``general.sampling.*``)
        over the library defaults; explicit arguments to generate/chat override these."""
        import dataclasses

        from localmoe.engine.sampling import SamplingParams

        return dataclasses.replace(SamplingParams(), **self._model_sampling)

    # -- text helpers ---------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` (plain text, no BOS).

        Raises:
            InvalidRequestError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"count_tokens takes a string, got {type(text).__name__}",
                                      param="text")
        return len(self.tokenizer.encode(text, add_special=False))

    def prompt_ids(self, prompt: str | Sequence[int] | None = None, *,
                   messages: list[dict] | None = None, tools: list | None = None) -> list[int]:
        """Token ids the model would be given for ``prompt`` as a plain completion
        (``generate(prompt, raw=True)``), or for ``messages`` as a chat (``chat_stream``):
        BOS and the template's control tokens included.

        Raises:
            InvalidRequestError: an empty prompt. TemplateError: the template failed.
        """
        if messages is not None:
            return self._chat_ids(messages, tools)
        return self._encode_prompt(prompt if prompt is not None else "", templated=False)

    def render_chat(self, messages: list[dict], tools: list | None = None) -> str:
        """The prompt text the chat template makes of ``messages`` (OpenAI message dicts),
        ending with the assistant generation prompt.

        Raises:
            TemplateError: the template failed (its message included).
        """
        if self.template is not None:
            return self.template.render(messages, tools=tools, add_generation_prompt=True)
        # No template in the file (base models): a plain transcript the model can continue.
        lines = []
        for m in messages:
            content = m.get("content") or ""
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            lines.append(f"{str(m.get('role', 'user')).capitalize()}: {content}")
        return "\n".join(lines) + "\nAssistant:"

    def _encode_prompt(self, prompt: str | Sequence[int], templated: bool) -> list[int]:
        if not isinstance(prompt, str):
            if isinstance(prompt, (bytes, bytearray, memoryview)):
                raise InvalidRequestError(
                    "the prompt is bytes: decode it to a string first (token ids go as a list "
                    "of ints)", param="prompt")
            try:
                ids = [_token_id(t) for t in prompt]
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    f"the prompt must be a string or a sequence of token ids, not "
                    f"{type(prompt).__name__}", param="prompt") from None
            if not ids:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            check_token_ids(ids, int(self.runner.spec.vocab_size) if self.runner is not None
                            else int(self.tokenizer.vocab_size))
            return ids
        tok = self.tokenizer
        check_text_fits(len(prompt), self.n_ctx, tok)
        if templated:
            # The template writes the control tokens (and maybe BOS) itself: parse them; add a
            # BOS only when the template does not render one.
            renders_bos = bool(getattr(self.template, "renders_bos", False))
            ids = tok.encode(prompt, add_special=not renders_bos, parse_special=True)
        else:
            ids = tok.encode(prompt, add_special=True, parse_special=False)
        bos = getattr(tok, "bos_id", None)
        while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # never a double BOS
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], *, stream: bool = False, raw: bool = True,
                 cancel: threading.Event | None = None, params: Any = None,
                 fit_max_tokens: bool = False, **sampling: Any):
        """Generate a continuation of ``prompt``.

        Args:
            prompt: text, or token ids used as is.
            stream: return an iterator of :class:`StreamEvent` instead of the result.
            raw: True = plain-text completion; False = wrap the prompt as one user message in
                the model's chat template (when it has one).
            cancel: a ``threading.Event``; setting it ends generation with finish reason
                ``"cancelled"`` after the current token.
            params: a SamplingParams (keyword arguments override its fields).
            fit_max_tokens: True refuses a ``max_tokens`` that does not fit in the context
                beside the prompt (ContextOverflowError, as OpenAI's API and vLLM's server
                answer); False (default) generates until ``max_tokens`` or the context is
                full, as llama.cpp does.
            **sampling: SamplingParams fields (temperature, top_k, top_p, min_p, seed,
                max_tokens, stop, repeat_penalty, ...; ``json_schema=`` a JSON Schema dict or
                text / ``json_object=True`` constrain the output, ``logprobs=N`` (0..20) and
                ``prompt_logprobs=True`` fill ``result.logprobs`` / ``prompt_logprobs``).

        Returns:
            GenerationResult, or Iterator[StreamEvent] when ``stream``.

        Raises:
            ContextOverflowError: the prompt has more tokens than the context, or with
                ``fit_max_tokens`` the prompt and ``max_tokens`` have (raised at call time,
                also for streams).
            InvalidRequestError: bad sampling parameter or empty prompt.
        """
        t0 = time.perf_counter()
        if not isinstance(stream, bool):
            raise InvalidRequestError(f"stream must be True or False, got {stream!r}",
                                      param="stream")
        p = make_sampling_params(params if params is not None else self.default_sampling(), **sampling)
        if not raw and isinstance(prompt, str) and self.template is not None:
            ids = self._chat_ids([{"role": "user", "content": prompt}])
        else:
            ids = self._encode_prompt(prompt, templated=False)
        return self._start(ids, p, cancel, stream, t0, fit_max_tokens)

    def chat_stream(self, messages: list[dict], params: Any = None, tools: list | None = None,
                    cancel: threading.Event | None = None, *,
                    fit_max_tokens: bool = False) -> Iterator[StreamEvent]:
        """Stream the assistant's reply to ``messages`` (OpenAI-style message dicts).

        Used by the TUI and the server. Raises TemplateError, ContextOverflowError and
        InvalidRequestError at call time (before the first event); ``fit_max_tokens`` as in
        :meth:`generate`.
        """
        t0 = time.perf_counter()
        p = make_sampling_params(params if params is not None else self.default_sampling())
        if self.template is None:
            import dataclasses

            # the transcript of render_chat: a new turn of any role ends the reply (a base
            # model goes on with "\nUser: ..." or a second "\nAssistant: ..." turn)
            p = dataclasses.replace(p, stop=tuple(p.stop or ()) + (
                "\nUser:", "\nSystem:", "\nAssistant:", "\nTool:"))
        ids = self._chat_ids(messages, tools, cancel)
        return self._start(ids, p, cancel, True, t0, fit_max_tokens)

    def _chat_ids(self, messages: list[dict], tools: list | None = None, cancel: Any = None) -> list[int]:
        """Token ids of a chat prompt: control tokens only from the template (the same text
        inside a message stays plain text), one BOS at most."""
        if tools is not None and (not isinstance(tools, (list, tuple))
                                  or not all(isinstance(t, dict) for t in tools)):
            raise InvalidRequestError("tools must be a list of tool objects (dicts), got "
                                      f"{type(tools).__name__}", param="tools")
        check_text_fits(message_chars(messages), self.n_ctx, self.tokenizer, "conversation")
        if self.template is not None and hasattr(self.template, "encode"):
            ids = list(self.template.encode(self.tokenizer, messages, tools=tools,
                                            add_generation_prompt=True, cancel=cancel))
            bos = getattr(self.tokenizer, "bos_id", None)
            while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
                ids = ids[1:]
            if not ids:
                raise InvalidRequestError("the prompt is empty", param="messages")
            return ids
        text = self.render_chat(messages, tools=tools)
        return self._encode_prompt(text, templated=self.template is not None)

    def _start(self, ids: list[int], p, cancel, stream: bool, t0: float,
               fit_max_tokens: bool = False):
        if cancel is not None and not callable(getattr(cancel, "is_set", None)):
            raise InvalidRequestError(
                f"cancel must be a threading.Event (or None), got {type(cancel).__name__}",
                param="cancel")
        n_max_out = self.n_ctx - len(ids)
        if n_max_out < 0:
            raise ContextOverflowError(len(ids), self.n_ctx)
        if n_max_out == 0:   # nothing could be generated (the CLI, vLLM and llama.cpp refuse it)
            raise ContextOverflowError.fills_context(len(ids), self.n_ctx)
        if fit_max_tokens and p.max_tokens is not None and p.max_tokens > n_max_out:
            raise ContextOverflowError.with_max_tokens(len(ids), p.max_tokens, self.n_ctx)
        if self._closed:
            raise LocalMoEError("this model was closed; create a new LLM")
        if hasattr(p, "with_grammar"):  # a bad json_schema fails here, also for streams
            p = p.with_grammar(self.tokenizer)
        gen = self._run(ids, p, cancel, t0)
        if stream:
            return gen
        result = None
        try:
            for ev in gen:
                if ev.done:
                    result = ev.result
        finally:
            gen.close()
        return result

    def _run(self, ids: list[int], p, cancel, t0: float) -> Iterator[StreamEvent]:
        from localmoe.engine.generation import Generation

        me = threading.get_ident()
        if self._owner == me:
            # the lock is held by a stream this thread left suspended: waiting would never end
            raise LocalMoEError(
                "a stream from this model is still open in this thread; iterate it to the end "
                "or call its close() before starting another generation")
        with self._lock:
            if self._runner_closed:
                raise LocalMoEError("this model was closed; create a new LLM")
            gen = Generation(self, ids, p, cancel, t0)   # may refuse the request: not owned yet
            self._owner = me
            completed = False
            try:
                yield from gen.events()
                result = gen.result()
                completed = True
            except GeneratorExit:
                raise  # closed between tokens: the cached state is consistent
            except BaseException:
                if not completed:
                    # the runner may hold a partial step; start from scratch next time
                    self._reset_cache()
                raise
            finally:
                self._owner = None
                if self._close_pending:
                    self._release_runner()
        # the final event is yielded after the lock is released, so a consumer that stops
        # iterating once it has the result does not block the next generation
        yield StreamEvent("", None, True, result)

    def _control_ids(self) -> set[int]:
        """Control-token ids (exempt from repetition penalties), computed once."""
        if self._control is None:
            fn = getattr(self.tokenizer, "is_control", None)
            ids: set[int] = set()
            direct = getattr(self.tokenizer, "control_ids", None)
            if isinstance(direct, (set, frozenset)):
                ids = set(direct)
            elif fn is not None:
                try:
                    ids = {i for i in range(int(self.tokenizer.vocab_size)) if fn(i)}
                except Exception:
                    ids = set()
            self._control = ids
        return self._control

    def _reset_cache(self) -> None:
        try:
            self.runner.truncate(self._seq, 0)
        except Exception:
            pass
        self._cached = []

    def reset(self) -> None:
        """Forget the cached prompt (the next request prefills from scratch)."""
        with self._lock:
            self._reset_cache()

    def stats(self) -> dict[str, Any]:
        """Backend statistics (device, KV bytes, ...; see Runner.stats)."""
        return dict(self.runner.stats())

    def close(self, timeout: float = 10.0) -> None:
        """Release the model (runner memory). It cannot be used afterwards.

        A generation in progress is cancelled. If a stream holds the model (suspended between
        tokens) for longer than ``timeout`` seconds, the runner is released when that stream
        resumes or is closed instead; ``close`` itself never blocks longer than ``timeout``.
        """
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise InvalidRequestError(f"close(timeout=) takes seconds, got {timeout!r}",
                                      param="timeout")
        self._closed = True
        self._close_pending = True
        self._abort.set()
        if self._owner == threading.get_ident():
            timeout = 0.0   # this thread's own suspended stream holds the lock: it releases
        if self._lock.acquire(timeout=max(0.0, timeout)):
            try:
                self._release_runner()
            finally:
                self._lock.release()

    def _release_runner(self) -> None:
        # called with the lock held
        if self._close_pending and not self._runner_closed:
            self._runner_closed = True
            try:
                self.runner.free_sequence(self._seq)
            except Exception:
                pass
            self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.model_name!r}, backend={self.backend_name!r}, "
                f"n_ctx={self.n_ctx})")
