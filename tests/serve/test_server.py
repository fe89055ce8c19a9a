"""The OpenAI-compatible server, driven over real HTTP with the official ``openai`` client.

Most tests run the real engine (``localmoe.LLM``: SmolLM2's tokenizer and chat template,
sampler, stop checker, detokenizer) over a *scripted* backend registered here: its runner
decodes the prompt, asks a script for the reply text and returns logits that force exactly that
reply's tokens (then EOS). So a tool loop (call -> tool result -> final answer) is
deterministic whatever the sampling settings. One test at the end chats with the real model.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from localmoe.errors import ContextOverflowError  # noqa: E402
from localmoe.backends.registry import Backend, register_backend  # noqa: E402

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LONG_TEXT = " ".join(f"w{i}" for i in range(120))
SLOW_TEXT = " ".join(f"s{i}" for i in range(200))  # ~400 tokens at >= 50 ms: >= 20 s uncancelled


def script(prompt: str) -> tuple[str, float]:
    """The scripted model: reply text (and per-token delay in s) for a rendered prompt."""
    if prompt.endswith('"arguments": '):  # forced named call (no grammar engine)
        return '{"city": "Oslo"}}\n</tool_call>', 0.0
    if prompt.endswith('<tool_call>\n{"name": "'):  # forced "required" call (no grammar engine)
        return 'get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', 0.0
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "call oslo" in last_user:  # the grammar of a named / required call lets these through
        return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', 0.0
    if "call time" in last_user:
        return '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', 0.0
    if "call undeclared" in last_user:  # masked by the grammar under required / named
        return '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', 0.0
    m = re.search(r"<tool_response>\n(.*?)\n</tool_response>", last_user, re.S)
    if m:
        data = json.loads(m.group(1))
        return f"It is {data['temp_c']} C in {data['city']}.", 0.0
    if "weather" in last_user:
        return "Let me look that up.\n" + CALL_TEXT, 0.0
    if "slow" in last_user:
        return SLOW_TEXT, 0.05
    m = re.search(r"echo (\d+)", last_user)
    if m:
        return f"You said {m.group(1)}.", 0.002
    if "stop test" in last_user:
        return "alpha beta STOP gamma", 0.0
    if "long" in last_user:
        return LONG_TEXT, 0.0
    return "Hello! I am a scripted model.", 0.0


class ScriptedRunner:
    """A Runner (docs/INTERFACES.md) whose logits force the script's reply, then EOS."""

    backend_name = "scripted-test"

    def __init__(self, model_file, n_ctx, script_fn):
        from localmoe.text.tokenizer import Tokenizer

        self.spec = model_file.spec
        self.n_ctx = n_ctx
        self.kv_spec = None
        self.device = "cpu"
        self.max_seqs = 4
        self.tok = Tokenizer.from_model(model_file)
        self.vocab = self.tok.vocab_size
        self.script = script_fn
        self.seqs: dict[int, list[int]] = {}
        self.plans: dict[int, tuple[list[int], list[int], float]] = {}
        self._next = 0
        self.forward_calls = 0

    def new_sequence(self) -> int:
        self._next += 1
        self.seqs[self._next] = []
        return self._next

    def free_sequence(self, sid) -> None:
        self.seqs.pop(sid, None)
        self.plans.pop(sid, None)

    def seq_len(self, sid) -> int:
        return len(self.seqs[sid])

    def truncate(self, sid, n) -> None:
        self.seqs[sid] = self.seqs[sid][:n]

    def _plan(self, sid, hist):
        plan = self.plans.get(sid)
        if plan is not None:
            prompt, reply, _ = plan
            n = len(prompt)
            if hist[:n] == prompt and hist[n:] == reply[:len(hist) - n]:
                return plan
        text, delay = self.script(self.tok.decode(hist))
        reply = self.tok.encode(text, add_special=False) + [self.tok.eos_id]
        plan = (list(hist), reply, delay)
        self.plans[sid] = plan
        return plan

    def forward(self, batch, all_logits=False):
        out = []
        for sid, toks in batch:
            if len(self.seqs[sid]) + len(toks) > self.n_ctx:
                raise ContextOverflowError(len(self.seqs[sid]) + len(toks), self.n_ctx)
            self.seqs[sid].extend(toks)
            hist = self.seqs[sid]
            prompt, reply, delay = self._plan(sid, hist)
            k = len(hist) - len(prompt)
            nxt = reply[k] if k < len(reply) else self.tok.eos_id
            logits = torch.zeros(self.vocab)
            logits[nxt] = 100.0
            if delay:
                time.sleep(delay)
            out.append(logits)
        self.forward_calls += 1
        return out

    def stats(self) -> dict:
        return {"device": "cpu", "kv_bytes": 0}

    def close(self) -> None:
        pass


@register_backend("scripted-test")
class ScriptedBackend(Backend):
    description = "test backend forcing scripted replies"

    def load(self, model, *, n_ctx=None, kv_spec=None, device=None, **options):
        return ScriptedRunner(model, n_ctx or 512, options.get("script", script))


# ------------------------------------------------------------------------------ fixtures

