"""Hostile model output and requests against the server (issue 18 items 7, 8): no 5xx, no
broken JSON or SSE, the server answers the next request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import localmoe.text.chat_template as ct
from localmoe.serve.streaming import json_bytes, sse
from localmoe.text.tool_calls import MAX_JSON_DEPTH, StreamingToolParser, parse_tool_calls
from tests.serve.test_server import LiveServer, TemplateLLM

NAMES = ["f"]
DEEP = "[" * 1000 + "]" * 1000


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + DEEP + '}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": ' + DEEP.replace('"', '') + '}"}</tool_call>'),
    ("llama3", '{"name": "f", "parameters": {"a": ' + DEEP + '}}'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": ' + DEEP + '}}]'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ' + DEEP + '}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": -Infinity}}</tool_call>'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": Infinity}'),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]'),
    ("mistral", '[TOOL_CALLS]rm_rf[ARGS]{}'),
])
def test_hostile_calls_stay_content(fmt, text):
    r = parse_tool_calls(text, fmt, NAMES)
    assert r.tool_calls == [] and r.content == text
    # streamed in small pieces: the same
    p = StreamingToolParser(fmt, NAMES)
    ev = [e for i in range(0, len(text), 7) for e in p.push(text[i:i + 7])] + p.finish()
    assert all(k == "content" for k, _ in ev) and "".join(v for _, v in ev) == text


def test_depth_limit_is_exact():
    ok = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2) + '}}</tool_call>'
    bad = ok.replace('{"a": [', '{"a": [[', 1).replace(']}}', ']]}}', 1)
    assert len(parse_tool_calls(ok, "hermes", NAMES).tool_calls) == 1
    assert parse_tool_calls(bad, "hermes", NAMES).tool_calls == []


def test_lone_surrogate_in_arguments_stays_escaped_and_encodes():
    r = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": "x\\ud800y"}}</tool_call>', "hermes", NAMES)
    args = r.tool_calls[0].arguments
    args.encode("utf-8")  # would raise before
    assert json.loads(args) == {"a": "x\ud800y"}


def test_json_and_sse_encode_lone_surrogates():
    obj = {"content": "a\ud800b", "ok": "é"}
    for b in (json_bytes(obj), sse(obj)[6:-2]):
        assert json.loads(b) == obj
    assert "é".encode() in json_bytes({"ok": "é"})  # non-ASCII still raw UTF-8 when it can be


HANG = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def servers():
    from localmoe.serve.server import create_app

    out = {}
    for name, tpl, reply in [
        ("surrogate", PLAIN, 'ok\ud800 <tool_call>{"name": "f", "arguments": {"a": "\\udfff"}}</tool_call>'),
        ("deep", PLAIN, '<tool_call>{"name": "f", "arguments": {"a": ' + DEEP + '}}</tool_call>'),
        ("hang", HANG, "never"),
    ]:
        out[name] = LiveServer(create_app(TemplateLLM(tpl, reply), model_name="fake"))
    yield out
    for s in out.values():
        s.stop()


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _post(srv, stream=False, content="hi", timeout=30):
    body = {"model": "fake", "messages": [{"role": "user", "content": content}], "tools": TOOLS,
            "stream": stream}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=timeout)


@pytest.mark.parametrize("name", ["surrogate", "deep"])
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_output_is_answered_not_500(servers, name, stream):
    r = _post(servers[name], stream)
    assert r.status_code == 200, r.text
    if stream:
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            json.loads(e)
    else:
        msg = r.json()["choices"][0]["message"]
        if name == "deep":
            assert not msg.get("tool_calls") and msg["content"].startswith("<tool_call>")
        else:
            assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": "\udfff"}
    assert _post(servers[name]).status_code == 200  # and the next request is answered


def test_hanging_template_is_a_400_and_frees_the_slot(servers, monkeypatch):
    monkeypatch.setattr(ct.LIMITS, "seconds", 0.5)
    for _ in range(2):  # the second request gets the slot back
        r = _post(servers["hang"], timeout=20)
        assert r.status_code == 400 and "template time limit" in r.json()["error"]["message"]
    assert httpx.get(servers["hang"].url + "/health").status_code == 200


def test_request_with_lone_surrogate_gets_400_naming_the_message(servers):
    raw = '{"model": "fake", "messages": [{"role": "user", "content": "ab\\ud800"}]}'
    r = httpx.post(servers["surrogate"].url + "/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "messages[0].content" in r.json()["error"]["message"]


@pytest.mark.parametrize("fields,param", [
    ('"messages": [{"role": "user", "content": "ab\\ud800"}]', "messages[0].content"),
    ('"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": [{"type": '
     '"text", "text": "fine"}, {"type": "text", "text": "\\udfffx"}]}]',
     "messages[1].content[1].text"),
    ('"messages": [{"role": "user", "content": "hi", "name": "b\\udc80"}]', "messages[0].name"),
    # the PLAIN template knows no tools: the server rewrites tool calls and tools as text
    # (the template's check named "messages[1].content" and "messages[0].content")
    ('"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, '
     '"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '
     '"{\\"a\\": \\"\\\\ud800\\"}"}}]}, {"role": "tool", "tool_call_id": "c1", '
     '"content": "x"}]', "messages[1].tool_calls[0].function.arguments.a"),
    ('"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     '"function": {"name": "f", "description": "\\ud800"}}]', "tools[0].function.description")])
def test_lone_surrogate_400_names_the_exact_field(servers, fields, param):
    """A lone surrogate in a message got a 400 whose `param` was "messages": it names the
    field, as the other per-message errors do (a content part's text included, which the
    template sees joined), and the request is refused without the model (validate_request,
    which the server runs while the model loads)."""
    import localmoe.openai as openai_api
    from localmoe.errors import InvalidRequestError

    raw = '{"model": "fake", ' + fields + '}'
    r = httpx.post(servers["surrogate"].url + "/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(f"{param} is not valid UTF-8"), err
    with pytest.raises(InvalidRequestError) as ei:
        openai_api.validate_request("chat", json.loads(raw))
    assert ei.value.param == param


def test_disconnect_during_upload_is_not_a_500(servers):
    from localmoe.serve.errors import HTTPError
    from localmoe.serve.routes import _read_json

    class Req:
        headers = {"content-length": "100"}

        async def stream(self):
            from starlette.requests import ClientDisconnect

            yield b'{"mod'
            raise ClientDisconnect()

    with pytest.raises(HTTPError) as ei:
        asyncio.run(_read_json(Req(), 1000))
    assert ei.value.status == 499
