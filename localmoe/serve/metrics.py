"""Server metrics (``GET /metrics``): request counts, tokens, TTFT/TPOT histograms, queue
depth, rendered as Prometheus text exposition."""

from __future__ import annotations

import threading

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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
