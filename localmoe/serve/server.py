"""OpenAI-compatible HTTP server (``localmoe serve``) on FastAPI + uvicorn.

Endpoints:

* ``POST /v1/chat/completions`` -- non-stream and SSE stream, tools, tool_choice, stop, seed,
  sampling parameters, ``stream_options.include_usage`` (see :mod:`localmoe.openai`).
* ``POST /v1/completions`` -- raw-prompt completions.
* ``GET /v1/models`` and ``GET /v1/models/{id}``.
* ``GET /health`` -- ``200 {"status": "ok"}`` when ready, ``503 {"status": "loading"}`` while
  the model loads in the background, ``503 {"status": "error", "error": ...}`` when it failed
  (an app of :func:`create_app` given a loader keeps serving that; ``localmoe serve``, whose
  one model it is, stops instead: :func:`run_server`).
* ``GET /metrics`` -- Prometheus text: requests by endpoint and status, prompt/generated
  tokens, TTFT and TPOT histograms (seconds), queue depth, running requests.

Behaviour:

* Generation runs in worker threads, one at a time (the engine serializes per model); requests
  arriving together wait in a FIFO queue of at most ``max_queue`` (then ``429``). A request
  that fails never affects the others.
* A client that disconnects (stream or not) cancels its generation at the next token.
* Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: ``400`` for
  invalid JSON, invalid parameters (``param`` names the field) and a prompt over the context
  or a ``max_tokens`` that does not fit beside it (``code: "context_length_exceeded"``,
  ``param`` the prompt's field or the ``max_tokens`` one, the token counts in the message; without ``max_tokens`` the reply may fill the context); ``401`` for a
  missing/wrong API key; ``404`` for an unknown model or route; ``413`` for a body over
  ``max_body_bytes``; ``415`` for a body sent with a Content-Type other than
  ``application/json`` (or a ``+json`` type; none at all is read as JSON); ``503`` while
  loading (only for requests that pass validation: a bad one gets its 400/404 while the model
  loads too). Only bugs give ``500`` (no traceback is
  sent).
* Logs, uvicorn's access log included (one line a request), go to stderr: stdout stays
  empty.
* With ``api_key`` set, ``/v1/*`` needs ``Authorization: Bearer <key>``; ``/health`` and
  ``/metrics`` stay open for probes and scrapers.
* SIGTERM (and SIGINT) shut down gracefully: the port closes (no new connection), requests in
  flight get :data:`SHUTDOWN_GRACE_S` to finish, then their generations are stopped and they
  end properly (a stream with its final chunk, ``finish_reason: "length"``, and ``data:
  [DONE]``); requests still queued then get 503 ``server_shutting_down``. After SIGTERM the
  process exits 0 (SIGINT: 130, as every command after Ctrl-C).

Modules: :mod:`~localmoe.serve.app` (:func:`create_app`), :mod:`~localmoe.serve.routes`,
:mod:`~localmoe.serve.streaming` (worker thread, SSE, cancellation),
:mod:`~localmoe.serve.state`, :mod:`~localmoe.serve.errors`, :mod:`~localmoe.serve.metrics`;
this module starts the server (:func:`run_server`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
from pathlib import Path

from localmoe.errors import LocalMoEError
from localmoe.serve.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, create_app
from localmoe.serve.errors import HTTPError, log
from localmoe.serve.metrics import Metrics
from localmoe.serve.state import StopServing

__all__ = ["run_server", "create_app", "is_loopback", "HTTPError", "Metrics",
           "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_QUEUE", "SHUTDOWN_GRACE_S"]

#: seconds the requests in flight get to finish after SIGTERM/SIGINT before their generations
#: are stopped (under docker's 10 s and systemd's 90 s before SIGKILL)
SHUTDOWN_GRACE_S = 5.0
#: seconds the stopped requests then get to send their last chunk before uvicorn cancels them
_SHUTDOWN_END_S = 3.0


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
            import errno

            # an address this machine does not have is the host's fault, not the port's
            fix = ("choose a --host this machine has (127.0.0.1, 0.0.0.0 or one of its "
                   "addresses)" if e.errno == errno.EADDRNOTAVAIL else "choose another --port")
            raise LocalMoEError(f"cannot listen on {host}:{port}: {e.strerror or e}; "
                                f"{fix}") from None


def run_server(model, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               backend: str = "auto", n_ctx: int | None = None, kv_cache: str = "f16",
               kv_cache_k: str | None = None, kv_cache_v: str | None = None, *,
               model_name: str | None = None, log_level: str = "info", **llm_options) -> None:
    """Serve ``model`` over the OpenAI API until interrupted (``localmoe serve``).

    The model file is resolved and its header checked, and the backend chosen, before the port
    opens (a wrong path, a corrupt file or an unavailable backend is an error here, not a server
    that cannot serve). Then the port opens and the weights load in the background (``/health``
    says ``loading`` until ready). The model is the server's only one: when it fails to load
    (the backend refuses the file, e.g. an expert tensor missing) or is damaged (non-finite
    logits in a 1-token warm-up, :func:`warm_up`), the server shuts down and raises that
    error (the CLI prints it as its one ``error:`` line, the same as ``generate`` for the
    file, exit status 1), as vLLM and llama-server exit, rather than answer 503 forever.

    SIGTERM (and SIGINT) shut down gracefully (:func:`_server`); after SIGTERM this returns
    (exit status 0), after SIGINT the signal is raised again once shut down (status 130).

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
            ``$LOCALMOE_THREADS`` that is no thread count, a ``$LOCALMOE_ACT_PRECISION`` that is
            not int8, int16 or mixed; a context size that is not a
            positive integer, is 1 (no room for an answer) or is above the model's training
            context.
        ModelNotFoundError, ModelLoadError, UnsupportedModelError, StoreError: the model cannot
            be found or read, before the port opens or while it loads (then after shutting
            down; any other exception of the load too).
        BackendUnavailableError: the backend cannot run this model here.
    """
    import uvicorn

    from localmoe.engine.options import (check_act_env, check_backend_device, check_device,
                                         check_n_ctx, context_size, parse_kv_request)
    from localmoe.backends.registry import env_threads, select_backend
    from localmoe.io.loader import open_model
    from localmoe.io.store import display_name, resolve_model

    # fail before binding on a bad format, device, context size, $LOCALMOE_THREADS or
    # $LOCALMOE_ACT_PRECISION, a missing or corrupt file or an unusable backend
    kv_spec = parse_kv_request(kv_cache, kv_cache_k, kv_cache_v)
    device = check_device(llm_options.get("device"))
    if llm_options.get("n_threads") is None:
        env_threads()
    check_act_env()
    check_n_ctx(n_ctx)
    if n_ctx is not None and n_ctx < 2:  # (its warm-up said "the prompt fills the context")
        from localmoe.errors import InvalidRequestError

        raise InvalidRequestError(f"a context of {n_ctx} token holds a 1-token prompt but "
                                  f"leaves no room for an answer; serve with --ctx-size 2 or "
                                  f"more", param="n_ctx")
    model_file = open_model(resolve_model(model))
    context_size(n_ctx, model_file.spec.n_ctx_train)   # refuses one above the training context
    kv_spec.check_head_dims(model_file.spec.head_dim, model_file.spec.v_head_dim)
    be, _ = select_backend("auto" if backend is None else backend, model_file.format, kv_spec)
    check_backend_device(be, device)
    _check_port_free(host, port)
    from localmoe.backends.registry import auto_kv_fallback

    why = auto_kv_fallback(backend, model_file.format, kv_spec, be.name)
    if why:   # once, on stderr as generate says it (logging is configured only at the bind)
        import sys

        print(f"note: {why}", file=sys.stderr, flush=True)
    if not is_loopback(host) and not api_key:
        msg = (f"WARNING: serving on {host}:{port} without an API key; anyone who can reach "
               f"this address can use the model. Pass --api-key KEY or bind 127.0.0.1.")
        import sys

        print(msg, file=sys.stderr)     # once (logging is configured only later, at the bind)

    failed: list[BaseException] = []
    running: list = []  # the uvicorn.Server, for the loader to stop

    def factory():
        from localmoe.api import LLM

        llm = None
        try:
            llm = LLM(model_file, backend=backend, n_ctx=n_ctx, kv_cache=kv_cache,
                      kv_cache_k=kv_cache_k, kv_cache_v=kv_cache_v, **llm_options)
            warm_up(llm)
        except Exception as e:  # noqa: BLE001 -- the only model cannot serve: stop serving
            failed.append(e)
            if llm is not None:
                try:
                    llm.close()
                except Exception:  # noqa: BLE001 -- the load's error is the one to report
                    pass
            if running:
                running[0].should_exit = True
            raise StopServing(str(e)) from e  # raised below once stopped: not logged too
        return llm

    app = create_app(factory, api_key=api_key,
                     model_name=model_name or display_name(model),
                     aliases={str(model) if model is not None else "", model_file.name,
                              Path(str(model_file.path)).name})
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    grace = float(SHUTDOWN_GRACE_S)
    srv = _server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                 log_config=_log_config(),
                                 timeout_graceful_shutdown=grace + _SHUTDOWN_END_S),
                  app.state.localmoe, grace)
    running.append(srv)
    srv.run()
    if failed:  # the CLI prints a LocalMoEError as one error line, exit status 1
        raise failed[0]
    if not srv.started:  # as uvicorn.run: the reason is in uvicorn's log above
        raise LocalMoEError(f"the server could not start on {host}:{port} (see the log above)")


def _log_config() -> dict:
    """uvicorn's logging configuration (its formats and levels) with the access log on
    stderr, where the server's other logs go (uvicorn writes it to stdout), so stdout stays
    clean for what a command prints."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    for handler in cfg.get("handlers", {}).values():
        if handler.get("stream") == "ext://sys.stdout":
            handler["stream"] = "ext://sys.stderr"
    return cfg


