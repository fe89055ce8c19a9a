"""HTTP errors in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) and
the mapping of localmoe's exceptions onto them."""

from __future__ import annotations

import logging

from localmoe.errors import (ContextOverflowError, InvalidRequestError, LocalMoEError,
                             ModelLoadError, ModelNotFoundError, TemplateError)

log = logging.getLogger("localmoe.serve.server")  # the server's one logger


class HTTPError(Exception):
    """An error answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_from_exception(e: BaseException, prompt_param: str = "messages",
                         max_tokens_param: str = "max_tokens") -> HTTPError:
    """Map an exception raised while handling a request to an HTTP error: 400 for a bad
    request, a prompt (or a prompt and ``max_tokens``) over the context or a template
    failure, 404 for an unknown model, 503 (type ``model_error``) for damaged weights met by
    a request, 500 for anything else (a bug is logged with its traceback, which is never
    sent). ``prompt_param``: the request field a prompt over the context is blamed on
    (``"prompt"`` on ``/v1/completions``); ``max_tokens_param``: the field blamed when the
    prompt fits but ``max_tokens`` does not fit beside it (``"max_completion_tokens"`` when
    the request gave that one)."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, ContextOverflowError) and e.n_completion is not None:
        # max_tokens does not fit beside the prompt: vLLM's words (clients look for them)
        return HTTPError(400, f"this model's maximum context length is {e.n_ctx} tokens, but "
                              f"{e.n_prompt + e.n_completion} tokens were requested "
                              f"({e.n_prompt} in the {prompt_param}, {e.n_completion} in the "
                              f"completion); lower max_tokens or shorten the {prompt_param}, or "
                              f"restart the server with a larger context (localmoe serve -c N)",
                         param=max_tokens_param, code="context_length_exceeded")
    if isinstance(e, ContextOverflowError):
        # the hint for a client: --ctx-size / n_ctx are the server operator's, not its own
        return HTTPError(400, f"{e.reason}; shorten the {prompt_param}, or restart the server "
                              f"with a larger context (localmoe serve -c N)",
                         param=prompt_param, code="context_length_exceeded")
    if isinstance(e, InvalidRequestError):
        return HTTPError(400, str(e), param=e.param, code="invalid_value" if e.param else None)
    if isinstance(e, TemplateError):
        return HTTPError(400, f"the chat template could not render these messages: {e}",
                         param="messages")
    if isinstance(e, ModelNotFoundError):
        return HTTPError(404, str(e), param="model", code="model_not_found")
    if isinstance(e, ModelLoadError):  # damaged weights met by a request: not a bug
        return HTTPError(503, str(e), type_="model_error", code="model_damaged")
    if isinstance(e, LocalMoEError):
        return HTTPError(500, str(e), type_="server_error")
    log.exception("internal error while serving a request", exc_info=e)
    return HTTPError(500, f"internal server error ({type(e).__name__}); see the server log",
                     type_="server_error")