class LiveServer:
    """uvicorn serving an app on 127.0.0.1:<random port> in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)

    def wait_loaded(self, seconds: float = 10.0) -> httpx.Response:
        """Poll /health until the model is no longer loading; the last answer."""
        deadline = time.time() + seconds
        while (r := httpx.get(self.url + "/health")).json()["status"] == "loading":
            assert time.time() < deadline, "still loading"
            time.sleep(0.02)
        return r

    def client(self, key="none", **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                             timeout=60, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The scripted runner's per-token tensors are tiny; intra-op threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def scripted_llm(smollm2_path):
    from localmoe.api import LLM

    llm = LLM(smollm2_path, backend="scripted-test", n_ctx=512)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def live(scripted_llm):
    from localmoe.serve.server import create_app

    srv = LiveServer(create_app(scripted_llm, model_name="scripted"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def metric(url: str, name: str, default: float | None = None) -> float:
    """Sum of the /metrics samples called ``name`` (labels included in the name match)."""
    text = httpx.get(url + "/metrics").text
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found and default is not None:
        return default
    assert found, f"{name} missing from /metrics"
    return total


# --------------------------------------------------------------------------------- basics

def test_health_models_and_metrics(live, client):
    r = httpx.get(live.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == ["scripted"]
    assert client.models.retrieve("scripted").id == "scripted"
    text = httpx.get(live.url + "/metrics").text
    for name in ("localmoe_requests_total", "localmoe_prompt_tokens_total",
                 "localmoe_generation_tokens_total", "localmoe_time_to_first_token_seconds_bucket",
                 "localmoe_time_per_output_token_seconds_count", "localmoe_queue_depth",
                 "localmoe_model_ready 1"):
        assert name in text


def test_head_answers_like_get_without_a_body(live, scripted_llm):
    """Load balancers and ``curl -I`` check health with HEAD: /health and /v1/models answer it
    with GET's status and headers and no body (405 before)."""
    from localmoe.serve.server import create_app

    for path in ("/health", "/v1/models", "/v1/models/scripted"):
        got, head = httpx.get(live.url + path), httpx.head(live.url + path)
        assert head.status_code == got.status_code == 200, (path, head.status_code)
        assert head.content == b""
        assert head.headers["content-type"] == got.headers["content-type"] == "application/json"
        assert head.headers["content-length"] == got.headers["content-length"]
    assert httpx.head(live.url + "/v1/models/gpt-4o").status_code == 404
    with _loading_server() as (*_, srv):  # not ready: 503, for HEAD too
        r = httpx.head(srv.url + "/health")
        assert r.status_code == 503 and r.content == b""
    srv = LiveServer(create_app(scripted_llm, api_key="s3cret", model_name="scripted"))
    try:  # /health stays open; /v1/* wants the key
        assert httpx.head(srv.url + "/health").status_code == 200
        assert httpx.head(srv.url + "/v1/models").status_code == 401
        assert httpx.head(srv.url + "/v1/models",
                          headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        srv.stop()


def test_chat_non_stream_shape_and_usage(client, scripted_llm):
    r = client.chat.completions.create(model="scripted",
                                       messages=[{"role": "user", "content": "Hi there"}])
    assert r.object == "chat.completion"
    assert r.model == "scripted"
    ch = r.choices[0]
    assert ch.message.role == "assistant"
    assert ch.message.content == "Hello! I am a scripted model."
    assert ch.message.tool_calls is None
    assert ch.finish_reason == "stop"
    n_reply = len(scripted_llm.tokenizer.encode("Hello! I am a scripted model.", add_special=False))
    assert r.usage.completion_tokens == n_reply + 1  # + the EOS that ended it
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_non_stream_with_usage(client):
    msgs = [{"role": "user", "content": "say something long"}]
    full = client.chat.completions.create(model="scripted", messages=msgs)
    chunks = list(client.chat.completions.create(model="scripted", messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content == LONG_TEXT
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 10
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_max_tokens_seed_and_sampling_params(client):
    r = client.chat.completions.create(model="scripted", stop=["STOP"], temperature=1.5,
                                       top_p=0.9, seed=7, frequency_penalty=0.5,
                                       presence_penalty=0.5,
                                       extra_body={"top_k": 20, "min_p": 0.1, "repeat_penalty": 1.1},
                                       messages=[{"role": "user", "content": "stop test"}])
    assert r.choices[0].message.content == "alpha beta "
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="scripted", max_completion_tokens=5,
                                       messages=[{"role": "user", "content": "long"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(model="scripted", max_tokens=3,
                                       messages=[{"role": "user", "content": "long"}])
    assert r.usage.completion_tokens == 3


def test_completions_endpoint(client):
    r = client.completions.create(model="scripted", prompt="<|im_start|>user\necho 5<|im_end|>\n",
                                  max_tokens=20)
    assert r.object == "text_completion"
    assert r.choices[0].text == "You said 5."
    s = list(client.completions.create(model="scripted", prompt="echo 6", stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == "You said 6."


# ---------------------------------------------------------------------------------- tools

def _run_tool_loop(client, stream: bool):
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    if stream:
        chunks = list(client.chat.completions.create(model="scripted", messages=msgs,
                                                     tools=[WEATHER_TOOL, TIME_TOOL], stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls: dict[int, dict] = {}
        for c in chunks:
            for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        call_list = [calls[i] for i in sorted(calls)]
    else:
        r = client.chat.completions.create(model="scripted", messages=msgs,
                                           tools=[WEATHER_TOOL, TIME_TOOL])
        content = r.choices[0].message.content
        call_list = [{"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
                     for tc in r.choices[0].message.tool_calls]
        finish = [r.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    assert content == "Let me look that up."
    assert [(c["name"], json.loads(c["arguments"])) for c in call_list] == [
        ("get_weather", {"city": "Paris"})]
    assert call_list[0]["id"].startswith("call_")
    # the tool result goes back through the chat template; the model answers from it
    msgs.append({"role": "assistant", "content": content, "tool_calls": [
        {"id": call_list[0]["id"], "type": "function",
         "function": {"name": call_list[0]["name"], "arguments": call_list[0]["arguments"]}}]})
    msgs.append({"role": "tool", "tool_call_id": call_list[0]["id"],
                 "content": json.dumps({"city": "Paris", "temp_c": 21})})
    r2 = client.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL])
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "It is 21 C in Paris."
    assert r2.choices[0].message.tool_calls is None
    return content, call_list


def test_tool_loop_non_stream_and_stream_identical(client):
    c1, calls1 = _run_tool_loop(client, stream=False)
    c2, calls2 = _run_tool_loop(client, stream=True)
    assert c1 == c2
    assert [(c["name"], c["arguments"]) for c in calls1] == [(c["name"], c["arguments"]) for c in calls2]


def test_forced_tool_call_never_leaks_markup_into_content(live, client):
    """Under required / named, the scripted model's undeclared tool is masked away: never
    called, never in content (its reply, fought by the grammar, is cut by max_tokens, and the
    constrained text generated is the content)."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    bad = [{"role": "user", "content": "hi, call undeclared"}]
    r = client.chat.completions.create(model="scripted", messages=bad, tools=tools,
                                       tool_choice="required", max_tokens=40)
    c = r.choices[0]
    assert "rm_rf" not in (c.message.content or "")
    assert all(t.function.name in ("get_weather", "get_time") for t in c.message.tool_calls or [])
    assert c.finish_reason == ("tool_calls" if c.message.tool_calls else "length")


@pytest.mark.parametrize("grammar", [True, False], ids=["grammar", "forced-prefix"])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_call_cut_by_max_tokens_returns_the_text_as_content(live, monkeypatch,
                                                                        grammar, choice):
    """A required / named call cut by max_tokens answered neither content nor tool_calls;
    like OpenAI/vLLM for a cut reply, what was generated is the content, finish "length"
    (the error object still says to raise max_tokens), streamed or not."""
    from localmoe.text import grammar as g

    if not grammar:  # the fallback without the grammar engine: the turn starts with the call
        monkeypatch.setattr(g, "available", lambda: "no grammar engine (test)")
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi, call time"}],
            "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": choice,
            "max_tokens": 12 if grammar else 3}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "length" and "tool_calls" not in c["message"]
    text = c["message"]["content"]  # the forced opening of the fallback included
    assert text.startswith('<tool_call>\n{"name": "get_'), text
    assert r["usage"]["completion_tokens"] == body["max_tokens"]
    assert r["error"]["code"] == "tool_call_incomplete" and "max_tokens" in r["error"]["message"]
    lines = [json.loads(line[6:]) for line in httpx.post(
        live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ).text.splitlines() if line.startswith("data: {")]
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in lines) == text
    assert not any(ch["choices"][0]["delta"].get("tool_calls") for ch in lines)
    assert lines[-1]["choices"][0]["finish_reason"] == "length"
    assert lines[-1]["error"]["code"] == "tool_call_incomplete"
    full = httpx.post(live.url + "/v1/chat/completions", json={**body, "max_tokens": 200},
                      timeout=60).json()["choices"][0]  # not cut: a call, no content
    assert full["finish_reason"] == "tool_calls" and full["message"]["content"] is None
    assert full["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_tool_choice_none_required_named(client):
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = client.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL],
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None  # not parsed: stays text
    assert CALL_TEXT in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    hi = [{"role": "user", "content": "hi, call oslo"}]
    r = client.chat.completions.create(
        model="scripted", messages=hi, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tc = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in tc] == [
        ("get_weather", {"city": "Oslo"})]
    hi = [{"role": "user", "content": "hi, call time"}]
    r = client.chat.completions.create(model="scripted", messages=hi,
                                       tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    tc = r.choices[0].message.tool_calls
    assert [(t.function.name, json.loads(t.function.arguments)) for t in tc] == [
        ("get_time", {"tz": "UTC"})]
    chunks = list(client.chat.completions.create(model="scripted", messages=hi, stream=True,
                                                 tools=[WEATHER_TOOL, TIME_TOOL],
                                                 tool_choice="required"))
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_time"
    assert "".join(d.function.arguments or "" for d in deltas) == '{"tz": "UTC"}'


def test_python_api_chat_matches_server_shape(scripted_llm):
    r = scripted_llm.chat([{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER_TOOL])
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert r["choices"][0]["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    chunks = list(scripted_llm.chat([{"role": "user", "content": "hi"}], stream=True,
                                    max_tokens=50))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        "Hello! I am a scripted model."


def test_agent_loop_example_runs_against_server(live):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "agent_loop.py"
    spec = importlib.util.spec_from_file_location("agent_loop", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    transcript = mod.run_agent("What's the weather in Paris?", base_url=live.url + "/v1",
                               api_key="none", model="scripted",
                               tool_impls={"get_weather": lambda city: {"city": city, "temp_c": 18}})
    assert transcript[-1]["role"] == "assistant"
    assert transcript[-1]["content"] == "It is 18 C in Paris."
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "assistant"]


# --------------------------------------------------------------------------------- errors

def _err(r: httpx.Response, status: int, param=None):
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) >= {"message", "type", "param", "code"}
    if param is not None:
        assert body["param"] == param, body
    return body


def test_error_status_codes_and_objects(live, client):
    url = live.url + "/v1/chat/completions"
    ok = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    _err(httpx.post(url, content=b"{not json"), 400)
    _err(httpx.post(url, json=[1, 2]), 400)
    _err(httpx.post(url, json={**ok, "n": 2}), 400, "n")
    _err(httpx.post(url, json={**ok, "temperature": "hot"}), 400, "temperature")
    _err(httpx.post(url, json={**ok, "temperature": 500}), 400, "temperature")
    _err(httpx.post(url, json={**ok, "max_tokens": 0}), 400, "max_tokens")
    _err(httpx.post(url, json={**ok, "messages": []}), 400, "messages")
    _err(httpx.post(url, json={**ok, "messages": [{"role": "wizard", "content": "x"}]}), 400,
         "messages[0].role")
    # OpenAI requires tool_call_id on a tool message
    body = _err(httpx.post(url, json={**ok, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"}]}), 400, "messages[2].tool_call_id")
    assert body["type"] == "invalid_request_error" and "tool_call_id" in body["message"]
    _err(httpx.post(url, json={**ok, "tools": [{"type": "function", "function": {"name": "a b"}}]}),
         400, "tools[0].function.name")
    # an unknown schema type is refused whatever the tool choice (it passed under "auto")
    body = _err(httpx.post(url, json={**ok, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "foo"}}}]}), 400, "tools[0].function.parameters")
    assert 'unknown type "foo"' in body["message"]
    _err(httpx.post(url, json={**ok, "tools": [WEATHER_TOOL],
                               "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
         400, "tool_choice")
    _err(httpx.post(url, json={**ok, "stream_options": {"include_usage": True}}), 400,
         "stream_options")
    body = _err(httpx.post(url, json={**ok, "logit_bias": {"999999": 5}}), 400, "logit_bias")
    top = int(re.search(r"\(0\.\.(\d+)\)", body["message"]).group(1))   # the last valid id
    assert 0 < top < 999999
    ok_bias = httpx.post(url, json={**ok, "max_tokens": 1, "logit_bias": {str(top): 1}})
    assert ok_bias.status_code == 200, ok_bias.text
    _err(httpx.post(url, json={**ok, "logit_bias": {str(top + 1): 1}}), 400, "logit_bias")
    body = _err(httpx.post(url, json={**ok, "model": "gpt-4o"}), 404, "model")
    assert body["code"] == "model_not_found"
    _err(httpx.post(live.url + "/v1/nope", json=ok), 404)
    _err(httpx.get(url), 405)
    big = {"model": "scripted", "messages": [{"role": "user", "content": "x" * (9 * 1024 * 1024)}]}
    _err(httpx.post(url, json=big), 413)
    # prompt over the context (n_ctx 512): 400 with both counts, for stream and non-stream
    long_msg = {"model": "scripted", "messages": [{"role": "user", "content": "word " * 800}]}
    for stream in (False, True):
        body = _err(httpx.post(url, json={**long_msg, "stream": stream}), 400, "messages")
        assert body["code"] == "context_length_exceeded"
        nums = [int(x) for x in re.findall(r"\d+", body["message"])]
        assert 512 in nums and any(n > 512 for n in nums), body["message"]
        # the client's way out, not the CLI's or the Python API's
        assert "localmoe serve -c" in body["message"] and "n_ctx" not in body["message"]
    # /v1/completions blames its own field
    body = _err(httpx.post(live.url + "/v1/completions",
                           json={"model": "scripted", "prompt": "word " * 800}), 400, "prompt")
    assert body["code"] == "context_length_exceeded"
    # the openai client surfaces these as typed errors
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="scripted", n=3,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # and the server still works
    assert client.chat.completions.create(**ok).choices[0].message.content
    assert metric(live.url, 'localmoe_requests_total{endpoint="/v1/chat/completions",status="400"}') >= 10
    assert 'status="500"' not in httpx.get(live.url + "/metrics").text  # no user error is a 500


def test_a_body_sent_as_another_type_than_json_is_a_415(live, client):
    """A JSON body sent as text/plain, or as the form encoding `curl -d` sends without
    `-H 'Content-Type: application/json'`, was read as JSON and answered: it is a 415 in
    OpenAI's error shape naming the type expected and the curl fix. JSON types (a charset, a
    `+json` type) and a request without a Content-Type are still read as JSON."""
    url = live.url + "/v1/chat/completions"
    body = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "echo 4"}],
                       "max_tokens": 8}).encode()
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
               "text/json", "application/jsonx"):
        for u in (url, live.url + "/v1/completions"):
            err = _err(httpx.post(u, content=body, headers={"Content-Type": ct}), 415)
            assert err["code"] == "unsupported_media_type", err
            assert err["type"] == "invalid_request_error", err
            assert "application/json" in err["message"] and repr(ct) in err["message"], err
            assert "-H 'Content-Type: application/json'" in err["message"], err
    assert 'endpoint="/v1/chat/completions",status="415"' in httpx.get(live.url + "/metrics").text
    for ct in ("application/json", "application/json; charset=utf-8", "Application/JSON",
               "application/vnd.api+json", None):
        r = httpx.post(url, content=body, headers={"Content-Type": ct} if ct else {})
        assert r.status_code == 200, (ct, r.text)
        assert r.json()["choices"][0]["message"]["content"] == "You said 4.", (ct, r.text)
    # the openai client sends application/json
    r = client.chat.completions.create(model="scripted",
                                       messages=[{"role": "user", "content": "echo 5"}])
    assert r.choices[0].message.content == "You said 5."


def test_tool_message_must_answer_an_earlier_tool_call(live):
    """A tool message whose tool_call_id matches no tool call of an earlier assistant message
    was accepted (and rendered as an answer to nothing); it is a 400 naming the id, the known
    ids and the parameter, as OpenAI answers it."""
    url = live.url + "/v1/chat/completions"
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}
    head = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]}]
    body = _err(httpx.post(url, json={"model": "scripted", "messages": [
        *head, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]}),
        400, "messages[2].tool_call_id")
    assert body["type"] == "invalid_request_error"
    assert '"call_9"' in body["message"] and '"call_1"' in body["message"], body
    body = _err(httpx.post(url, json={"model": "scripted", "messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_1",
                                            "content": "sunny"}]}), 400, "messages[1].tool_call_id")
    assert "no assistant message before it has tool_calls" in body["message"], body
    # a tool result before the call it answers is as wrong
    _err(httpx.post(url, json={"model": "scripted", "messages": [
        head[0], {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, head[1]]}),
        400, "messages[1].tool_call_id")
    result = '{"city": "Paris", "temp_c": 21}'
    r = httpx.post(url, json={"model": "scripted", "messages": [
        *head, {"role": "tool", "tool_call_id": "call_1", "content": result}]})
    assert r.status_code == 200 and "21 C" in r.text, r.text
    # a client that sent its calls without ids can still answer them
    anon = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    r = httpx.post(url, json={"model": "scripted", "messages": [
        head[0], {"role": "assistant", "content": None, "tool_calls": [anon]},
        {"role": "tool", "tool_call_id": "x", "content": result}]})
    assert r.status_code == 200 and "21 C" in r.text, r.text


def test_missing_or_null_messages_say_messages_is_required(live):
    """A chat request without messages, or with "messages": null, was answered "messages must
    be a list ..., got null" (a missing field read as a null the client never sent); it says
    that messages is required, as a 400 invalid_request_error naming the parameter."""
    url = live.url + "/v1/chat/completions"
    for body in ({"model": "scripted"}, {"model": "scripted", "messages": None}):
        err = _err(httpx.post(url, json=body), 400, "messages")
        assert err["type"] == "invalid_request_error"
        assert err["message"].startswith("messages is required: a non-empty list of"), err
        assert "null" not in err["message"]
    err = _err(httpx.post(url, json={"model": "scripted", "messages": "hi"}), 400, "messages")
    assert err["message"].endswith("objects, got a string"), err


def test_max_tokens_beyond_the_context_is_a_400_not_a_cut(live, scripted_llm):
    """A max_tokens (or max_completion_tokens) that does not fit in the context beside the
    prompt was silently capped (a non-streamed request could run for minutes); it is a 400
    context_length_exceeded with vLLM's counts, on both endpoints, streamed or not, whose
    ``param`` names the field that does not fit (the max_tokens field the client sent, as
    OpenAI does; the prompt's field only when the prompt alone is over). One that just fits,
    or none, still generates."""
    chat, comp = live.url + "/v1/chat/completions", live.url + "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    n_chat = httpx.post(chat, json={"model": "scripted", "messages": msgs, "max_tokens": 1}
                        ).json()["usage"]["prompt_tokens"]
    n_comp = httpx.post(comp, json={"model": "scripted", "prompt": "hi", "max_tokens": 1}
                        ).json()["usage"]["prompt_tokens"]
    for url, base, n, param in ((chat, {"messages": msgs}, n_chat, "messages"),
                                (comp, {"prompt": "hi"}, n_comp, "prompt")):
        for field in ("max_tokens", "max_completion_tokens"):
            for stream in (False, True):
                body = {"model": "scripted", **base, "stream": stream, field: 513 - n}
                err = _err(httpx.post(url, json=body), 400, field)
                assert err["code"] == "context_length_exceeded", err
                assert err["type"] == "invalid_request_error"
                assert err["message"].startswith(
                    f"this model's maximum context length is 512 tokens, but 513 tokens were "
                    f"requested ({n} in the {param}, {513 - n} in the completion); lower "
                    f"max_tokens"), err["message"]
        # both given: max_completion_tokens is the one used, so the one blamed
        body = {"model": "scripted", **base, "max_tokens": 1, "max_completion_tokens": 513 - n}
        _err(httpx.post(url, json=body), 400, "max_completion_tokens")
        # a prompt over the context on its own is the prompt's fault, whatever max_tokens says
        long = ({"messages": [{"role": "user", "content": "word " * 800}]} if param == "messages"
                else {"prompt": "word " * 800})
        err = _err(httpx.post(url, json={"model": "scripted", **long, "max_tokens": 8}), 400, param)
        assert err["code"] == "context_length_exceeded"
        # exactly the room left is fine; so is no max_tokens at all
        r = httpx.post(url, json={"model": "scripted", **base, "max_tokens": 512 - n})
        assert r.status_code == 200, r.text
        r = httpx.post(url, json={"model": "scripted", **base})
        assert r.status_code == 200, r.text
    # the openai client sees a BadRequestError; the Python API's chat() refuses it too,
    # while LLM.generate keeps llama.cpp's behaviour unless asked
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        live.client().chat.completions.create(model="scripted", messages=msgs, max_tokens=4096)
    with pytest.raises(ContextOverflowError, match="lower max_tokens") as ei:
        scripted_llm.chat(msgs, max_tokens=4096)
    assert (ei.value.n_prompt, ei.value.n_completion, ei.value.n_ctx) == (n_chat, 4096, 512)
    assert scripted_llm.generate("hi", max_tokens=4096).finish_reason == "stop"
    with pytest.raises(ContextOverflowError):
        scripted_llm.generate("hi", max_tokens=4096, fit_max_tokens=True)


def test_api_key_required_when_set(scripted_llm):
    from localmoe.serve.server import create_app

    srv = LiveServer(create_app(scripted_llm, api_key="s3cret", model_name="scripted"))
    try:
        msgs = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError):
            srv.client("wrong").chat.completions.create(model="scripted", messages=msgs)
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert srv.client("s3cret").chat.completions.create(model="scripted", messages=msgs)
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def test_full_queue_answers_429(scripted_llm):
    from localmoe.serve.server import create_app

    srv = LiveServer(create_app(scripted_llm, model_name="scripted", max_queue=0))
    hi = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    try:
        assert httpx.post(srv.url + "/v1/chat/completions", json=hi).status_code == 200  # idle
        slow = {"model": "scripted", "stream": True,
                "messages": [{"role": "user", "content": "slow please"}]}
        with httpx.Client(timeout=30) as hc, \
                hc.stream("POST", srv.url + "/v1/chat/completions", json=slow) as busy:
            assert busy.status_code == 200
            lines = busy.iter_lines()
            next(lines)  # it is generating now; nothing may wait (max_queue=0)
            r = httpx.post(srv.url + "/v1/chat/completions", json=hi)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        _err(httpx.post(srv.url + "/v1/chat/completions", content=b"[" * 100000), 400)
    finally:
        srv.stop()


def test_metrics_count_tokens_and_latencies(live, client):
    gen0 = metric(live.url, "localmoe_generation_tokens_total")
    ttft0 = metric(live.url, "localmoe_time_to_first_token_seconds_count")
    tpot0 = metric(live.url, "localmoe_time_per_output_token_seconds_count")
    ok0 = metric(live.url, 'localmoe_requests_total{endpoint="/v1/chat/completions",status="200"}', 0)
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    assert metric(live.url, "localmoe_generation_tokens_total") == gen0 + r.usage.completion_tokens
    assert metric(live.url, "localmoe_time_to_first_token_seconds_count") == ttft0 + 1
    assert metric(live.url, "localmoe_time_per_output_token_seconds_count") == tpot0 + 1
    assert metric(live.url, 'localmoe_requests_total{endpoint="/v1/chat/completions",status="200"}') == ok0 + 1
    assert metric(live.url, "localmoe_queue_depth") == 0


def test_health_reports_loading_then_ready(scripted_llm):
    from localmoe.serve.server import create_app

    gate = threading.Event()

    def factory():
        gate.wait(20)
        return scripted_llm

    srv = LiveServer(create_app(factory, model_name="scripted", close_on_shutdown=False))
    try:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        gate.set()
        deadline = time.time() + 10
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
        assert srv.client().chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content
    finally:
        srv.stop()


@contextlib.contextmanager
def _loading_server():
    """A server whose model never finishes loading (validation needs none): ``(chat URL,
    completions URL, a valid chat body)``."""
    from localmoe.serve.server import create_app

    gate = threading.Event()

    def factory():
        gate.wait(30)
        raise RuntimeError("never loads in this test")

    srv = LiveServer(create_app(factory, model_name="scripted"))
    try:
        yield (srv.url + "/v1/chat/completions", srv.url + "/v1/completions",
               {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}, srv)
    finally:
        gate.set()
        srv.stop()


def test_invalid_requests_get_400_404_while_the_model_loads():
    """Validation needs no model: while loading, a bad request gets its OpenAI-style 400/404 at
    once; only a valid request gets the 503 "model loading"."""
    with _loading_server() as (chat, comp, ok, srv):
        assert httpx.get(srv.url + "/health").json()["status"] == "loading"
        _err(httpx.post(chat, content=b"{not json"), 400)
        _err(httpx.post(chat, json={"model": "scripted"}), 400, "messages")
        _err(httpx.post(chat, json={**ok, "max_tokens": -5}), 400, "max_tokens")
        _err(httpx.post(chat, json={**ok, "temperature": 500}), 400, "temperature")
        _err(httpx.post(chat, json={**ok, "tool_choice": "required"}), 400, "tool_choice")
        body = _err(httpx.post(chat, json={**ok, "model": "gpt-4o"}), 404, "model")
        assert body["code"] == "model_not_found"
        _err(httpx.post(comp, json={"model": "scripted"}), 400, "prompt")
        _err(httpx.post(comp, json={"prompt": "hi", "max_tokens": 0}), 400, "max_tokens")
        for url, good in ((chat, ok), (comp, {"model": "scripted", "prompt": "hi"}),
                          (chat, {**ok, "logit_bias": {"5": 1}})):  # ids checked once loaded
            r = httpx.post(url, json=good)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
        text = httpx.get(srv.url + "/metrics").text
        assert 'endpoint="/v1/chat/completions",status="400"' in text


def test_user_message_name_and_seed_of_the_wrong_type_or_range_are_400s():
    """`"user": 5`, a numeric message `name` and a seed beyond 64 bits were accepted (OpenAI's
    user and name are strings; a seed over 2**64-1 shared its 64 bits, so its random stream on
    the device sampler, with a smaller one): each is a 400 naming the field, on both
    endpoints. The edges of the seed's range and string values still pass validation."""
    with _loading_server() as (chat, comp, ok, _):
        for bad, param in (({"user": 5}, "user"), ({"user": ["a"]}, "user"),
                           ({"seed": 2**64}, "seed"), ({"seed": -2**63 - 1}, "seed"),
                           ({"seed": 10**30}, "seed")):
            body = _err(httpx.post(chat, json={**ok, **bad}), 400, param)
            assert body["type"] == "invalid_request_error" and param in body["message"], body
            _err(httpx.post(comp, json={"model": "scripted", "prompt": "hi", **bad}), 400, param)
        for name in (7, {"n": 1}, True):
            body = _err(httpx.post(chat, json={**ok, "messages": [
                {"role": "user", "content": "hi", "name": name}]}), 400, "messages[0].name")
            assert "messages[0].name must be a string" in body["message"], body
        for good in ({"user": "u-1"}, {"user": None}, {"seed": 2**64 - 1}, {"seed": -2**63},
                     {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}):
            r = httpx.post(chat, json={**ok, **good})  # valid: only the model is missing
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text


def test_booleans_in_integer_fields_are_400s_that_show_the_json_value():
    """`"max_tokens": true` was answered "max_tokens must be a positive integer, got True"
    (Python's repr); `"n": true` passed as 1 would have said "n must be 1", `"best_of": true`
    was accepted (True == 1) and `"max_tokens": false` with echo and logprobs scored the prompt
    as if it were 0. Each is a 400 naming the field, saying it must be an integer and showing
    the value as the client sent it (`true`)."""
    with _loading_server() as (chat, comp, ok, _):
        prompt = {"model": "scripted", "prompt": "hi"}
        cases = [(chat, ok, "max_tokens"), (chat, ok, "max_completion_tokens"), (chat, ok, "n"),
                 (chat, ok, "seed"), (chat, ok, "top_k"), (chat, ok, "repeat_last_n"),
                 (chat, {**ok, "logprobs": True}, "top_logprobs"),
                 (comp, prompt, "max_tokens"), (comp, prompt, "n"), (comp, prompt, "seed"),
                 (comp, prompt, "logprobs"), (comp, prompt, "best_of")]
        for url, base, field in cases:
            for value, shown in ((True, "true"), (False, "false")):
                if (url, field, value) == (comp, "logprobs", False):
                    continue  # completions' logprobs: false is off, as null
                body = _err(httpx.post(url, json={**base, field: value}), 400, field)
                msg = body["message"]
                assert msg.startswith(field) and "integer" in msg, (field, msg)
                assert msg.endswith(f"got {shown}") and "True" not in msg, (field, msg)
        body = _err(httpx.post(chat, json={**ok, "temperature": True}), 400, "temperature")
        assert body["message"] == "temperature must be a number, got true", body
        _err(httpx.post(comp, json={**prompt, "max_tokens": False, "echo": True, "logprobs": 1}),
             400, "max_tokens")
        # the integers themselves still pass validation (only the model is missing)
        for url, good in ((chat, {**ok, "max_tokens": 5, "n": 1, "seed": 0, "top_k": 3}),
                          (comp, {**prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
                                  "best_of": 1})):
            r = httpx.post(url, json=good)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text


_CALL_1 = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_F = {"type": "function", "function": {"name": "f"}}
_SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}}


def _rf_schema(schema):
    return {"response_format": {**_SCHEMA, "json_schema": {"name": "s", "schema": schema}}}


def _role(role):
    return {"messages": [{"role": role, "content": "hi"}]}


# (endpoint, body fields over a valid one, status, param, the value as JSON, Python's spelling)
_CLIENT_VALUES = {
    "role-true": ("chat", _role(True), 400, "messages[0].role", "got true", "True"),
    "role-null": ("chat", _role(None), 400, "messages[0].role", "got null", "None"),
    "role-5": ("chat", _role(5), 400, "messages[0].role", "got 5", None),
    "role-robot": ("chat", _role("robot"), 400, "messages[0].role", 'got "robot"', "'robot'"),
    "role-cyrillic": ("chat", _role("робот"), 400, "messages[0].role", 'got "робот"',
                      "\\u0440"),
    "role-list": ("chat", _role(["user"]), 400, "messages[0].role", 'got ["user"]', "['user']"),
    "role-surrogate": ("chat", _role("a\ud800"), 400, "messages[0].role", 'got "a\\ud800"',
                       "'a\\ud800'"),
    "response_format.type-true": ("chat", {"response_format": {"type": True}}, 400,
                                  "response_format.type", "got true", "True"),
    "response_format.type-json": ("chat", {"response_format": {"type": "json"}}, 400,
                                  "response_format.type", 'got "json"', "'json'"),
    "completions-response_format.type": ("comp", {"response_format": {"type": False}}, 400,
                                         "response_format.type", "got false", "False"),
    "tool_choice-x": ("chat", {"tool_choice": "x"}, 400, "tool_choice", 'got "x"', "'x'"),
    "tool_choice-unknown-name": (
        "chat", {"tools": [_F], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400, "tool_choice", 'function "g" which', "'g'"),
    "tool_choice-null-name": (
        "chat", {"tools": [_F], "tool_choice": {"type": "function", "function": {"name": None}}},
        400, "tool_choice", "function null which", "None"),
    "content-part-type": ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]",
        'has type "image_url"', "'image_url'"),
    "content-part-string": ("chat", {"messages": [{"role": "user", "content": ["hi"]}]}, 400,
                            "messages[0].content[0]", "is a string", "'str'"),
    "duplicate-tool-name": ("chat", {"tools": [_F, _F]}, 400, "tools[1].function.name",
                            'duplicate tool name "f"', "'f'"),
    "tool_call_id": ("chat", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [_CALL_1]},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]}, 400,
        "messages[2].tool_call_id", 'tool_call_id "call_2" matches no tool call', "'call_"),
    "logit_bias-key": ("chat", {"logit_bias": {"abc": 1}}, 400, "logit_bias",
                       'logit_bias key "abc"', "'abc'"),
    "stop-surrogate": ("chat", {"stop": ["a\ud800"]}, 400, "stop", 'stop string "a\\ud800"',
                       "'a\\ud800'"),
    "tool-schema-type": ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "strin"}}}]}, 400, "tools[0].function.parameters",
        'unknown type "strin"', "'strin'"),
    "response-schema-type": ("chat", _rf_schema({"type": ["string", True]}), 400,
                             "response_format.json_schema.schema", "unknown type true", "True"),
    "response-schema-pattern": ("chat", _rf_schema({"type": "string", "pattern": "(("}), 400,
                                "response_format.json_schema.schema", 'in pattern "(("',
                                "'(('"),
    "user-array": ("chat", {"user": [1]}, 400, "user", "got an array", "got list"),
    "model": ("chat", {"model": "nope"}, 404, "model", 'model "nope" does not exist', "'nope'"),
    "completions-model": ("comp", {"model": "nope"}, 404, "model", 'model "nope" does not',
                          "'nope'"),
    "models-path": ("models", None, 404, "model", 'model "nope" does not exist', "'nope'"),
}


