"""Server metrics (``GET /metrics``): request counts, tokens, TTFT/TPOT histograms, queue
depth, in the Prometheus text exposition format, kept and rendered by ``prometheus_client``.

Each :class:`Metrics` has its own ``CollectorRegistry`` (not the process-wide default one), so
two servers in one process (tests, an application embedding the server) count apart.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: seconds; request arrival to the first token (queueing included)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: seconds; mean time per generated token after the first
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The server's counters, histograms and gauges.

    Metric names (stable; dashboards use them): ``localmoe_requests_total{endpoint,status}``,
    ``localmoe_prompt_tokens_total``, ``localmoe_generation_tokens_total``,
    ``localmoe_cancelled_generations_total``, the histograms
    ``localmoe_time_to_first_token_seconds`` and ``localmoe_time_per_output_token_seconds``
    (``_bucket``/``_sum``/``_count``), and the gauges ``localmoe_queue_depth``,
    ``localmoe_requests_running`` and ``localmoe_model_ready``.

    ``status`` is the HTTP status answered, or ``499`` (nginx's "client closed request") for
    a request whose client disconnected before its answer ended: a stream closed before
    ``[DONE]`` (its status line said 200), a JSON answer nobody was left to read, or a request
    that left the queue because its client did (its generation, which never started, counts
    in ``localmoe_cancelled_generations_total``).

    ``queue_depth`` and ``running`` are plain ints the server's request path updates (under
    its event loop); the gauges read them when scraped. Times are seconds; counts are tokens
    or requests. Thread-safe.

    Attributes:
        registry: the ``prometheus_client.CollectorRegistry`` holding these metrics.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.queue_depth = 0
        self.running = 0
        self._ready = False
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("localmoe_requests", "HTTP requests by endpoint and status code.",
                                ("endpoint", "status"), registry=r)
        self.prompt_tokens = Counter("localmoe_prompt_tokens", "Prompt tokens processed.",
                                     registry=r)
        self.generation_tokens = Counter("localmoe_generation_tokens", "Tokens generated.",
                                         registry=r)
        self.cancelled = Counter("localmoe_cancelled_generations",
                                 "Generations cancelled by a client disconnect.", registry=r)
        self.ttft = Histogram("localmoe_time_to_first_token_seconds",
                              "Request arrival to first token, queueing included.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("localmoe_time_per_output_token_seconds",
                              "Mean time per generated token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        Gauge("localmoe_queue_depth", "Requests waiting for the model.",
              registry=r).set_function(lambda: self.queue_depth)
        Gauge("localmoe_requests_running", "Requests generating now.",
              registry=r).set_function(lambda: self.running)
        Gauge("localmoe_model_ready", "1 when the model is loaded.",
              registry=r).set_function(lambda: 1 if self._ready else 0)

    def count_request(self, endpoint: str, status: int) -> None:
        """One finished HTTP request to ``endpoint`` answered with ``status``."""
        self.requests.labels(endpoint=endpoint, status=str(int(status))).inc()

    def count_cancelled(self) -> None:
        """One generation cancelled because its client left (or never started: the client
        left while the request waited for the model)."""
        self.cancelled.inc()

    def observe_generation(self, result, ttft_s: float | None, tpot_s: float | None,
                           stopped: bool = False) -> None:
        """A finished generation: its token counts (``result``, a GenerationResult or None) and
        its TTFT / TPOT in seconds (None when not measured). It counts as cancelled when its
        finish reason says so, or when it was ``stopped`` (its client left) before it produced
        a result at all (``result`` None: cut before its first token, or while its prompt was
        prepared)."""
        if result is not None:
            self.prompt_tokens.inc(int(result.prompt_tokens))
            self.generation_tokens.inc(int(result.completion_tokens))
        if (result.finish_reason == "cancelled") if result is not None else stopped:
            self.count_cancelled()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def render(self, ready: bool) -> str:
        """The exposition text (Prometheus text format 0.0.4; counters also carry the
        ``_created`` timestamps prometheus_client adds); ``ready``: whether the model is
        loaded."""
        with self._lock:
            self._ready = bool(ready)
            return generate_latest(self.registry).decode("utf-8")
