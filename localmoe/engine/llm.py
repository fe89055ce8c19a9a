"""The engine: text in, streamed text out, on any backend.

``LLM`` ties the parts together for one loaded model (DESIGN.md, "Data flow of one request")::

    prompt/messages -> ChatTemplate -> Tokenizer.encode -> runner.forward (prefill)
    decode loop { logits -> Sampler -> token -> StopChecker -> IncrementalDetokenizer -> event;
                  runner.forward([token]) }

The backend (a *Runner*, docs/INTERFACES.md) only turns token ids into logits and keeps its KV
state; sampling, stop strings, streaming detokenization, context limits, cancellation and
metrics live here, so every backend produces the same text for the same logits.

Context rules: a prompt longer than the context raises :class:`ContextOverflowError` (with both
numbers) before any compute; generation that reaches the end of the context (prompt + generated
tokens == ``n_ctx``) or ``max_tokens`` ends with finish reason ``"length"``. A generation cut
that way (or cancelled) in the middle of a multi-byte UTF-8 character ends its text at the last
whole character.

Prefix reuse: the runner keeps one sequence; when a new prompt shares a prefix with the tokens
already cached (a chat growing turn by turn), only the new suffix is prefilled.

Threading: one generation runs at a time per ``LLM`` (an internal lock queues callers). A stream
takes the lock when iteration starts and releases it when the iterator finishes, is closed
(``close()`` / garbage collection, which also cancels) or raises.
"""

from __future__ import annotations

import os

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from localmoe.errors import ContextOverflowError, InvalidRequestError, LocalMoEError, ModelLoadError

DEFAULT_N_CTX = 4096


@dataclass
class Timings:
    """Timing of one generation.

    Attributes:
        ttft_ms: time to first token (ms), from the start of the request to the first sampled
            token (tokenization, queueing behind another generation, prefill and one sampling).
        tpot_ms: mean time per output token after the first (ms); 0 with fewer than 2 tokens.
        prefill_tok_s: prompt tokens processed per second during prefill (tokens reused from
            the cache are not counted).
        decode_tok_s: generated tokens per second after the first (1000 / tpot_ms).
        total_ms: wall time of the whole request (ms).
    """

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    total_ms: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items()}