@pytest.fixture(scope="module")
def loading_server():
    with _loading_server() as urls:
        yield urls


@pytest.mark.parametrize("case", list(_CLIENT_VALUES))
def test_error_messages_show_client_values_as_json(loading_server, case):
    """A value the client sent is shown in a 400/404 message as the client wrote it in JSON
    (``true``, ``null``, ``"robot"``, ``["user"]``; printable non-ASCII as written, a lone
    surrogate as its escape), never as Python's repr (``True``, ``None``, ``'robot'``,
    ``['user']``); the error codes are unchanged. A role that is a list or object was a 500
    (an unhashable value tested against the set of roles)."""
    chat, comp, ok, srv = loading_server
    endpoint, fields, status, param, shown, python = _CLIENT_VALUES[case]
    if endpoint == "models":
        r = httpx.get(srv.url + "/v1/models/nope")
    else:
        base = ok if endpoint == "chat" else {"model": "scripted", "prompt": "hi"}
        # json.dumps escapes a lone surrogate ("\ud800"), as a client's JSON encoder does
        r = httpx.post(chat if endpoint == "chat" else comp,
                       content=json.dumps({**base, **fields}).encode(),
                       headers={"Content-Type": "application/json"})
    body = _err(r, status, param)
    assert body["code"] == ("invalid_value" if status == 400 else "model_not_found"), body
    assert shown in body["message"], (shown, body["message"])
    if python is not None:
        assert python not in body["message"], (python, body["message"])


