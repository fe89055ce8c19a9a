"""OpenAI-compatible HTTP server (``localmoe serve``) on FastAPI + uvicorn.

Endpoints:

* ``POST /v1/chat/completions`` -- non-stream and SSE stream, tools, tool_choice, stop, seed,
  sampling parameters, ``stream_options.include_usage`` (see :mod:`localmoe.serve.openai`).
* ``POST /v1/completions`` -- raw-prompt completions.
* ``GET /v1/models`` and ``GET /v1/models/{id}``.
* ``GET /health`` -- ``200 {"status": "ok"}`` when ready, ``503 {"status": "loading"}`` while
  the model loads in the background, ``503 {"status": "error", "error": ...}`` when it failed.
* ``GET /metrics`` -- Prometheus text: requests by endpoint and status, prompt/generated
  tokens, TTFT and TPOT histograms (seconds), queue depth, running requests.

Behaviour:

* Generation runs in worker threads, one at a time (the engine serializes per model); requests
  arriving together wait in a FIFO queue of at most ``max_queue`` (then ``429``). A request
  that fails never affects the others.
* A client that disconnects (stream or not) cancels its generation at the next token.
* Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: ``400`` for
  invalid JSON, invalid parameters (``param`` names the field) and a prompt over the context
  (``code: "context_length_exceeded"``, both token counts in the message); ``401`` for a
  missing/wrong API key; ``404`` for an unknown model or route; ``413`` for a body over
  ``max_body_bytes``; ``503`` while loading (only for requests that pass validation: a bad
  one gets its 400/404 while the model loads too). Only bugs give ``500`` (no traceback is
  sent).
* With ``api_key`` set, ``/v1/*`` needs ``Authorization: Bearer <key>``; ``/health`` and
  ``/metrics`` stay open for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import ipaddress
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from localmoe.io.store import display_name
from localmoe.errors import (ContextOverflowError, InvalidRequestError, LocalMoEError,
                     ModelNotFoundError, TemplateError)

log = logging.getLogger("localmoe.serve.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_QUEUE = 64
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# --------------------------------------------------------------------------------- metrics

class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.n += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def render(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    """Server counters, rendered as Prometheus text exposition (version 0.0.4).

    Times are seconds; counts are tokens or requests. Thread-safe.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cancelled = 0
        self.ttft = _Histogram(_TTFT_BUCKETS)
        self.tpot = _Histogram(_TPOT_BUCKETS)
        self.queue_depth = 0
        self.running = 0

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, int(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def observe_generation(self, result, ttft_s: float | None, tpot_s: float | None) -> None:
        with self._lock:
            if result is not None:
                self.prompt_tokens += int(result.prompt_tokens)
                self.generation_tokens += int(result.completion_tokens)
                if result.finish_reason == "cancelled":
                    self.cancelled += 1
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            if tpot_s is not None:
                self.tpot.observe(tpot_s)

    def render(self, ready: bool) -> str:
        with self._lock:
            lines = ["# HELP localmoe_requests_total HTTP requests by endpoint and status code.",
                     "# TYPE localmoe_requests_total counter"]
            for (ep, st), n in sorted(self.requests.items()):
                lines.append(f'localmoe_requests_total{{endpoint="{ep}",status="{st}"}} {n}')
            lines += [
                "# HELP localmoe_prompt_tokens_total Prompt tokens processed.",
                "# TYPE localmoe_prompt_tokens_total counter",
                f"localmoe_prompt_tokens_total {self.prompt_tokens}",
                "# HELP localmoe_generation_tokens_total Tokens generated.",
                "# TYPE localmoe_generation_tokens_total counter",
                f"localmoe_generation_tokens_total {self.generation_tokens}",
                "# HELP localmoe_cancelled_generations_total Generations cancelled by a client disconnect.",
                "# TYPE localmoe_cancelled_generations_total counter",
                f"localmoe_cancelled_generations_total {self.cancelled}",
                "# HELP localmoe_time_to_first_token_seconds Request arrival to first token, queueing included.",
                "# TYPE localmoe_time_to_first_token_seconds histogram",
                *self.ttft.render("localmoe_time_to_first_token_seconds"),
                "# HELP localmoe_time_per_output_token_seconds Mean time per generated token after the first.",
                "# TYPE localmoe_time_per_output_token_seconds histogram",
                *self.tpot.render("localmoe_time_per_output_token_seconds"),
                "# HELP localmoe_queue_depth Requests waiting for the model.",
                "# TYPE localmoe_queue_depth gauge",
                f"localmoe_queue_depth {self.queue_depth}",
                "# HELP localmoe_requests_running Requests generating now.",
                "# TYPE localmoe_requests_running gauge",
                f"localmoe_requests_running {self.running}",
                "# HELP localmoe_model_ready 1 when the model is loaded.",
                "# TYPE localmoe_model_ready gauge",
                f"localmoe_model_ready {1 if ready else 0}",
            ]
            return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- errors

class HTTPError(Exception):
    """An error answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _error_from_exception(e: BaseException) -> HTTPError:
    """Map an exception raised while handling a request to an HTTP error."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, ContextOverflowError):
        return HTTPError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, InvalidRequestError):
        return HTTPError(400, str(e), param=e.param, code="invalid_value" if e.param else None)
    if isinstance(e, TemplateError):
        return HTTPError(400, f"the chat template could not render these messages: {e}",
                         param="messages")
    if isinstance(e, ModelNotFoundError):
        return HTTPError(404, str(e), param="model", code="model_not_found")
    if isinstance(e, LocalMoEError):
        return HTTPError(500, str(e), type_="server_error")
    log.exception("internal error while serving a request", exc_info=e)
    return HTTPError(500, f"internal server error ({type(e).__name__}); see the server log",
                     type_="server_error")