@dataclass
class GenerationResult:
    """Outcome of one generation.

    Attributes:
        text: generated text (stop strings and end-of-generation tokens excluded).
        token_ids: generated token ids (an end-of-generation token that ended it included).
        prompt_tokens: number of prompt tokens.
        completion_tokens: ``len(token_ids)``.
        finish_reason: ``"stop"`` (end-of-generation token or stop string), ``"length"``
            (max_tokens or context full) or ``"cancelled"``.
        timings: :class:`Timings`.
        cached_tokens: prompt tokens reused from the previous request's KV cache.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    timings: Timings = field(default_factory=Timings)
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "timings": self.timings.to_dict()}


@dataclass
class StreamEvent:
    """One streamed piece.

    Text events carry ``delta`` (non-empty, valid UTF-8, never part of a stop string) and the
    ``token_id`` that completed it (a delta may cover several tokens when bytes or a possible
    stop-string prefix were held back). The last event has ``done=True``, ``delta=""`` and the
    :class:`GenerationResult`. Concatenating all deltas gives ``result.text``.
    """

    delta: str
    token_id: int | None = None
    done: bool = False
    result: GenerationResult | None = None


_GROUPING_NAMES = {"c": "channel", "channel": "channel", "t": "token", "token": "token"}


def named_key_grouping(kv: Any = "f16", k: str | None = None) -> str | None:
    """The key grouping the user *named* in a KV request (``"channel"`` for ``"int4:c"`` or
    ``kgroup=channel``, ``"token"`` for ``":t"`` / ``kgroup=token``), or None when the request
    leaves it to the default. Arguments as :meth:`KVSpec.parse` (``kv``, ``k``); a ``KVSpec``
    object gives None (its grouping can no longer be told apart from the default). Call it
    on a request :meth:`KVSpec.parse` accepted."""
    from localmoe.kv.cache import KVFormat

    if not isinstance(kv, str):
        return None
    k_src, base, kgroup = k, kv, None
    if "," in kv or "=" in kv:  # KVSpec's str() syntax: "int4,kgroup=channel", "k=int4:c,v=int2"
        base = None
        for part in (p.strip() for p in kv.split(",") if p.strip()):
            key, eq, val = part.partition("=")
            key = key.strip().lower()
            if not eq:
                base = key
            elif key == "k":
                k_src = k_src or val.strip()
            elif key in ("kgroup", "key_grouping"):
                kgroup = kgroup or val.strip().lower()
    if kgroup:
        return _GROUPING_NAMES.get(kgroup)
    src = k_src or base
    if not src:
        return None
    try:
        return KVFormat.parse(src).grouping or None
    except LocalMoEError:
        return None


def parse_kv_request(kv: Any = "f16", k: str | None = None, v: str | None = None):
    """:meth:`KVSpec.parse` of a user's KV request that also notes, as the spec's
    ``named_key_grouping`` attribute, the key grouping the user named (see
    :func:`named_key_grouping`; None = the format's default). Backends that can hold only one
    grouping (llamacpp: per token) refuse a grouping that was asked for and map the default.

    Raises:
        KVCacheFormatError: as :meth:`KVSpec.parse`.
    """
    from localmoe.kv.cache import KVSpec

    spec = KVSpec.parse(kv, k, v)
    if not isinstance(kv, KVSpec):
        # KVSpec is a frozen dataclass: the note is an attribute, not a field (no effect on
        # equality, hashing or str())
        object.__setattr__(spec, "named_key_grouping", named_key_grouping(kv, k))
    return spec


def check_device(device: Any) -> str | None:
    """Refuse a device string no backend understands, before anything loads; returns it
    normalized (``" CUDA:1"`` -> ``"cuda:1"``; None stays None).

    Accepted: None (the backend's default), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (N a GPU
    index). Whether that device is present is the backend's check
    (:func:`check_backend_device`).

    Raises:
        InvalidRequestError: anything else (``param="device"``).
    """
    if device is None:
        return None
    d = str(device).strip().lower()
    if d in ("cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit()):
        return d
    raise InvalidRequestError(f"unknown device {device!r}; use cpu, cuda or cuda:N (N = GPU index)",
                              param="device")


def check_backend_device(backend: Any, device: Any) -> None:
    """Refuse a ``device`` (accepted by :func:`check_device`) that does not exist here for
    ``backend`` (a registry Backend: its ``check_device``), before any weights load:
    ``cuda`` without a visible CUDA device, ``cuda:N`` beyond the devices there are.

    Raises:
        InvalidRequestError: the backend's reason (``param="device"``).
    """
    check = getattr(backend, "check_device", None)
    why = check(device) if device is not None and check is not None else None
    if why:
        raise InvalidRequestError(why, param="device")


def _sampling_params(params: Any = None, **sampling: Any):
    """Build and validate SamplingParams from an object and/or keyword overrides.

    Raises:
        InvalidRequestError: unknown parameter name or out-of-range value.
    """
    import dataclasses

    from localmoe.engine.sampling import SamplingParams

    if params is None:
        params = SamplingParams()
    if sampling:
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(sampling) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}",
                param=unknown[0])
        sampling = {k: v for k, v in sampling.items() if v is not None or k in ("seed", "max_tokens")}
        if "stop" in sampling and isinstance(sampling["stop"], str):
            sampling["stop"] = (sampling["stop"],)
        params = dataclasses.replace(params, **sampling)
    params.validate()
    return params


class LLM:
    """A loaded model ready to generate (docs/INTERFACES.md, "Engine / Python API").

    Args:
        model: path to a .gguf file (any shard) or HF folder, a store name (``"smollm2"``), an
            ``hf:OWNER/REPO/FILE`` reference, or None for the default model (pulled on first use).
        backend: ``"auto"`` or a backend name (``localmoe backends``).
        n_ctx: context size in tokens; default min(model's training context, 4096).
        kv_cache: KV cache format for K and V (``f16``, ``int8``, ``int4``, ``int3``, ``int2``,
            ``fp4``, ...); ``kv_cache_k`` / ``kv_cache_v`` override one side.
        device: backend device (``"cpu"``, ``"cuda"``, ``"cuda:1"``); None = backend default.
        progress: ``progress(fraction, message)`` called while loading.
        before_load: ``before_load(llm)`` called once the tokenizer, chat template and context
            size are known, before the weights load: ``llm.tokenizer``, ``llm.template``,
            ``llm.n_ctx``, :meth:`prompt_ids`, :meth:`count_tokens` and :meth:`render_chat`
            work there (generation does not yet); an exception it raises stops the load
            (``localmoe generate`` refuses a prompt longer than the context this way).

    Raises:
        ModelNotFoundError, ModelLoadError, UnsupportedModelError, BackendUnavailableError,
        KVCacheFormatError, InvalidRequestError (bad n_ctx or device, a ``$LOCALMOE_THREADS``
        that is no thread count), StoreError (pull failed).
    """

    def __init__(self, model: Any = None, backend: str = "auto", n_ctx: int | None = None,
                 kv_cache: Any = "f16", kv_cache_k: str | None = None,
                 kv_cache_v: str | None = None, device: str | None = None,
                 progress: Callable[[float, str], None] | None = None,
                 before_load: Callable[["LLM"], None] | None = None, **backend_options: Any):
        from localmoe.engine.registry import env_threads, select_backend

        prog = progress or (lambda f, m: None)
        if n_ctx is not None and (not isinstance(n_ctx, int) or n_ctx < 1):
            raise InvalidRequestError(f"context size must be a positive integer, got {n_ctx!r}",
                                      param="n_ctx")
        kv_spec = parse_kv_request(kv_cache, kv_cache_k, kv_cache_v)  # errors before any I/O
        device = check_device(device)
        if backend_options.get("n_threads") is None:
            env_threads()  # a bad $LOCALMOE_THREADS is an error before any I/O
        prog(0.0, "resolving model")
        model_file = self._open(model)
        prog(0.1, f"opened {model_file.name}")
        be, reason = select_backend(backend or "auto", model_file.format, kv_spec)
        check_backend_device(be, device)
        n_train = int(model_file.spec.n_ctx_train or 0)
        if n_ctx and n_train and n_ctx > n_train:
            raise InvalidRequestError(
                f"context size {n_ctx} is larger than the model's training context of {n_train} "
                f"tokens; use a context size of at most {n_train}", param="n_ctx")
        ctx = int(n_ctx) if n_ctx else min(int(model_file.spec.n_ctx_train or DEFAULT_N_CTX),
                                           DEFAULT_N_CTX)
        from localmoe.text.chat_template import ChatTemplate
        from localmoe.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model(model_file)
        template = ChatTemplate.from_model(model_file, tokenizer)
        if before_load is not None:  # what the text helpers need; _setup sets them again
            self.tokenizer, self.template, self.n_ctx = tokenizer, template, ctx
            before_load(self)
        prog(0.2, f"loading weights ({be.name} backend)")
        runner = be.load(model_file, n_ctx=ctx, kv_spec=kv_spec, device=device, **backend_options)
        prog(1.0, "ready")
        from localmoe.io.store import display_name

        name = display_name(model) if model is None or isinstance(model, (str, os.PathLike)) \
            else display_name(getattr(model_file, "path", None) or model_file.name)
        self._setup(runner, tokenizer, template, model_file=model_file,
                    backend_reason=reason, model_name=name)

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def _open(model: Any):
        if hasattr(model, "spec") and hasattr(model, "format"):
            return model  # already a ModelFile
        from localmoe.io.loader import open_model
        from localmoe.io.store import resolve_model

        return open_model(resolve_model(model))

    @classmethod
    def from_parts(cls, runner: Any, tokenizer: Any, template: Any = None, *, model_file: Any = None,
                   model_name: str | None = None, backend_reason: str = "") -> "LLM":
        """An LLM over an already built runner and tokenizer (tests, custom backends)."""
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
        """Number of tokens of ``text`` (plain text, no BOS)."""
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
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    f"the prompt must be a string or a sequence of token ids, not "
                    f"{type(prompt).__name__}", param="prompt") from None
            if not ids:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            return ids
        tok = self.tokenizer
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
                 cancel: threading.Event | None = None, params: Any = None, **sampling: Any):
        """Generate a continuation of ``prompt``.

        Args:
            prompt: text, or token ids used as is.
            stream: return an iterator of :class:`StreamEvent` instead of the result.
            raw: True = plain-text completion; False = wrap the prompt as one user message in
                the model's chat template (when it has one).
            cancel: a ``threading.Event``; setting it ends generation with finish reason
                ``"cancelled"`` after the current token.
            params: a SamplingParams (keyword arguments override its fields).
            **sampling: SamplingParams fields (temperature, top_k, top_p, min_p, seed,
                max_tokens, stop, repeat_penalty, ...).

        Returns:
            GenerationResult, or Iterator[StreamEvent] when ``stream``.

        Raises:
            ContextOverflowError: the prompt has more tokens than the context (raised at call
                time, also for streams).
            InvalidRequestError: bad sampling parameter or empty prompt.
        """
        t0 = time.perf_counter()
        p = _sampling_params(params if params is not None else self.default_sampling(), **sampling)
        if not raw and isinstance(prompt, str) and self.template is not None:
            ids = self._chat_ids([{"role": "user", "content": prompt}])
        else:
            ids = self._encode_prompt(prompt, templated=False)
        return self._start(ids, p, cancel, stream, t0)

    def chat_stream(self, messages: list[dict], params: Any = None, tools: list | None = None,
                    cancel: threading.Event | None = None) -> Iterator[StreamEvent]:
        """Stream the assistant's reply to ``messages`` (OpenAI-style message dicts).

        Used by the TUI and the server. Raises TemplateError, ContextOverflowError and
        InvalidRequestError at call time (before the first event).
        """
        t0 = time.perf_counter()
        p = _sampling_params(params if params is not None else self.default_sampling())
        if self.template is None:
            import dataclasses

            # the transcript of render_chat: a new turn of any role ends the reply
            p = dataclasses.replace(p, stop=tuple(p.stop or ()) + ("\nUser:", "\nSystem:"))
        ids = self._chat_ids(messages, tools)
        return self._start(ids, p, cancel, True, t0)

    def _chat_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """Token ids of a chat prompt: control tokens only from the template (the same text
        inside a message stays plain text), one BOS at most."""
        if self.template is not None and hasattr(self.template, "encode"):
            ids = list(self.template.encode(self.tokenizer, messages, tools=tools,
                                            add_generation_prompt=True))
            bos = getattr(self.tokenizer, "bos_id", None)
            while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
                ids = ids[1:]
            if not ids:
                raise InvalidRequestError("the prompt is empty", param="messages")
            return ids
        text = self.render_chat(messages, tools=tools)
        return self._encode_prompt(text, templated=self.template is not None)

    def chat(self, messages: list[dict], *, tools: list | None = None, tool_choice: Any = None,
             stream: bool = False, cancel: threading.Event | None = None, **sampling: Any):
        """OpenAI-style chat completion: a ChatCompletion dict, or an iterator of
        ChatCompletionChunk dicts when ``stream`` (shaping and tool-call parsing by
        :mod:`localmoe.serve.openai_api`)."""
        import localmoe.serve.openai_api as openai_api

        request: dict[str, Any] = {"model": self.model_name, "messages": messages,
                                   "stream": bool(stream)}
        if tools is not None:
            request["tools"] = tools
        if tool_choice is not None:
            request["tool_choice"] = tool_choice
        request.update({k: v for k, v in sampling.items() if v is not None})
        import inspect

        fn = openai_api.chat_completion
        try:
            takes_cancel = "cancel" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            takes_cancel = False
        if takes_cancel:
            return fn(self, request, cancel=cancel)
        return fn(self, request)

    def _start(self, ids: list[int], p, cancel, stream: bool, t0: float):
        n_max_out = self.n_ctx - len(ids)
        if n_max_out < 0:
            raise ContextOverflowError(len(ids), self.n_ctx)
        if self._closed:
            raise LocalMoEError("this model was closed; create a new LLM")
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
        from localmoe.engine.sampling import Sampler
        from localmoe.text.stopping import StopChecker
        from localmoe.text.tokenizer import IncrementalDetokenizer

        with self._lock:
            if self._runner_closed:
                raise LocalMoEError("this model was closed; create a new LLM")
            runner, tok, seq = self.runner, self.tokenizer, self._seq
            n_prompt = len(ids)
            budget = self.n_ctx - n_prompt
            if p.max_tokens is not None:
                budget = min(budget, int(p.max_tokens))
            eog = set(getattr(tok, "eog_ids", ()) or ())
            exempt = eog | self._control_ids()
            sampler = Sampler(p, tok.vocab_size, exempt_ids=exempt)
            stopper = StopChecker(tuple(p.stop or ()), eog)
            detok = IncrementalDetokenizer(tok)
            generated: list[int] = []
            parts: list[str] = []
            finish = "length"
            string_stop = False
            t_p0 = t0
            t_first = t_prefill_end = None
            n_reused = 0
            n_prefilled = 0
            completed = False
            try:
                if budget > 0:
                    # prefix reuse: keep the cached tokens the new prompt starts with
                    n_reused = _common_prefix(self._cached, ids)
                    n_reused = min(n_reused, n_prompt - 1)
                    if n_reused < len(self._cached):
                        runner.truncate(seq, n_reused)
                        self._cached = self._cached[:n_reused]
                        if runner.seq_len(seq) != n_reused:  # the backend could not cut there
                            runner.truncate(seq, 0)
                            self._cached, n_reused = [], 0
                    new = ids[n_reused:]
                    t_p0 = time.perf_counter()
                    logits = runner.forward([(seq, new)])[0]
                    if not bool(logits.isfinite().all()):  # torch tensors from every runner
                        # a greedy argmax over NaN picks token 0 (often end-of-text): an empty
                        # reply with finish "stop" would hide the damaged file
                        raise ModelLoadError(
                            f"the model computed non-finite logits (NaN/inf) for the prompt: "
                            f"its weights are probably corrupt or damaged; download "
                            f"{self.model_name or 'the model'} again")
                    self._cached = list(ids)
                    n_prefilled = len(new)
                    t_prefill_end = time.perf_counter()
                    history = list(ids)
                    while True:
                        if (cancel is not None and cancel.is_set()) or self._abort.is_set():
                            finish = "cancelled"
                            break
                        t_id = int(sampler.sample(logits, history))
                        if t_first is None:
                            t_first = time.perf_counter()
                        generated.append(t_id)
                        history.append(t_id)
                        if stopper.push_token(t_id):
                            finish = "stop"
                            break
                        delta = detok.push(t_id)
                        emit, stopped = stopper.push_text(delta) if delta else ("", False)
                        if emit:
                            parts.append(emit)
                            yield StreamEvent(emit, t_id)
                        if stopped:
                            finish, string_stop = "stop", True
                            break
                        if len(generated) >= budget:
                            finish = "length"
                            break
                        if (cancel is not None and cancel.is_set()) or self._abort.is_set():
                            finish = "cancelled"
                            break
                        logits = runner.forward([(seq, [t_id])])[0]
                        self._cached.append(t_id)
                    if not string_stop:
                        # bytes of a character still incomplete when the generation was cut
                        # (max_tokens, context end, cancel) are dropped: the text ends at the
                        # last whole character. After an end-of-generation token they are
                        # released (as U+FFFD, like Tokenizer.decode): the model ended there.
                        tail = detok.flush() if finish == "stop" else ""
                        if stopper.stopped:  # ended by an end-of-generation token
                            rest = stopper.flush() + tail
                            cuts = [rest.find(s) for s in (p.stop or ()) if s and s in rest]
                            emit = rest[:min(cuts)] if cuts else rest
                        else:
                            emit, stopped = stopper.push_text(tail) if tail else ("", False)
                            if stopped:
                                finish = "stop"
                            else:
                                emit += stopper.flush()
                        if emit:
                            parts.append(emit)
                            yield StreamEvent(emit, generated[-1] if generated else None)
                t_end = time.perf_counter()
                result = GenerationResult(
                    text="".join(parts), token_ids=generated, prompt_tokens=n_prompt,
                    completion_tokens=len(generated), finish_reason=finish,
                    timings=_timings(t0, t_p0, t_prefill_end, t_first,
                                     t_end, n_prefilled, len(generated)),
                    cached_tokens=n_reused)
                completed = True
            except GeneratorExit:
                raise  # closed between tokens: the cached state is consistent
            except BaseException:
                if not completed:
                    # the runner may hold a partial step; start from scratch next time
                    self._reset_cache()
                raise
            finally:
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
        """Release the model (runner memory). The LLM cannot be used afterwards.

        A generation in progress is cancelled. If a stream holds the model (suspended between
        tokens) for longer than ``timeout`` seconds, the runner is released when that stream
        resumes or is closed instead; ``close`` itself never blocks longer than ``timeout``.
        """
        self._closed = True
        self._close_pending = True
        self._abort.set()
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

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LLM({self.model_name!r}, backend={self.backend_name!r}, n_ctx={self.n_ctx})"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _timings(t0, t_p0, t_prefill_end, t_first, t_end, n_prefilled, n_gen) -> Timings:
    ms = 1000.0
    tm = Timings(total_ms=(t_end - t0) * ms)
    if t_first is not None:
        tm.ttft_ms = (t_first - t0) * ms
        if n_gen > 1 and t_end > t_first:
            tm.tpot_ms = (t_end - t_first) * ms / (n_gen - 1)
            tm.decode_tok_s = (n_gen - 1) / (t_end - t_first)
    if t_prefill_end is not None and t_prefill_end > t_p0 and n_prefilled:
        tm.prefill_tok_s = n_prefilled / (t_prefill_end - t_p0)
    return tm