def test_load_failure_is_reported_not_raised():
    from localmoe.errors import ModelLoadError
    from localmoe.serve.server import create_app

    def factory():
        raise ModelLoadError("file is truncated: re-download it")

    srv = LiveServer(create_app(factory, model_name="broken"))
    try:
        r = srv.wait_loaded(10)
        assert r.status_code == 503 and "truncated" in r.json()["error"]
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "truncated" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_a_chat_template_that_does_not_compile_serves_completions_and_refuses_chat(tmp_path,
                                                                                      caplog):
    """A GGUF whose chat template has a syntax error: /health reported the load as failed and
    every request got a 503 model_load_failed, /v1/completions too (it needs no template).
    Now the server is ready (the error logged once as a warning), /v1/completions answers and
    /v1/chat/completions gets the template failure's 400 naming the syntax error."""
    import logging

    from localmoe.serve.server import create_app, warm_up
    from localmoe.testing.synthetic import write_gguf

    bad = write_gguf(tmp_path / "bad.gguf", "tiny-llama",
                     chat_template="{% for m in messages %}{{ m.content }")

    def factory():  # as `localmoe serve` loads it
        from localmoe.api import LLM

        llm = LLM(bad, backend="torch", n_ctx=64)
        warm_up(llm)
        return llm

    with caplog.at_level(logging.WARNING):
        srv = LiveServer(create_app(factory, model_name="bad"))
        try:
            r = srv.wait_loaded(60)
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text
            r = httpx.post(srv.url + "/v1/completions",
                           json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
            for stream in (False, True):
                r = httpx.post(srv.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "stream": stream})
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["param"] == "messages"
                assert err["message"] == ("the chat template could not render these messages: "
                                          "the chat template has a syntax error at line 1: "
                                          "unexpected '}'"), err
        finally:
            srv.stop()
    said = [(r.levelname, r.getMessage()) for r in caplog.records
            if "syntax error" in r.getMessage()]
    assert len(said) == 1 and said[0][0] == "WARNING", said
    assert said[0][1].startswith("bad: the chat template has a syntax error at line 1"), said