# ------------------------------------------------------------------------------ the app state

class _State:
    def __init__(self, llm_or_factory, model_name: str | None, api_key: str | None,
                 max_queue: int, max_body_bytes: int):
        self.llm = None
        self.factory: Callable[[], Any] | None = None
        if hasattr(llm_or_factory, "chat_stream"):
            self.llm = llm_or_factory
        elif callable(llm_or_factory):
            self.factory = llm_or_factory
        else:
            raise TypeError("create_app needs an LLM or a callable returning one")
        self.status = "ready" if self.llm is not None else "loading"
        self.error: str | None = None
        self.model_name = model_name or (self.llm.model_name if self.llm is not None else "model")
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics()
        self.slot: asyncio.Semaphore | None = None
        self.created = int(time.time())
        self.loader: threading.Thread | None = None
        self.aliases: set[str] = set()  # other names users know the model by (-m, store name)

    def load(self) -> None:
        try:
            llm = self.factory()
        except LocalMoEError as e:
            self.error, self.status = str(e), "error"
            log.error("model failed to load: %s", e)
            return
        except Exception as e:  # noqa: BLE001 -- report, never crash the server thread
            self.error, self.status = f"{type(e).__name__}: {e}", "error"
            log.exception("model failed to load")
            return
        self.llm = llm
        self.status = "ready"
        log.info("model ready: %s (%s)", getattr(llm, "model_name", "?"),
                 getattr(llm, "backend_reason", "?"))

    def accepted_names(self) -> set[str]:
        names = {self.model_name} | set(self.aliases)
        if self.llm is not None:
            names.add(str(getattr(self.llm, "model_name", self.model_name)))
        return names


