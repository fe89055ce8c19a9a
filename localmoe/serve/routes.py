"""The server's routes (:data:`router`) and the request handling they share.

Each route reads the server's :class:`~localmoe.serve.state.ServerState` from
``request.app.state.localmoe``. Failures become OpenAI error objects
(:mod:`localmoe.serve.errors`); every ``/v1/*`` request is counted in the metrics by endpoint
and status.
``GET`` routes (but ``/metrics``) answer ``HEAD`` too: the same status and headers, no body
(the server drops it), for health checks that send ``HEAD``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, Callable

from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect
from fastapi.responses import JSONResponse, PlainTextResponse

import localmoe.openai as openai_shaping
from localmoe.errors import json_value
from localmoe.serve.errors import HTTPError, error_from_exception
from localmoe.serve.state import ServerState
from localmoe.serve.streaming import CountedStream, SafeJSONResponse, generate

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.localmoe


def error_response(err: HTTPError) -> JSONResponse:
    """The JSON response of ``err`` (a 401 carries ``WWW-Authenticate: Bearer``)."""
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return SafeJSONResponse(err.body(), status_code=err.status, headers=headers)


def _check_auth(request: Request) -> None:
    _state(request).check_auth(request.headers.get("authorization", ""))


def _check_json_content_type(request: Request) -> None:
    """415 for a body declared as anything but JSON (``application/json`` or a ``+json``
    type): ``text/plain``, or the form encoding ``curl -d`` sends without ``-H``, is not read
    as JSON, as OpenAI's and vLLM's servers do not read it. A request without a Content-Type
    is read as JSON (as FastAPI does; ``requests.post(url, data=json_text)`` sends none)."""
    ct = request.headers.get("content-type", "")
    media = ct.split(";", 1)[0].strip().lower()
    if not media:
        return
    main, _, sub = media.partition("/")
    if main == "application" and (sub == "json" or sub.endswith("+json")):
        return
    shown = ct.strip() if len(ct.strip()) <= 80 else ct.strip()[:77] + "..."
    raise HTTPError(415, f"unsupported Content-Type {shown!r}: the request body must be "
                    f"JSON sent as 'Content-Type: application/json' (with curl, add "
                    f"-H 'Content-Type: application/json')", code="unsupported_media_type")


async def _read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object; 415 when declared as another type than JSON
    (:func:`_check_json_content_type`), 413 over ``limit`` bytes, 400 when not JSON, nested
    deeper than the JSON parser's recursion allows, or not an object."""
    _check_json_content_type(request)
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise HTTPError(413, f"request body is {cl} bytes; the limit is {limit}",
                        code="request_too_large")
    chunks, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise HTTPError(413, f"request body exceeds the limit of {limit} bytes",
                                code="request_too_large")
            chunks.append(part)
    except ClientDisconnect:
        # nobody is left to answer: counted as 499 (nginx's "client closed request"), not a 5xx
        raise HTTPError(499, "the client disconnected while sending the request body",
                        code="client_disconnected") from None
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than the parser's recursion allows (~950 levels by default)
        raise HTTPError(400, "request body JSON is nested too deeply (arrays/objects nest at "
                        f"most about {sys.getrecursionlimit()} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object")
    return body


async def run_job(request: Request, endpoint: str, prepare: Callable, kind: str):
    """Validate, queue, generate; returns a JSON or SSE response.

    ``kind`` ("chat" | "completion") names the request shape: while the model loads (or
    after it failed to), the body is still validated first, so a bad request gets its
    400/404 and only a valid one gets the 503."""
    state = _state(request)
    t_arrival = time.perf_counter()
    status: int | None = 500
    body = None
    try:
        _check_auth(request)
        body = await _read_json(request, state.max_body_bytes)
        state.check_model(body)
        if state.status != "ready":
            openai_shaping.validate_request(kind, body)
        llm = state.ready_llm()
        cancel = state.new_cancel()  # the shutdown may stop it too
        # validation compiles a request's grammar (JSON schema, forced tool call): off the
        # event loop, so a slow schema (refused after COMPILE_TIMEOUT_S) stalls no one else
        job = await asyncio.to_thread(prepare, llm, body, cancel=cancel,
                                      model_name=state.model_name)
        m = state.metrics
        if (m.running or m.queue_depth) and m.queue_depth >= state.max_queue:
            raise HTTPError(429, f"server busy: {m.queue_depth} requests are waiting; retry later",
                            type_="rate_limit_error", code="queue_full")
        resp = await generate(request, job, cancel, t_arrival, state, endpoint)
        # a stream is counted when it ends: 200 read to the end, 499 closed by the client
        status = None if isinstance(resp, CountedStream) else resp.status_code
        return resp
    except Exception as e:  # noqa: BLE001 -- every failure becomes an error object
        # max_completion_tokens wins over max_tokens when both are given (as in sampling)
        mt_param = ("max_completion_tokens" if isinstance(body, dict)
                    and body.get("max_completion_tokens") is not None else "max_tokens")
        err = error_from_exception(
            e, prompt_param="prompt" if endpoint == "/v1/completions" else "messages",
            max_tokens_param=mt_param)
        status = err.status
        return error_response(err)
    finally:
        if status is not None:
            state.metrics.count_request(endpoint, status)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await run_job(request, "/v1/chat/completions", openai_shaping.prepare_chat, "chat")


@router.post("/v1/completions")
async def completions(request: Request):
    return await run_job(request, "/v1/completions", openai_shaping.prepare_completion,
                         "completion")


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "localmoe"}


@router.api_route("/v1/models", methods=["GET", "HEAD"])
async def models(request: Request):
    state = _state(request)
    try:
        _check_auth(request)
    except HTTPError as e:
        state.metrics.count_request("/v1/models", e.status)
        return error_response(e)
    state.metrics.count_request("/v1/models", 200)
    return {"object": "list", "data": [_model_card(state, state.model_name)]}


@router.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
async def model_get(model_id: str, request: Request):
    state = _state(request)
    _check_auth(request)
    if model_id not in state.accepted_names():
        raise HTTPError(404, f"the model {json_value(model_id, 200)} does not exist here; this "
                        f"server serves {json_value(state.model_name, 200)}", param="model",
                        code="model_not_found")
    return _model_card(state, model_id)


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load-balancer checks, curl -I
async def health(request: Request):
    state = _state(request)
    if state.status == "ready":
        llm = state.llm
        return {"status": "ok", "model": state.model_name,
                "backend": getattr(llm, "backend_name", None),
                "n_ctx": getattr(llm, "n_ctx", None)}
    body: dict[str, Any] = {"status": state.status, "model": state.model_name}
    if state.error:
        body["error"] = state.error
    return JSONResponse(body, status_code=503)


@router.get("/metrics")
async def metrics(request: Request):
    state = _state(request)
    return PlainTextResponse(state.metrics.render(state.status == "ready"),
                             media_type="text/plain; version=0.0.4")