# ----------------------------------------------------------------- concurrency, disconnect

def test_eight_concurrent_requests_all_complete_correctly(live):
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int):
        try:
            c = live.client()
            msgs = [{"role": "user", "content": f"echo {i}"}]
            if i % 2:
                s = c.chat.completions.create(model="scripted", messages=msgs, stream=True)
                results[i] = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
            else:
                results[i] = c.chat.completions.create(model="scripted",
                                                       messages=msgs).choices[0].message.content
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == {i: f"You said {i}." for i in range(8)}


CHAT_200 = 'localmoe_requests_total{endpoint="/v1/chat/completions",status="200"}'
CHAT_499 = 'localmoe_requests_total{endpoint="/v1/chat/completions",status="499"}'
CHAT_400 = 'localmoe_requests_total{endpoint="/v1/chat/completions",status="400"}'


def _counted_as_499(live, ok_before: float, gone_before: float) -> None:
    """The request the client closed is counted once, as 499 ("client closed request", as
    nginx logs it), not as a 200 (it was, though nobody received the answer)."""
    deadline = time.time() + 30
    while metric(live.url, CHAT_499, 0) < gone_before + 1:
        assert time.time() < deadline, "the closed request was not counted as 499"
        time.sleep(0.05)
    assert metric(live.url, CHAT_499, 0) == gone_before + 1
    assert metric(live.url, CHAT_200, 0) == ok_before


