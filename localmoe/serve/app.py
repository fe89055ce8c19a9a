"""The FastAPI application of ``localmoe serve``: :func:`create_app` builds it from an LLM or
a loader, registers the routes (:mod:`localmoe.serve.routes`) and maps every error onto an
OpenAI error object (:mod:`localmoe.serve.errors`)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from localmoe.serve.errors import HTTPError, error_from_exception
from localmoe.serve.routes import error_response, router
from localmoe.serve.state import ServerState

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_QUEUE = 64


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
    state = ServerState(llm_or_factory, model_name, api_key, max_queue, max_body_bytes)
    state.aliases.update(str(a) for a in aliases if a)
    app = FastAPI(title="localmoe", lifespan=_lifespan(state, close_on_shutdown), docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.localmoe = state
    _add_error_handlers(app)
    app.include_router(router)
    return app


def _lifespan(state: ServerState, close_on_shutdown: bool | None):
    """Startup: the generation slot and the background load; shutdown: close the LLM (by
    default only one the factory made)."""

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

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, the framework's 404/405 included, answers an OpenAI error object."""

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
        return error_response(error_from_exception(exc))
