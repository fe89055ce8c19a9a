"""/metrics: kept and rendered by prometheus_client (its own parser reads it back), under the
metric names dashboards use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from localmoe.serve.metrics import TTFT_BUCKETS, Metrics


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_are_prometheus_client_metrics_with_the_stable_names():
    m = Metrics()
    assert isinstance(m.registry, CollectorRegistry)
    m.count_request("/v1/chat/completions", 200)
    m.count_request("/v1/chat/completions", 200)
    m.count_request("/v1/completions", 400)
    done = SimpleNamespace(prompt_tokens=7, completion_tokens=5, finish_reason="stop")
    gone = SimpleNamespace(prompt_tokens=3, completion_tokens=1, finish_reason="cancelled")
    m.observe_generation(done, 0.3, 0.02)
    m.observe_generation(gone, 0.004, None)
    m.queue_depth, m.running = 2, 1
    fam = _families(m.render(ready=True))
    assert fam["localmoe_requests"].type == "counter"
    reqs = {(s.labels["endpoint"], s.labels["status"]): s.value
            for s in fam["localmoe_requests"].samples if s.name == "localmoe_requests_total"}
    assert reqs == {("/v1/chat/completions", "200"): 2, ("/v1/completions", "400"): 1}

    def value(family, sample):
        return next(s.value for s in fam[family].samples if s.name == sample)

    assert value("localmoe_prompt_tokens", "localmoe_prompt_tokens_total") == 10
    assert value("localmoe_generation_tokens", "localmoe_generation_tokens_total") == 6
    assert value("localmoe_cancelled_generations", "localmoe_cancelled_generations_total") == 1
    ttft = fam["localmoe_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in ttft.samples if s.name.endswith("_bucket")}
    assert len(buckets) == len(TTFT_BUCKETS) + 1
    assert buckets["0.01"] == 1 and buckets["0.25"] == 1 and buckets["0.5"] == 2  # cumulative
    assert buckets["+Inf"] == 2
    assert value("localmoe_time_to_first_token_seconds",
                 "localmoe_time_to_first_token_seconds_sum") == pytest.approx(0.304)
    assert value("localmoe_time_per_output_token_seconds",
                 "localmoe_time_per_output_token_seconds_count") == 1  # None is not observed
    assert value("localmoe_queue_depth", "localmoe_queue_depth") == 2
    assert value("localmoe_requests_running", "localmoe_requests_running") == 1
    assert value("localmoe_model_ready", "localmoe_model_ready") == 1
    assert _families(m.render(ready=False))["localmoe_model_ready"].samples[0].value == 0


def test_two_servers_in_one_process_count_apart():
    a, b = Metrics(), Metrics()
    a.count_request("/v1/models", 200)
    fam = _families(b.render(ready=True))
    assert not [s for s in fam["localmoe_requests"].samples if s.name.endswith("_total")]