def _server(config, state, grace: float):
    """A ``uvicorn.Server`` whose shutdown drains the requests in flight.

    uvicorn closes the port and the idle connections and waits for the open requests, then
    cancels them after ``timeout_graceful_shutdown`` (a stream cut without its final chunk or
    ``[DONE]``), and re-raises the signal that stopped it (SIGTERM: the process dies of it,
    status 143). Here the requests get ``grace`` seconds to finish, then
    ``state.stop_generations()`` stops their generations, so each ends properly within the
    remaining ``timeout_graceful_shutdown``; and SIGTERM, a requested stop, is not re-raised
    (the CLI exits 0). SIGINT keeps uvicorn's handling (a second one forces the exit).
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM:
                self.should_exit = True  # not recorded: not raised again once shut down
                return
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            m = state.metrics
            if m.running or m.queue_depth:
                log.info("shutting down: %d request(s) in flight get %g s to finish",
                         m.running + m.queue_depth, grace)
            timer = asyncio.get_running_loop().call_later(grace, state.stop_generations)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(config)


def warm_up(llm) -> None:
    """One forward pass of a 1-token prompt right after loading (``serve`` runs it before
    reporting ready), so damaged weights stop the server instead of failing every request.

    Raises:
        ModelLoadError: the logits are not finite (the engine's check of the prompt logits).
    """
    ids = [llm.tokenizer.bos_id] if llm.tokenizer.bos_id is not None else "Hi"
    llm.generate(ids, max_tokens=1, temperature=0)