def test_client_disconnect_mid_stream_cancels_generation(live):
    before = metric(live.url, "localmoe_cancelled_generations_total")
    ok_before, gone_before = metric(live.url, CHAT_200, 0), metric(live.url, CHAT_499, 0)
    body = {"model": "scripted", "stream": True,
            "messages": [{"role": "user", "content": "slow please"}]}
    t0 = time.time()
    with httpx.Client(timeout=30) as hc:
        with hc.stream("POST", live.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    n += 1
                if n >= 5:
                    break
    # the whole reply would take >= 20 s; cancellation frees the model much sooner
    while metric(live.url, "localmoe_cancelled_generations_total") <= before:
        assert time.time() - t0 < 30, "generation was not cancelled"
        time.sleep(0.05)
    while metric(live.url, "localmoe_requests_running") != 0:
        assert time.time() - t0 < 30, "the cancelled request still holds the model"
        time.sleep(0.05)
    _counted_as_499(live, ok_before, gone_before)
    r = live.client().chat.completions.create(model="scripted",
                                              messages=[{"role": "user", "content": "echo 42"}])
    assert r.choices[0].message.content == "You said 42."
    # a stream read to its end is a 200
    chunks = list(live.client().chat.completions.create(
        model="scripted", stream=True, messages=[{"role": "user", "content": "echo 43"}]))
    assert chunks and metric(live.url, CHAT_200) == ok_before + 2
    assert metric(live.url, CHAT_499) == gone_before + 1


def test_client_disconnect_non_stream_cancels_generation(live):
    before = metric(live.url, "localmoe_cancelled_generations_total")
    ok_before, gone_before = metric(live.url, CHAT_200, 0), metric(live.url, CHAT_499, 0)
    body = {"model": "scripted", "messages": [{"role": "user", "content": "slow please"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.time() + 30
    while metric(live.url, "localmoe_cancelled_generations_total") <= before:
        assert time.time() < deadline, "generation was not cancelled"
        time.sleep(0.05)
    _counted_as_499(live, ok_before, gone_before)
    r = live.client().chat.completions.create(model="scripted",
                                              messages=[{"role": "user", "content": "echo 7"}])
    assert r.choices[0].message.content == "You said 7."


def test_clients_that_leave_while_queued_are_counted_499_and_cancelled(live, caplog):
    """Requests waiting behind a running generation whose clients disconnect leave the queue
    at once; each is counted once as 499 and logged, and its generation (never started) as
    cancelled: streams (whose answer had not begun) as well as JSON answers."""
    import logging

    caplog.set_level(logging.INFO, logger="localmoe.serve.server")
    url = live.url + "/v1/chat/completions"
    cancelled0 = metric(live.url, "localmoe_cancelled_generations_total")
    ok0, gone0 = metric(live.url, CHAT_200, 0), metric(live.url, CHAT_499, 0)
    bad0 = metric(live.url, CHAT_400, 0)
    left: list[BaseException] = []

    def queued(i: int, stream: bool):
        body = {"model": "scripted", "stream": stream,
                "messages": [{"role": "user", "content": f"echo {i}"}]}
        try:  # no answer starts within 1.5 s: the model is busy; then the client gives up
            with httpx.Client(timeout=httpx.Timeout(30, read=1.5)) as hc, \
                    hc.stream("POST", url, json=body) as r:
                r.read()
        except httpx.ReadTimeout as e:
            left.append(e)

    slow = {"model": "scripted", "stream": True,
            "messages": [{"role": "user", "content": "slow please"}]}
    with httpx.Client(timeout=30) as hc, hc.stream("POST", url, json=slow) as busy:
        assert busy.status_code == 200
        lines = busy.iter_lines()
        next(lines)  # generating now, for >= 20 s
        threads = [threading.Thread(target=queued, args=(i, stream))
                   for i, stream in enumerate((True, True, True, False))]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while metric(live.url, "localmoe_queue_depth") < 4:
            assert time.time() < deadline, "the requests did not queue"
            time.sleep(0.05)
        for t in threads:
            t.join(30)
        assert len(left) == 4
        # they leave the queue and are counted while the model is still busy
        deadline = time.time() + 10
        while metric(live.url, CHAT_499, 0) < gone0 + 4:
            assert time.time() < deadline, "the queued requests were not counted as 499"
            time.sleep(0.05)
        assert metric(live.url, "localmoe_queue_depth") == 0
        assert metric(live.url, "localmoe_requests_running") == 1
        assert metric(live.url, "localmoe_cancelled_generations_total") == cancelled0 + 4
        assert next(lines) is not None  # the running one was not disturbed
    _counted_as_499(live, ok0, gone0 + 4)  # the running one, closed now: the fifth 499
    assert metric(live.url, "localmoe_cancelled_generations_total") == cancelled0 + 5
    assert sum(1 for r in caplog.records
               if "(499) while it waited for the model" in r.getMessage()) == 4
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert metric(live.url, CHAT_400, 0) == bad0  # not an error of the cut generation
    r = live.client().chat.completions.create(model="scripted",
                                              messages=[{"role": "user", "content": "echo 9"}])
    assert r.choices[0].message.content == "You said 9."


def test_run_server_checks_before_binding_and_warns_on_open_bind(monkeypatch, capsys, caplog,
                                                                 smollm2_path, tmp_path):
    import uvicorn

    import localmoe.serve.server as server
    from localmoe.errors import LocalMoEError

    calls = []

    def run(self):  # uvicorn.Server.run: record what would be served
        calls.append((self.config.app, {"host": self.config.host}))
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    with pytest.raises(LocalMoEError):
        server.run_server(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(LocalMoEError):
        server.run_server(str(bad))
    with pytest.raises(LocalMoEError):
        server.run_server(str(smollm2_path), kv_cache="int17")
    # a context above the model's training context failed in the background load: the server
    # kept running and answered every request with a 503
    with pytest.raises(LocalMoEError, match="training context"):
        server.run_server(str(smollm2_path), n_ctx=99999999)
    with pytest.raises(LocalMoEError, match="positive integer"):
        server.run_server(str(smollm2_path), n_ctx=0)
    # a 1-token context holds a prompt but no answer: the server bound, then its warm-up
    # failed with "prompt is 1 token and fills the whole context ... shorten the prompt"
    with pytest.raises(LocalMoEError, match="no room for an answer.*--ctx-size 2"):
        server.run_server(str(smollm2_path), n_ctx=1)
    # a KV group larger than SmolLM2's 64-channel heads (it ran as :g64, reported as :g128)
    with pytest.raises(LocalMoEError, match="use ':g64' or less"):
        server.run_server(str(smollm2_path), kv_cache="int4:g128")
    assert calls == []  # none of those bound a port
    server.run_server(str(smollm2_path), host="0.0.0.0", port=1)
    # one line on stderr; not also a log record (before the bind nothing has configured
    # logging, so Python's last-resort handler printed it a second time)
    assert capsys.readouterr().err.count("without an API key") == 1
    assert not [r for r in caplog.records if "without an API key" in r.getMessage()]
    server.run_server(str(smollm2_path), host="127.0.0.1", port=1)
    server.run_server(str(smollm2_path), host="0.0.0.0", port=1, api_key="k")
    assert "without an API key" not in capsys.readouterr().err
    assert [kw["host"] for _, kw in calls] == ["0.0.0.0", "127.0.0.1", "0.0.0.0"]
    assert calls[0][0].state.localmoe.model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert server.is_loopback("::1") and server.is_loopback("localhost")
    assert not server.is_loopback("192.168.1.2")


def test_serve_refuses_to_start_on_damaged_weights(tmp_path):
    """Tensor data overwritten with 0xff gives non-finite logits: /health said ok and every
    request got a 500 server_error. A 1-token warm-up after loading stops the server with the
    engine's one error line (as generate prints it, and not logged before it too), exit
    status 1; a request that still meets
    the error gets a 503 model_error, not a 500 server_error."""
    import subprocess
    import sys

    from localmoe.errors import ModelLoadError
    from localmoe.serve.errors import error_from_exception
    from localmoe.testing.synthetic import write_gguf

    data = bytearray(write_gguf(tmp_path / "t.gguf", "tiny-llama").read_bytes())
    data[-4096:] = b"\xff" * 4096
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "localmoe", "serve", "-m", str(bad), "--backend",
                        "torch", "--port", str(port)], capture_output=True, text=True,
                       timeout=120)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 1 and lines[-1].startswith(
        "error: the model computed non-finite logits"), r.stderr
    assert "Traceback" not in r.stderr
    # said once: the log's "model failed to load: ..." repeated the error line word for word
    assert r.stderr.count("non-finite logits") == 1, r.stderr
    e = error_from_exception(ModelLoadError("the model computed non-finite logits"))
    assert e.status == 503 and e.type == "model_error"


# ---------------------------------------------------------------------------- real model

@pytest.mark.slow
def test_plain_chat_with_real_smollm2(smollm2_path):
    from localmoe.api import LLM
    from localmoe.serve.server import create_app

    llm = LLM(smollm2_path, backend="torch", n_ctx=512)
    srv = LiveServer(create_app(llm, model_name="smollm2"))
    try:
        c = srv.client()
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.chat.completions.create(model="smollm2", messages=msgs, temperature=0,
                                      max_tokens=12)
        text = r.choices[0].message.content
        assert text and text.strip()
        assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 10
        s = list(c.chat.completions.create(model="smollm2", messages=msgs, temperature=0,
                                           max_tokens=12, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == text
    finally:
        srv.stop()
        llm.close()


# ------------------------------------------- OpenAI shaping over other template families

class TemplateLLM:
    """Minimal engine stand-in (the LLM attributes the OpenAI shaping uses) with a given chat template;
    its reply is fixed text streamed in 3-character pieces."""

    def __init__(self, template_src: str, reply: str):
        from localmoe.text.chat_template import ChatTemplate

        self.template = ChatTemplate(template_src)
        self.tokenizer = None
        self.model_name, self.backend_name = "fake", "fake"
        self.reply = reply
        self.seen = None

    def chat_stream(self, messages, params, tools=None, cancel=None, fit_max_tokens=False):
        from localmoe.engine.results import GenerationResult, StreamEvent

        self.seen = (messages, tools, self.template.render(messages, tools=tools))
        for i in range(0, len(self.reply), 3):
            yield StreamEvent(self.reply[i:i + 3], 1)
        yield StreamEvent("", None, True, GenerationResult(self.reply, [1] * 7, 11, 7, "stop"))


LLAMA3_TPL = ("{%- if tools %}<|start_header_id|>system<|end_header_id|>{{ tools | tojson }}"
              "<|eot_id|>{%- endif %}{%- for m in messages %}<|start_header_id|>{{ m.role }}"
              "<|end_header_id|>{{ m.content }}{%- if m.tool_calls %}<|python_tag|>"
              "{{ m.tool_calls[0].function | tojson }}{%- endif %}<|eot_id|>{%- endfor %}"
              "<|start_header_id|>assistant<|end_header_id|>")
MISTRAL_TPL = ("{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS]{%- for c in m.tool_calls %}"
               "{%- if c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
               "strings with length 9!') }}{%- endif %}{{ c.function | tojson }}{%- endfor %}"
               "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
               "{%- else %}[INST]{{ m.content }}[/INST]{%- endif %}{%- endfor %}"
               "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}")


def test_llama3_template_gets_tools_and_json_reply_is_a_call():
    import localmoe.openai as openai_api

    llm = TemplateLLM(LLAMA3_TPL, 'Checking. {"name": "get_weather", "parameters": {"city": "Lima"}}')
    r = openai_api.chat_completion(llm, {"messages": [{"role": "user", "content": "weather?"}],
                                         "tools": [WEATHER_TOOL]})
    assert llm.seen[1][0]["function"]["name"] == "get_weather"  # tools reached the template
    assert "get_weather" in llm.seen[2]
    msg = r["choices"][0]["message"]
    assert msg["content"] == "Checking."
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert r["usage"] == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    # a tool not in the request's list is not a call: stays content
    llm = TemplateLLM(LLAMA3_TPL, '{"name": "rm_rf", "parameters": {}}')
    r = openai_api.chat_completion(llm, {"messages": [{"role": "user", "content": "x"}],
                                         "tools": [WEATHER_TOOL]})
    assert r["choices"][0]["message"]["content"] == '{"name": "rm_rf", "parameters": {}}'
    assert "tool_calls" not in r["choices"][0]["message"]


def test_mistral_ids_survive_the_round_trip_through_its_template():
    import localmoe.openai as openai_api

    llm = TemplateLLM(MISTRAL_TPL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    req = {"messages": [{"role": "user", "content": "weather in Rome?"}], "tools": [WEATHER_TOOL]}
    r = openai_api.chat_completion(llm, req)
    call = r["choices"][0]["message"]["tool_calls"][0]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    streamed = list(openai_api.chat_completion(llm, {**req, "stream": True}))
    ids = [tc["id"] for c in streamed for tc in c["choices"][0]["delta"].get("tool_calls") or []
           if tc.get("id")] if streamed else []
    assert ids and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    llm.reply = "It is sunny in Rome."
    req["messages"] += [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "sun"}'}]
    r = openai_api.chat_completion(llm, req)  # the template would raise on a bad id
    assert r["choices"][0]["message"]["content"] == "It is sunny in Rome."
    rendered = llm.seen[2]
    assert '[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Rome"}}' in rendered
    assert '[TOOL_RESULTS]{"sky": "sun"}[/TOOL_RESULTS]' in rendered


def test_validation_errors_name_the_parameter_without_a_model():
    import localmoe.openai as openai_api
    from localmoe.errors import InvalidRequestError

    llm = TemplateLLM(LLAMA3_TPL, "x")
    base = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [({"messages": "hi"}, "messages"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
              "messages[0].content[0]"),
             ({**base, "stop": ["ok", ""]}, "stop"),
             ({**base, "stop": ""}, "stop"),   # refused as `generate --stop ''` is
             ({**base, "seed": 1.5}, "seed"),
             ({**base, "top_p": 1.5}, "top_p"),
             ({**base, "tool_choice": "required"}, "tool_choice"),
             ({**base, "logprobs": 1}, "logprobs"),
             ({**base, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
             ({**base, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
             ({**base, "response_format": {"type": "xml"}}, "response_format.type"),
             ({**base, "messages": [{"role": "assistant", "content": None, "tool_calls": [
                 {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
              "messages[0].tool_calls[0].function.arguments"),
             ({**base, "messages": [*base["messages"], {"role": "tool", "content": "21 C",
                                                        "tool_call_id": None}]},
              "messages[1].tool_call_id"),
             ({**base, "messages": [*base["messages"], {"role": "tool", "content": "21 C",
                                                        "tool_call_id": 7}]},
              "messages[1].tool_call_id")]
    for req, param in cases:
        with pytest.raises(InvalidRequestError) as ei:
            openai_api.chat_completion(llm, req)
        assert ei.value.param == param, (req, ei.value.param, str(ei.value))


def test_unknown_schema_format_is_refused_only_when_strict_unknown_type_always():
    """docs/STRUCTURED_OUTPUT.md listed an unknown JSON Schema `format` among the 400s of
    every request; it is one only with strict: true (strict: false ignores it, as JSON Schema
    treats an unknown format), while an unknown response_format type is a 400 always."""
    import localmoe.openai as openai_api
    from localmoe.errors import InvalidRequestError

    base = {"messages": [{"role": "user", "content": "hi"}]}

    def rf(strict, fmt="phone"):
        return {**base, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": strict, "schema": {"type": "object", "properties": {
                "p": {"type": "string", "format": fmt}}}}}}

    for kind in ("chat", "completion"):
        def check(body, kind=kind):
            if kind == "completion":
                body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "hi"}
            openai_api.validate_request(kind, body)

        with pytest.raises(InvalidRequestError, match="Unknown format: phone") as ei:
            check(rf(True))
        assert ei.value.param == "response_format.json_schema.schema"
        check(rf(False))
        check(rf(True, "date-time"))
        for strict in (True, False):
            with pytest.raises(InvalidRequestError, match="response_format.type must be") as ei:
                check({**base, "response_format": {"type": "xml", "strict": strict}})
            assert ei.value.param == "response_format.type"
    path = Path(__file__).parents[2] / "docs" / "STRUCTURED_OUTPUT.md"
    doc = " ".join(path.read_text().split())
    assert "or a `format` it does not know" in doc and "an unknown `format`, or" not in doc


QWEN3_TPL = ("{%- if tools %}<|im_start|>system\n# Tools\n<tools>{{ tools | tojson }}</tools>\n"
             "Use <tool_call></tool_call> tags.<|im_end|>\n{%- endif %}"
             "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
             "<|im_start|>assistant\n{%- if enable_thinking is defined and not enable_thinking %}"
             "<think>\n\n</think>\n\n{%- endif %}")


def test_reasoning_content_split_for_think_templates_stream_and_not():
    import localmoe.openai as openai_api

    reply = ('<think>\nThe user asks for weather; call get_weather.\n</think>\n\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kyiv"}}\n</tool_call>')
    llm = TemplateLLM(QWEN3_TPL, reply)
    req = {"messages": [{"role": "user", "content": "weather in Kyiv?"}], "tools": [WEATHER_TOOL]}
    r = openai_api.chat_completion(llm, req)
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user asks for weather; call get_weather."
    assert msg["content"] is None
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Kyiv"}'
    chunks = list(openai_api.chat_completion(llm, {**req, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or []
            if t.get("function", {}).get("name")] == ["get_weather"]
    r = openai_api.chat_completion(llm, {**req, "reasoning_format": "none", "tool_choice": "none"})
    assert r["choices"][0]["message"]["content"] == reply
    assert "reasoning_content" not in r["choices"][0]["message"]


class SlowTemplateLLM(TemplateLLM):
    """A stand-in whose chat template renders until the request is cancelled (then stops as
    the engine's template sandbox does: TemplateLimitError "cancelled"), or for 20 s."""

    def chat_stream(self, messages, params, tools=None, cancel=None, fit_max_tokens=False):
        from localmoe.text.chat_template import TemplateLimitError

        self.rendering.set()
        if cancel is not None and cancel.wait(20):
            raise TemplateLimitError("cancelled", "the request was cancelled while its chat "
                                     "template rendered")
        yield from super().chat_stream(messages, params, tools, cancel, fit_max_tokens)


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_leaves_before_the_first_output_is_499_not_the_cut_renders_400(stream):
    """A client that disconnects after its request got the model but before any output (its
    prompt still rendering): 499 and a cancelled generation, not the 400 of the stopped
    template."""
    from localmoe.serve.server import create_app

    llm = SlowTemplateLLM(LLAMA3_TPL, "Hello there.")
    llm.rendering = threading.Event()
    srv = LiveServer(create_app(llm, model_name="fake"))
    body = {"model": "fake", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(timeout=httpx.Timeout(30, read=1.0)) as hc, \
                    hc.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                r.read()
        assert llm.rendering.is_set()
        deadline = time.time() + 10
        while metric(srv.url, CHAT_499, 0) < 1:
            assert time.time() < deadline, "the closed request was not counted as 499"
            time.sleep(0.05)
        assert metric(srv.url, "localmoe_requests_total") == 1  # counted once
        assert metric(srv.url, "localmoe_cancelled_generations_total") == 1
    finally:
        srv.stop()


def test_model_known_by_its_cli_and_store_names(scripted_llm):
    """Requests may name the model as the user gave it to -m or as the store lists it."""
    from localmoe.serve.server import create_app

    srv = LiveServer(create_app(scripted_llm, model_name="SmolLM2-135M-Instruct.Q4_1",
                                aliases={"smollm2"}))
    try:
        msgs = [{"role": "user", "content": "echo 5"}]
        for name in ("smollm2", "SmolLM2-135M-Instruct.Q4_1"):
            r = srv.client().chat.completions.create(model=name, messages=msgs)
            assert r.choices[0].message.content == "You said 5."
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "other", "messages": msgs})
        assert r.status_code == 404
    finally:
        srv.stop()


def test_port_in_use_is_a_clear_error():
    import socket

    from localmoe.errors import LocalMoEError
    from localmoe.serve.server import _check_port_free

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LocalMoEError, match=f"cannot listen on 127.0.0.1:{port}.*another --port"):
            _check_port_free("127.0.0.1", port)
    _check_port_free("127.0.0.1", port)  # free again once released


def test_a_host_this_machine_does_not_have_names_the_host():
    """Binding an address no interface holds (a TEST-NET-1 address, RFC 5737) fails with
    EADDRNOTAVAIL: the error points at --host, not at the port."""
    from localmoe.errors import LocalMoEError
    from localmoe.serve.server import _check_port_free

    with pytest.raises(LocalMoEError, match="cannot listen on 192.0.2.1:8000.*--host") as ei:
        _check_port_free("192.0.2.1", 8000)
    assert "--port" not in str(ei.value)


def test_completion_prompt_may_be_the_empty_string():
    """OpenAI's completions accept ``prompt: ""`` (the server said "must be a non-empty
    string"); the engine then starts from the BOS token, or says the prompt is empty where the
    model adds none. Other types stay a 400 naming the field."""
    import localmoe.openai as openai_api
    from localmoe.errors import InvalidRequestError

    openai_api.validate_request("completion", {"prompt": ""})
    openai_api.validate_request("completion", {"prompt": [""]})
    for bad in (None, 5, {"a": 1}, [1.5], []):
        with pytest.raises(InvalidRequestError, match="prompt must be") as ei:
            openai_api.validate_request("completion", {"prompt": bad})
        assert ei.value.param == "prompt"
