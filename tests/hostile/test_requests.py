"""Malformed and hostile requests against a live server (issue 18): never a 5xx, never a hang,
and the server answers the next request."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.test_server import LiveServer  # noqa: F401 - also registers "scripted-test"

DEEP = "[" * 100000 + "]" * 100000
U = {"role": "user", "content": "hi"}


def _bodies() -> list[tuple[str, bytes | dict]]:
    b: list[tuple[str, bytes | dict]] = [
        ("empty", b""), ("not_json", b"{nope"), ("array", b"[]"), ("string", b'"x"'),
        ("deep_json", ('{"messages": ' + DEEP + '}').encode()),
        ("nan_temp", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
        ("inf_top_p", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}'),
        ("bad_utf8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        ("lone_surrogate", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
        ("nul", b'{"messages": [{"role": "user", "content": "a\\u0000b"}]}'),
    ]
    for name, extra in [
        ("no_messages", {}), ("messages_null", {"messages": None}), ("messages_str", {"messages": "hi"}),
        ("messages_empty", {"messages": []}), ("message_int", {"messages": [7]}),
        ("no_role", {"messages": [{"content": "hi"}]}), ("bad_role", {"messages": [{"role": "pirate", "content": "hi"}]}),
        ("content_int", {"messages": [{"role": "user", "content": 5}]}),
        ("content_parts_bad", {"messages": [{"role": "user", "content": [{"type": "image_url"}, 3]}]}),
        ("content_deep", {"messages": [{"role": "user", "content": [[[[["x"]]]]]}]}),
        ("huge_max_tokens", {"messages": [U], "max_tokens": 10**30}),
        ("neg_max_tokens", {"messages": [U], "max_tokens": -1}),
        ("temp_str", {"messages": [U], "temperature": "hot"}),
        ("temp_huge", {"messages": [U], "temperature": 1e308}),
        ("seed_huge", {"messages": [U], "seed": 2**200}),
        ("n_many", {"messages": [U], "n": 10**6}),
        ("stop_many", {"messages": [U], "stop": ["x"] * 100000}),
        ("stop_int", {"messages": [U], "stop": 5}),
        ("logit_bias_bad", {"messages": [U], "logit_bias": {"abc": 1e400 if False else 1e30, "-5": 1}}),
        ("logprobs_huge", {"messages": [U], "logprobs": True, "top_logprobs": 10**9}),
        ("tools_str", {"messages": [U], "tools": "x"}),
        ("tools_no_fn", {"messages": [U], "tools": [{"type": "function"}]}),
        ("tool_choice_bad", {"messages": [U], "tool_choice": {"type": "function", "function": {"name": "zz"}}}),
        ("tools_deep_schema", {"messages": [U], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": json.loads('{"type": "object", "properties": {"a": ' * 200 + '{}' + '}}' * 200)}}]}),
        ("response_format_bad", {"messages": [U], "response_format": {"type": "json_schema", "json_schema": 5}}),
        ("schema_deep", {"messages": [U], "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": json.loads('{"type": "array", "items": ' * 300 + '{}' + '}' * 300)}}}),
        ("tool_msg_orphan", {"messages": [U, {"role": "tool", "content": "x", "tool_call_id": "nope"}]}),
        ("assistant_tool_calls_bad", {"messages": [U, {"role": "assistant", "tool_calls": [{"function": 5}]}]}),
        ("stream_str", {"messages": [U], "stream": "yes"}),
        ("model_unknown", {"messages": [U], "model": "nope"}),
        ("huge_content", {"messages": [{"role": "user", "content": "x" * (6 << 20)}]}),
    ]:
        b.append((name, {"model": "scripted", **extra}))
    return b


BODIES = _bodies()


@pytest.fixture(scope="module")
def server(smollm2_path):
    from localmoe.api import LLM
    from localmoe.serve.server import create_app

    llm = LLM(smollm2_path, backend="scripted-test", n_ctx=512)
    srv = LiveServer(create_app(llm, model_name="scripted"))
    yield srv
    srv.stop()
    llm.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_requests_never_5xx(server, path):
    bad = []
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for name, body in BODIES:
            if path == "/v1/completions" and isinstance(body, dict):
                body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": body.get("messages")}
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            if r.status_code >= 500:
                bad.append((name, r.status_code, r.text[:200]))
            else:
                r.json()  # always a JSON body
        assert not bad, bad
        ok = c.post("/v1/chat/completions", json={"model": "scripted", "messages": [U]})
        assert ok.status_code == 200
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_deeply_nested_json_is_a_clean_400(server, path):
    """A body nested deeper than the JSON parser recurses was answered with Python's own
    words ("maximum recursion depth exceeded ..."); it is a 400 saying the JSON is nested too
    deeply, and so are deeply nested tool-call arguments (a string parsed later: a 500)."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for raw in (DEEP.encode(), ('{"messages": ' + DEEP + '}').encode()):
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            err = r.json()["error"]
            assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
            assert err["message"].startswith("request body JSON is nested too deeply (arrays/"
                                             "objects nest at most about "), err
            assert "recursion" not in err["message"]
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
        r = c.post("/v1/chat/completions", json={"model": "scripted", "messages": [
            U, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
        assert err["message"] == "messages[1].tool_calls[0].function.arguments is nested too deeply"
        assert err["param"] == "messages[1].tool_calls[0].function.arguments"
        assert c.post("/v1/chat/completions", json={"model": "scripted", "messages": [U]}
                      ).status_code == 200