def create_app(llm_or_factory, api_key: str | None = None, model_name: str | None = None, *,
               max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               close_on_shutdown: bool | None = None, aliases: Any = ()):
    """Build the FastAPI application.

    Args:
        llm_or_factory: a loaded ``LLM`` (ready at once) or a zero-argument callable returning
            one, called in a background thread at startup (``/health`` says ``loading`` until
            it returns; a ``LocalMoEError`` it raises is reported by ``/health`` and 503s).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        model_name: the model id served in ``/v1/models`` and accepted in requests (the LLM's
            own ``model_name`` is accepted too). Default: the LLM's ``model_name``.
        max_queue: requests allowed to wait while another generates; one more is answered
            429 (``rate_limit_error``, the openai client retries those).
        max_body_bytes: request body limit in bytes (413 above).
        close_on_shutdown: close the LLM when the server stops (default: only when it was
            made by the factory).

    Returns:
        a ``fastapi.FastAPI`` app; its state is at ``app.state.localmoe``.
    """
    state = _State(llm_or_factory, model_name, api_key, max_queue, max_body_bytes)
    state.aliases.update(str(a) for a in aliases if a)

    @asynccontextmanager
    async def lifespan(app):
        state.slot = asyncio.Semaphore(1)
        if state.factory is not None and state.llm is None and state.loader is None:
            state.loader = threading.Thread(target=state.load, name="localmoe-load", daemon=True)
            state.loader.start()
        yield
        llm = state.llm
        close = state.factory is not None if close_on_shutdown is None else close_on_shutdown
        if llm is not None and close:
            try:
                llm.close()
            except Exception:  # noqa: BLE001
                pass

    app = FastAPI(title="localmoe", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.localmoe = state

    def error_response(err: HTTPError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, exc: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(
                   exc.status_code, str(exc.detail))
        return error_response(HTTPError(exc.status_code, msg,
                                        code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception):
        return error_response(_error_from_exception(exc))

    # -- helpers ---------------------------------------------------------------------------
    def check_auth(request: Request) -> None:
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), state.api_key.encode()):
            raise HTTPError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > state.max_body_bytes:
            raise HTTPError(413, f"request body is {cl} bytes; the limit is {state.max_body_bytes}",
                            code="request_too_large")
        chunks, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > state.max_body_bytes:
                raise HTTPError(413, f"request body exceeds the limit of {state.max_body_bytes} bytes",
                                code="request_too_large")
            chunks.append(part)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise HTTPError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body

    def ready_llm():
        if state.status == "loading":
            raise HTTPError(503, "the model is still loading; retry shortly (see /health)",
                            type_="server_error", code="model_loading")
        if state.status == "error":
            raise HTTPError(503, f"the model failed to load: {state.error}", type_="server_error",
                            code="model_load_failed")
        return state.llm

    def check_model(body: dict) -> None:
        m = body.get("model")
        if m is None or m == "":
            return
        if not isinstance(m, str):
            raise HTTPError(400, "model must be a string", param="model")
        if m not in state.accepted_names():
            raise HTTPError(404, f"the model {m!r} does not exist here; this server serves "
                            f"{state.model_name!r} (GET /v1/models)", param="model",
                            code="model_not_found")

    async def run_job(request: Request, endpoint: str, prepare, kind: str):
        """Validate, queue, generate; returns a JSON or SSE response.

        ``kind`` ("chat" | "completion") names the request shape: while the model loads (or
        after it failed to), the body is still validated first, so a bad request gets its
        400/404 and only a valid one gets the 503."""
        t_arrival = time.perf_counter()
        status = 500
        try:
            check_auth(request)
            body = await read_json(request)
            check_model(body)
            if state.status != "ready":
                openai_api.validate_request(kind, body)
            llm = ready_llm()
            cancel = threading.Event()
            job = prepare(llm, body, cancel=cancel, model_name=state.model_name)
            m = state.metrics
            if (m.running or m.queue_depth) and m.queue_depth >= state.max_queue:
                raise HTTPError(429, f"server busy: {m.queue_depth} requests are waiting; retry later",
                                type_="rate_limit_error", code="queue_full")
            resp = await _generate(request, job, cancel, t_arrival)
            status = resp.status_code
            return resp
        except Exception as e:  # noqa: BLE001 -- every failure becomes an error object
            err = _error_from_exception(e)
            status = err.status
            return error_response(err)
        finally:
            state.metrics.count_request(endpoint, status)

    async def _generate(request: Request, job, cancel: threading.Event, t_arrival: float):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        m = state.metrics
        m.queue_depth += 1
        try:
            await state.slot.acquire()
        finally:
            m.queue_depth -= 1
        m.running += 1
        _END = object()
        # Hand-off from the generation thread: items go into a deque and the event loop is
        # woken only when it is not already due to drain it, so a fast model's tokens coalesce
        # into fewer wake-ups and socket writes. Stream chunks are SSE-encoded in the worker.
        items: collections.deque = collections.deque()
        wake = asyncio.Event()
        pending = [False]

        def put(item):
            items.append(item)
            if not pending[0]:
                pending[0] = True
                loop.call_soon_threadsafe(wake.set)

        async def take() -> list:
            while True:
                await wake.wait()
                wake.clear()
                pending[0] = False
                got = []
                while items:
                    got.append(items.popleft())
                if got:
                    return got

        def worker():
            try:
                if job.stream:
                    it = job.chunks()
                    try:
                        for chunk in it:
                            put(_sse(chunk))
                            if cancel.is_set():
                                break
                    finally:
                        it.close()
                else:
                    put(job.response())
            except BaseException as e:  # noqa: BLE001 -- handed to the request task
                put(e)
            finally:
                ttft = tpot = None
                if job.t_first is not None:
                    ttft = job.t_first - t_arrival
                    n = getattr(job.result, "completion_tokens", 0) or 0
                    if n > 1 and job.t_end is not None:
                        tpot = (job.t_end - job.t_first) / (n - 1)
                m.observe_generation(job.result, ttft, tpot)  # before the client sees the end
                put(_END)

                def done():
                    m.running -= 1
                    state.slot.release()

                loop.call_soon_threadsafe(done)

        watcher = asyncio.create_task(_watch_disconnect(request, cancel))
        threading.Thread(target=worker, name="localmoe-gen", daemon=True).start()
        try:
            backlog = await take()
        except BaseException:
            cancel.set()
            watcher.cancel()
            raise
        first = backlog[0]
        if isinstance(first, BaseException) or first is _END:
            watcher.cancel()
            if first is _END:
                raise HTTPError(500, "generation ended without output", type_="server_error")
            raise first
        if not job.stream:
            watcher.cancel()
            return JSONResponse(first)

        async def sse():
            try:
                batch = backlog
                while True:
                    out = []
                    ended = False
                    for item in batch:
                        if item is _END:
                            ended = True
                            break
                        if isinstance(item, BaseException):
                            out.append(_sse(_error_from_exception(item).body()))
                            ended = True
                            break
                        out.append(item)
                    if out:
                        yield b"".join(out)
                    if ended:
                        break
                    batch = await take()
                yield b"data: [DONE]\n\n"
            finally:
                cancel.set()  # no-op after a finished generation; stops one still running
                watcher.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _watch_disconnect(request: Request, cancel: threading.Event):
        try:
            while not cancel.is_set():
                msg = await request.receive()
                if msg.get("type") == "http.disconnect":
                    cancel.set()
                    return
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 -- receive channel closed: nothing to watch
            pass

    # -- routes ----------------------------------------------------------------------------
    import localmoe.serve.openai as openai_api

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run_job(request, "/v1/chat/completions", openai_api.prepare_chat, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run_job(request, "/v1/completions", openai_api.prepare_completion,
                             "completion")

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "localmoe"}

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_auth(request)
        except HTTPError as e:
            state.metrics.count_request("/v1/models", e.status)
            return error_response(e)
        state.metrics.count_request("/v1/models", 200)
        return {"object": "list", "data": [model_card(state.model_name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model_get(model_id: str, request: Request):
        check_auth(request)
        if model_id not in state.accepted_names():
            raise HTTPError(404, f"the model {model_id!r} does not exist here; this server serves "
                            f"{state.model_name!r}", param="model", code="model_not_found")
        return model_card(model_id)

    @app.get("/health")
    async def health():
        if state.status == "ready":
            llm = state.llm
            return {"status": "ok", "model": state.model_name,
                    "backend": getattr(llm, "backend_name", None),
                    "n_ctx": getattr(llm, "n_ctx", None)}
        body: dict[str, Any] = {"status": state.status, "model": state.model_name}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(state.status == "ready"),
                                 media_type="text/plain; version=0.0.4")

    return app


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_port_free(host: str, port: int) -> None:
    """Raise LocalMoEError when ``host:port`` cannot be bound (in use, no permission, bad host)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise LocalMoEError(f"cannot listen on {host}:{port}: {e}") from None
    fam, _, _, _, addr = infos[0]
    with socket.socket(fam, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise LocalMoEError(f"cannot listen on {host}:{port}: {e.strerror or e}; "
                                f"choose another --port") from None


def run_server(model, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               backend: str = "auto", n_ctx: int | None = None, kv_cache: str = "f16",
               kv_cache_k: str | None = None, kv_cache_v: str | None = None, *,
               model_name: str | None = None, log_level: str = "info", **llm_options) -> None:
    """Serve ``model`` over the OpenAI API until interrupted (``localmoe serve``).

    The model file is resolved and its header checked, and the backend chosen, before the port
    opens (a wrong path, a corrupt file or an unavailable backend is an error here, not a server
    that cannot serve). Then the port opens and the weights load in the background (``/health``
    says when ready); a failure at that stage is logged and reported by ``/health`` and 503s.

    Args:
        model: model path or store name (as ``localmoe.LLM``).
        host, port: bind address; binding a non-loopback address without ``api_key`` logs a
            warning (anyone on the network could use the model).
        api_key: required bearer token for ``/v1/*`` (None: no authentication).
        backend, n_ctx, kv_cache, kv_cache_k, kv_cache_v: passed to ``LLM``.
        model_name: model id to serve (default: the file name without ``.gguf``).

    Raises:
        KVCacheFormatError: invalid kv cache format (or one the backend cannot hold).
        InvalidRequestError: unknown device, or one that does not exist here; a
            ``$LOCALMOE_THREADS`` that is no thread count.
        ModelNotFoundError, ModelLoadError, UnsupportedModelError, StoreError: the model cannot
            be found or read.
        BackendUnavailableError: the backend cannot run this model here.
    """
    import uvicorn

    from localmoe.engine.options import check_backend_device, check_device, parse_kv_request
    from localmoe.io.loader import open_model
    from localmoe.engine.registry import env_threads, select_backend
    from localmoe.io.store import resolve_model

    # fail before binding on a bad format, device or $LOCALMOE_THREADS, a missing or corrupt
    # file or an unusable backend
    kv_spec = parse_kv_request(kv_cache, kv_cache_k, kv_cache_v)
    check_device(llm_options.get("device"))
    if llm_options.get("n_threads") is None:
        env_threads()
    model_file = open_model(resolve_model(model))
    be, _ = select_backend(backend or "auto", model_file.format, kv_spec)
    check_backend_device(be, llm_options.get("device"))
    _check_port_free(host, port)
    if not is_loopback(host) and not api_key:
        msg = (f"WARNING: serving on {host}:{port} without an API key; anyone who can reach "
               f"this address can use the model. Pass --api-key KEY or bind 127.0.0.1.")
        log.warning(msg)
        import sys

        print(msg, file=sys.stderr)

    def factory():
        from localmoe.api import LLM

        return LLM(model_file, backend=backend, n_ctx=n_ctx, kv_cache=kv_cache,
                   kv_cache_k=kv_cache_k, kv_cache_v=kv_cache_v, **llm_options)

    app = create_app(factory, api_key=api_key,
                     model_name=model_name or display_name(model),
                     aliases={str(model) if model is not None else "", model_file.name,
                              Path(str(model_file.path)).name})
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
