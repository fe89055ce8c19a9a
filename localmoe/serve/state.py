"""The server's state (``app.state.localmoe``): the model (loaded, loading or failed), the names
it is served by, the API key, limits, metrics, the one generation slot and the requests in
flight (for the shutdown to stop).

The request checks that need only this state (API key, model name, readiness) live here and
raise :class:`~localmoe.serve.errors.HTTPError`; nothing here knows the web framework.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
import weakref
from typing import Any, Callable

from localmoe.errors import LocalMoEError, json_value
from localmoe.serve.errors import HTTPError, log
from localmoe.serve.metrics import Metrics


def warm_grammar(llm) -> None:
    """Build the grammar engine's view of the model's vocabulary in a background thread (0.2 s
    for SmolLM2, ~2 s for a 262k vocabulary), so the first structured-output request does not
    wait for it on the event loop."""
    tok = getattr(llm, "tokenizer", None)
    if tok is None or not hasattr(tok, "token_bytes"):
        return

    def work():
        try:
            from localmoe.text.grammar import available, grammar_tokenizer

            if available() is None:
                grammar_tokenizer(tok)
        except Exception:  # noqa: BLE001 -- the first constrained request reports it
            pass

    threading.Thread(target=work, name="localmoe-grammar-warm", daemon=True).start()


class StopServing(Exception):
    """Raised by a model factory whose failure stops the server (``raise StopServing(str(e))
    from e``): whoever runs the server reports the error once it has stopped (``localmoe
    serve`` as its ``error:`` line), so :meth:`ServerState.load` records it for ``/health``
    without logging it too."""


class RequestCancel(threading.Event):
    """The cancel event of one request: set, its generation stops at the next token.
    ``by_server`` is True when the server's shutdown set it (the answer is ended properly,
    not dropped as for a client that left)."""

    by_server = False


def stopped_by_server(cancel) -> bool:
    """Whether the server's shutdown stopped the request of ``cancel``."""
    return bool(getattr(cancel, "by_server", False))


class ServerState:
    """What the routes share.

    Args:
        llm_or_factory: a loaded ``LLM`` (anything with ``chat_stream``) or a zero-argument
            callable returning one (called by :meth:`load`).
        model_name: the model id served (default: the LLM's ``model_name``, else ``"model"``).
        api_key: the bearer token ``/v1/*`` requires (None: none).
        max_queue: requests allowed to wait while another generates.
        max_body_bytes: request body limit in bytes.

    Raises:
        TypeError: ``llm_or_factory`` is neither an LLM nor callable.
    """

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
        self.requests: weakref.WeakSet = weakref.WeakSet()  # cancel events of requests in flight
        self.stopping = False  # the shutdown stopped the generations: no new one starts
        if self.llm is not None:
            warm_grammar(self.llm)

    def load(self) -> None:
        """Call the factory (in the loader thread); a failure sets ``status="error"`` and
        ``error`` (reported by ``/health`` and 503s), never raises."""
        try:
            llm = self.factory()
        except StopServing as e:  # the server's owner reports it (not logged twice)
            self.error, self.status = str(e), "error"
            return
        except LocalMoEError as e:
            self.error, self.status = str(e), "error"
            log.error("model failed to load: %s", e)
            return
        except Exception as e:  # noqa: BLE001 -- report, never crash the server thread
            self.error, self.status = f"{type(e).__name__}: {e}", "error"
            log.exception("model failed to load")
            return
        self.llm = llm
        warm_grammar(llm)
        self.status = "ready"
        log.info("model ready: %s (%s)", getattr(llm, "model_name", "?"),
                 getattr(llm, "backend_reason", "?"))

    def new_cancel(self) -> RequestCancel:
        """The cancel event of a new request, known to :meth:`stop_generations`."""
        ev = RequestCancel()
        self.requests.add(ev)
        return ev

    def stop_generations(self) -> None:
        """The shutdown's grace period is over (on the event loop): stop every generation in
        flight at its next token (the answers end properly, cut short), and have requests
        still waiting for the model answered 503 (``stopping``)."""
        self.stopping = True
        live = [ev for ev in list(self.requests) if not ev.is_set()]
        if live:
            log.info("shutting down: the grace period is over; stopping %d request(s)",
                     len(live))
        for ev in live:
            ev.by_server = True  # before set(): whoever sees it set knows why
            ev.set()

    def accepted_names(self) -> set[str]:
        """Model ids a request may name: the served id, the aliases, the LLM's own name."""
        names = {self.model_name} | set(self.aliases)
        if self.llm is not None:
            names.add(str(getattr(self.llm, "model_name", self.model_name)))
        return names

    def check_auth(self, authorization: str) -> None:
        """Raise a 401 HTTPError unless ``authorization`` (the header's value) is
        ``Bearer <api_key>`` (no check without an API key)."""
        if self.api_key is None:
            return
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()):
            raise HTTPError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")

    def check_model(self, body: dict) -> None:
        """Raise an HTTPError (400 not a string, 404 unknown) for the body's ``model`` unless it
        is absent, empty or one of :meth:`accepted_names`."""
        m = body.get("model")
        if m is None or m == "":
            return
        if not isinstance(m, str):
            raise HTTPError(400, "model must be a string", param="model")
        if m not in self.accepted_names():
            raise HTTPError(404, f"the model {json_value(m, 200)} does not exist here; this "
                            f"server serves {json_value(self.model_name, 200)} (GET /v1/models)",
                            param="model", code="model_not_found")

    def ready_llm(self):
        """The loaded LLM; a 503 HTTPError while it loads or after it failed to."""
        if self.status == "loading":
            raise HTTPError(503, "the model is still loading; retry shortly (see /health)",
                            type_="server_error", code="model_loading")
        if self.status == "error":
            raise HTTPError(503, f"the model failed to load: {self.error}", type_="server_error",
                            code="model_load_failed")
        return self.llm
