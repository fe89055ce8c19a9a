"""Engine tests on a scripted fake runner and a tiny byte-piece tokenizer.

The fake runner is a Markov chain: the next token's logits depend only on the last token fed, so
greedy output is fixed and independent of prefix reuse; it enforces the Runner contract (no
overflow past n_ctx, no concurrent forward calls) and records every call.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from localmoe.api import LLM
from localmoe.engine.results import GenerationResult, StreamEvent
from localmoe.errors import ContextOverflowError, InvalidRequestError, LocalMoEError

BOS, EOS = 0, 1
PIECES = [b"<s>", b"</s>", b"Hel", b"lo", b" wor", b"ld", b"\xf0\x9f", b"\x98\x80", b"!", b" the"]
BYTE0 = len(PIECES)  # ids BYTE0 + b are single bytes


class FakeTokenizer:
    """Byte-piece tokenizer: greedy longest match over PIECES, then single bytes."""

    def __init__(self):
        self.vocab = PIECES + [bytes([b]) for b in range(256)]
        self.vocab_size = len(self.vocab)
        self.bos_id, self.eos_id = BOS, EOS
        self.eog_ids = {EOS}
        self.add_bos = True
        self.control_ids = {BOS, EOS}

    def is_control(self, i):
        return i in (BOS, EOS)

    def is_special(self, i):
        return self.is_control(i)

    def token_bytes(self, i):
        return self.vocab[i]

    def encode(self, text, add_special=True, parse_special=False):
        data = text.encode()
        ids = [BOS] if add_special and self.add_bos else []
        if parse_special and data.startswith(b"<s>"):
            ids.append(BOS)
            data = data[3:]
        i = 0
        while i < len(data):
            for j, p in enumerate(PIECES[2:], start=2):
                if data.startswith(p, i):
                    ids.append(j)
                    i += len(p)
                    break
            else:
                ids.append(BYTE0 + data[i])
                i += 1
        return ids

    def decode(self, ids, skip_special=False):
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", "replace")


# next token after the last token fed; "x" (BYTE0+ord('x')) starts "Hello world😀!" then EOS
X = BYTE0 + ord("x")
CHAIN = {X: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: 7, 7: 8, 8: EOS}


class FakeRunner:
    backend_name = "fake"

    def __init__(self, n_ctx=64, delay=0.0, chain=None, default_next=9):
        self.n_ctx = n_ctx
        self.spec = None
        self.kv_spec = None
        self.device = "cpu"
        self.max_seqs = 1
        self.delay = delay
        self.chain = dict(CHAIN if chain is None else chain)
        self.default_next = default_next
        self.seqs: dict[int, list[int]] = {}
        self.calls: list[tuple[int, list[int]]] = []
        self.busy = False
        self.fail_at_call: int | None = None
        self.closed = False

    def new_sequence(self):
        sid = len(self.seqs)
        self.seqs[sid] = []
        return sid

    def free_sequence(self, sid):
        self.seqs.pop(sid, None)

    def seq_len(self, sid):
        return len(self.seqs[sid])

    def truncate(self, sid, n):
        del self.seqs[sid][n:]

    def forward(self, batch, all_logits=False):
        assert not self.busy, "concurrent forward"
        self.busy = True
        try:
            if self.delay:
                time.sleep(self.delay)
            out = []
            for sid, toks in batch:
                assert toks, "empty forward"
                if len(self.seqs[sid]) + len(toks) > self.n_ctx:
                    raise ContextOverflowError(len(self.seqs[sid]) + len(toks), self.n_ctx)
                self.calls.append((sid, list(toks)))
                if self.fail_at_call is not None and len(self.calls) == self.fail_at_call:
                    raise RuntimeError("boom")
                self.seqs[sid].extend(toks)
                logits = torch.zeros(len(PIECES) + 256)
                logits[self.chain.get(toks[-1], self.default_next)] = 10.0
                out.append(logits)
            return out
        finally:
            self.busy = False

    def stats(self):
        return {"device": "cpu", "kv_bytes": 0}

    def close(self):
        self.closed = True


def make_llm(**kw):
    return LLM.from_parts(FakeRunner(**kw), FakeTokenizer(), model_name="fake")


def collect(events):
    deltas, result = [], None
    for ev in events:
        assert isinstance(ev, StreamEvent)
        if ev.done:
            result = ev.result
        else:
            assert ev.delta, "text events are never empty"
            assert "\ufffd" not in ev.delta
            deltas.append(ev.delta)
    return deltas, result


def test_stream_equals_blocking_and_utf8_held_back():
    llm = make_llm()
    r = llm.generate("x", temperature=0)
    assert isinstance(r, GenerationResult)
    assert r.text == "Hello world😀!"
    assert r.finish_reason == "stop"
    assert r.token_ids == [2, 3, 4, 5, 6, 7, 8, EOS]
    assert r.prompt_tokens == 2 and r.completion_tokens == 8
    deltas, r2 = collect(llm.generate("x", temperature=0, stream=True))
    assert "".join(deltas) == r2.text == r.text
    assert "😀" in deltas  # the emoji's two byte tokens arrive as one delta


@pytest.mark.parametrize("stop,expected", [
    (("o wo",), "Hell"),        # spans "lo" + " wor"
    (("world😀",), "Hello "),    # spans three tokens incl. a split character
    (("zzz",), "Hello world😀!"),  # never matches
    (("!x",), "Hello world😀!"),   # "!" held back as a possible prefix, released at the EOS
    (("!", "ld"), "Hello wor"),   # earliest match wins
    (("Hello world😀!",), ""),
])
def test_stop_strings_across_tokens(stop, expected):
    llm = make_llm()
    r = llm.generate("x", temperature=0, stop=stop)
    assert r.text == expected
    assert r.finish_reason == "stop"
    deltas, r2 = collect(llm.generate("x", temperature=0, stop=stop, stream=True))
    assert "".join(deltas) == r2.text == expected
    for s in stop:  # no partial stop text emitted: the stream never shows the stop string
        assert s not in "".join(deltas)


def test_max_tokens_gives_length():
    llm = make_llm()
    r = llm.generate("x", temperature=0, max_tokens=3)
    assert r.text == "Hello wor" and r.finish_reason == "length" and r.completion_tokens == 3


def test_context_overflow_raises_with_both_numbers():
    llm = make_llm(n_ctx=8)
    with pytest.raises(ContextOverflowError) as ei:
        llm.generate("x" * 20, temperature=0)
    assert ei.value.n_prompt == 21 and ei.value.n_ctx == 8
    assert "21" in str(ei.value) and "8" in str(ei.value)
    with pytest.raises(ContextOverflowError):  # streams raise at call time too
        llm.generate("x" * 20, temperature=0, stream=True)
    assert llm.runner.calls == []  # no compute was spent


def test_prompt_filling_the_whole_context_is_refused():
    # nothing could be generated: refused like the CLI (and vLLM, llama.cpp's server), not an
    # empty reply with finish_reason "length"
    llm = make_llm(n_ctx=8)
    n = len(llm.prompt_ids("x" * 7))
    llm = make_llm(n_ctx=n)
    with pytest.raises(ContextOverflowError, match="fills the whole context") as ei:
        llm.generate("x" * 7, temperature=0)
    assert ei.value.n_prompt == n == ei.value.n_ctx
    assert llm.runner.calls == []
    assert make_llm(n_ctx=n + 1).generate("x" * 7, temperature=0).completion_tokens == 1


def test_generation_hitting_context_end_is_length():
    llm = make_llm(n_ctx=6, chain={}, default_next=9)  # " the" forever
    r = llm.generate("abc", temperature=0)  # 4 prompt tokens
    assert r.finish_reason == "length"
    assert r.completion_tokens == 2 and r.text == " the the"
    assert max(len(s) for s in llm.runner.seqs.values()) <= 6
    with pytest.raises(ContextOverflowError):   # prompt == n_ctx: nothing fits (see below)
        llm.generate("abcde", temperature=0)


def test_cancel_event_and_closing_stream():
    llm = make_llm(chain={}, default_next=9)
    cancel = threading.Event()
    events = llm.generate("x", temperature=0, stream=True, cancel=cancel)
    n = 0
    result = None
    for ev in events:
        if ev.done:
            result = ev.result
            break
        n += 1
        if n == 3:
            cancel.set()
    assert result.finish_reason == "cancelled" and result.completion_tokens == 3
    # closing the iterator mid-stream stops and releases the model
    it = llm.generate("x", temperature=0, stream=True)
    next(it)
    it.close()
    r = llm.generate("x", temperature=0, max_tokens=2)
    assert r.completion_tokens == 2


def test_timings_are_measured():
    llm = make_llm(delay=0.02)
    r = llm.generate("x", temperature=0)
    t = r.timings
    assert t.ttft_ms >= 20 and t.total_ms >= t.ttft_ms
    assert 15 <= t.tpot_ms <= 200
    assert abs(t.decode_tok_s - 1000.0 / t.tpot_ms) < 1e-6 * t.decode_tok_s + 1e-9
    assert t.prefill_tok_s > 0
    d = r.to_dict()
    assert d["timings"]["ttft_ms"] > 0 and d["completion_tokens"] == 8


def test_one_generation_at_a_time():
    llm = make_llm(delay=0.002, chain={}, default_next=9)
    results, errors = [], []

    def work():
        try:
            results.append(llm.generate("x", temperature=0, max_tokens=5))
        except Exception as e:  # pragma: no cover - the assertion below reports it
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and len(results) == 3
    assert all(r.text == " the" * 5 for r in results)


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), ("yes", True),
                                      ("", False), ("0", False), ("false", False),
                                      ("off", False), ("No", False), ("banana", None)])
def test_greedy_prefix_reuse_reads_yes_and_no_words(monkeypatch, caplog, recwarn, value, on):
    """``=false`` (or ``off``, ``no``) turned the reuse on (anything but "" or "0" did; a
    fresh-user trial, session 27): off words are off, an unknown word stays off with one
    logged warning line (not a Python warning, which printed its source line)."""
    import logging

    import localmoe.io.env as env
    from localmoe.engine.generation import greedy_prefix_reuse

    env._warn.cache_clear()   # each bad value is logged once per process
    monkeypatch.setenv("LOCALMOE_GREEDY_PREFIX_REUSE", value)
    with caplog.at_level(logging.WARNING):
        assert greedy_prefix_reuse() is bool(on)
    warned = [r.getMessage() for r in caplog.records]
    if on is None:
        assert warned == ["LOCALMOE_GREEDY_PREFIX_REUSE='banana' is not 1/true/yes/on or "
                          "0/false/no/off; assuming the default (off)"]
    else:
        assert not warned
    assert not recwarn.list


def test_prefix_reuse_prefills_only_the_suffix(monkeypatch):
    # greedy requests reuse prefixes only when asked to (docs/LIMITS.md)
    monkeypatch.setenv("LOCALMOE_GREEDY_PREFIX_REUSE", "1")
    llm = make_llm(chain={}, default_next=9)
    r1 = llm.generate("abc", temperature=0, max_tokens=2)
    n_calls = len(llm.runner.calls)
    r2 = llm.generate("abcdef", temperature=0, max_tokens=2)
    assert r2.cached_tokens == 4  # BOS a b c
    assert llm.runner.calls[n_calls] == (0, [BYTE0 + ord("d"), BYTE0 + ord("e"), BYTE0 + ord("f")])
    assert llm.runner.seqs[0][:7] == FakeTokenizer().encode("abcdef")
    # identical prompt: one token is re-fed for fresh logits
    r3 = llm.generate("abcdef", temperature=0, max_tokens=2)
    assert r3.cached_tokens == 6 and r3.text == r2.text == r1.text


def test_runner_failure_resets_cache_and_recovers():
    llm = make_llm()
    llm.runner.fail_at_call = 3
    with pytest.raises(RuntimeError):
        llm.generate("x", temperature=0)
    assert llm._cached == [] and llm.runner.seqs[0] == []
    r = llm.generate("x", temperature=0)
    assert r.text == "Hello world😀!"


def test_no_double_bos_with_template_that_writes_bos():
    class Tmpl:
        renders_bos = True

        def render(self, messages, tools=None, add_generation_prompt=True):
            return "<s>" + "".join(m["content"] for m in messages)

    llm = LLM.from_parts(FakeRunner(), FakeTokenizer(), Tmpl())
    r = llm.generate("x", raw=False, temperature=0)
    first = llm.runner.calls[0][1]
    assert first[0] == BOS and first[1] != BOS
    assert r.text == "Hello world😀!"
    deltas, res = collect(llm.chat_stream([{"role": "user", "content": "x"}], None))
    assert "".join(deltas) == res.text


def test_chat_without_template_uses_transcript():
    llm = make_llm(chain={}, default_next=9)
    assert llm.render_chat([{"role": "user", "content": "hi"}]) == "User: hi\nAssistant:"
    from localmoe.engine.sampling import SamplingParams

    deltas, res = collect(llm.chat_stream([{"role": "user", "content": "hi"}],
                                          SamplingParams.greedy(max_tokens=3)))
    assert res.text == " the the the"


@pytest.mark.parametrize("role", ["User", "System", "Assistant", "Tool"])
def test_transcript_reply_stops_at_a_new_turn_of_any_role(role):
    """Without a chat template the reply to the plain transcript stopped at "\nUser:" and
    "\nSystem:" but ran on through a second "\nAssistant:" turn (render_chat writes every
    role as "Role: ..." on its own line); a new turn of any role ends it."""
    script = FakeTokenizer().encode(f" the\n{role}: the the", add_special=False)

    class Scripted(FakeRunner):
        def forward(self, batch, all_logits=False):
            out = super().forward(batch, all_logits)
            for lg in out:
                lg.zero_()
                lg[script.pop(0) if script else EOS] = 10.0
            return out

    llm = LLM.from_parts(Scripted(n_ctx=256), FakeTokenizer(), model_name="fake")
    from localmoe.engine.sampling import SamplingParams

    _, res = collect(llm.chat_stream([{"role": "user", "content": "hi"}],
                                     SamplingParams.greedy(max_tokens=40)))
    assert (res.text, res.finish_reason) == (" the", "stop")


def test_bad_parameters_are_user_errors():
    llm = make_llm()
    with pytest.raises(InvalidRequestError) as ei:
        llm.generate("x", temprature=0.5)
    assert ei.value.param == "temprature"
    with pytest.raises(InvalidRequestError):
        llm.generate("x", top_p=2.0)
    with pytest.raises(InvalidRequestError):
        llm.generate([], temperature=0)
    assert isinstance(ei.value, LocalMoEError)
    for bad in (None, 5, [1, "x"], [1.7], [True]):  # not text, not token ids: a user error
        with pytest.raises(InvalidRequestError, match="string or a sequence of token ids"):
            llm.generate(bad)
    for raw in (b"\xff\xfe", bytearray(b"hi")):  # bytes are not token ids [255, 254]
        with pytest.raises(InvalidRequestError, match="prompt is bytes: decode it"):
            llm.generate(raw)
    for stop in (b"x", bytearray(b"x")):           # not a list of the ints 120
        with pytest.raises(InvalidRequestError, match="not bytes"):
            llm.generate("x", stop=stop)
    for cancel in (True, "yes", 1):                  # checked before the run, not mid-decode
        with pytest.raises(InvalidRequestError, match="cancel must be a threading.Event"):
            llm.generate("x", cancel=cancel)
    assert llm.generate("x", max_tokens=2, temperature=0).text is not None   # still usable


def test_seeded_sampling_is_reproducible():
    torch.manual_seed(0)

    class Noisy(FakeRunner):
        def forward(self, batch, all_logits=False):
            out = super().forward(batch, all_logits)
            return [torch.linspace(0, 1, len(o)) for o in out]  # flat-ish: sampling matters

    llm = LLM.from_parts(Noisy(n_ctx=200), FakeTokenizer())
    a = llm.generate("x", seed=7, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=20)
    b = llm.generate("x", seed=7, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=20)
    c = llm.generate("x", seed=8, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=20)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_close_releases_runner():
    llm = make_llm()
    llm.close()
    assert llm.runner.closed
    with pytest.raises(LocalMoEError):
        llm.generate("x")


@pytest.mark.slow
def test_real_model_chat_prompt_has_one_bos(smollm2_path):
    """SmolLM2's template on the real tokenizer: one BOS at most, and the engine runs."""
    from localmoe.text.chat_template import ChatTemplate
    from localmoe.io.loader import open_model
    from localmoe.text.tokenizer import Tokenizer

    mf = open_model(smollm2_path)
    tok = Tokenizer.from_model(mf)
    tmpl = ChatTemplate.from_model(mf, tok)
    llm = LLM.from_parts(FakeRunner(n_ctx=512), tok, tmpl, model_file=mf)
    ids = llm._chat_ids([{"role": "user", "content": "<|im_start|>hi"}])
    assert not (len(ids) > 1 and ids[0] == ids[1] == tok.bos_id)
    # control-token text inside a message stays plain text: only the template's markers parse
    im_start = tok.token_to_id("<|im_start|>")
    rendered = llm.render_chat([{"role": "user", "content": "hi"}])
    assert ids.count(im_start) == rendered.count("<|im_start|>")


def test_chat_returns_openai_shapes():
    llm = make_llm(chain={}, default_next=9)
    out = llm.chat([{"role": "user", "content": "hi"}], temperature=0, max_tokens=3)
    assert out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == " the the the"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 3
    chunks = list(llm.chat([{"role": "user", "content": "hi"}], stream=True, temperature=0,
                           max_tokens=3))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == " the the the"


def test_model_sampling_defaults_apply_unless_overridden():
    import types as _t

    mf = _t.SimpleNamespace(metadata={"general.sampling.temp": 0.0, "general.sampling.top_k": 7},
                            name="m", spec=None)
    llm = LLM.from_parts(FakeRunner(chain={}, default_next=9), FakeTokenizer(), model_file=mf)
    d = llm.default_sampling()
    assert d.temperature == 0.0 and d.top_k == 7
    assert llm.generate("x", max_tokens=2).text == " the the"  # greedy from the file


def test_incomplete_utf8_at_eos_is_flushed_like_decode():
    """A character cut off by the end-of-generation token: its bytes are released (as U+FFFD,
    like Tokenizer.decode) in stream and non-stream alike, even with stop strings set."""
    llm = LLM.from_parts(FakeRunner(chain={X: 2, 2: 6, 6: EOS}), FakeTokenizer())
    for stop in ((), ("zz",)):
        r = llm.generate("x", temperature=0, stop=stop)
        assert r.text == "Hel\ufffd" and r.finish_reason == "stop"
        evs = list(llm.generate("x", temperature=0, stop=stop, stream=True))
        assert "".join(e.delta for e in evs) == r.text


class ScriptRunner(FakeRunner):
    """Emits ``script[i]`` as the i-th generated token (position-based, prompt of 2 tokens)."""

    def __init__(self, script, **kw):
        super().__init__(**kw)
        self.script = list(script)

    def forward(self, batch, all_logits=False):
        out = super().forward(batch, all_logits)
        sid = batch[0][0]
        i = len(self.seqs[sid]) - 2
        logits = torch.zeros(len(PIECES) + 256)
        logits[self.script[i] if i < len(self.script) else EOS] = 10.0
        return [logits]


from hypothesis import given, settings, strategies as st  # noqa: E402

_TOKENS = st.sampled_from([2, 3, 4, 5, 6, 7, 8, 9, EOS] + [BYTE0 + b for b in b"abo \n"]
                          + [BYTE0 + 0xE2, BYTE0 + 0x82, BYTE0 + 0xAC])  # split euro sign


@settings(max_examples=60, deadline=None)
@given(script=st.lists(_TOKENS, min_size=1, max_size=25),
       stop=st.lists(st.text(alphabet="Helo wrdab!\n😀", min_size=1, max_size=4), max_size=3),
       max_tokens=st.one_of(st.none(), st.integers(1, 30)))
def test_stream_invariants_property(script, stop, max_tokens):
    llm = LLM.from_parts(ScriptRunner(script, n_ctx=40), FakeTokenizer())
    kw = dict(temperature=0, stop=tuple(stop), max_tokens=max_tokens)
    r = llm.generate("x", **kw)
    deltas, r2 = [], None
    for ev in llm.generate("x", stream=True, **kw):
        if ev.done:
            r2 = ev.result
        else:
            assert ev.delta
            deltas.append(ev.delta)
            for s in stop:  # no stop string is ever shown, even split across deltas
                assert s not in "".join(deltas)
    assert "".join(deltas) == r2.text == r.text
    assert r2.token_ids == r.token_ids and r.finish_reason == r2.finish_reason
    # the text is a prefix of the plain decode of the generated tokens (EOS excluded)
    gen = [t for t in r.token_ids if t != EOS]
    assert FakeTokenizer().decode(gen).startswith(r.text)
    assert r.completion_tokens <= (max_tokens or 40)
    assert r.finish_reason in ("stop", "length")


def test_close_while_a_stream_is_suspended_does_not_deadlock():
    llm = make_llm(chain={}, default_next=9)
    it = llm.generate("x", temperature=0, stream=True, max_tokens=20)
    next(it)  # the stream now holds the model
    t = time.perf_counter()
    llm.close(timeout=0.05)
    assert time.perf_counter() - t < 2
    assert not llm.runner.closed  # still in use by the suspended stream
    rest = list(it)
    assert rest[-1].done and rest[-1].result.finish_reason == "cancelled"
    assert llm.runner.closed  # released when the stream let go
    with pytest.raises(LocalMoEError):
        llm.generate("x")


def test_a_second_generation_beside_a_suspended_stream_says_so():
    """A stream left suspended holds the model; a generation started in the same thread used to
    wait for it forever. It now raises at once, and the model works once the stream is
    closed."""
    llm = make_llm(chain={}, default_next=9)
    it = llm.generate("x", temperature=0, stream=True, max_tokens=20)
    next(it)
    with pytest.raises(LocalMoEError, match="still open in this thread"):
        llm.generate("x", temperature=0, max_tokens=2)
    with pytest.raises(LocalMoEError, match="still open"):
        next(llm.generate("x", temperature=0, stream=True))
    it.close()
    assert llm.generate("x", temperature=0, max_tokens=2).completion_tokens == 2
    # a request the generation refuses leaves no owner behind (it did: every later call in
    # the thread said a stream was open)
    with pytest.raises(InvalidRequestError):
        llm.generate("x", temperature=0, max_tokens=2, logit_bias={10 ** 8: 1.0})
    assert llm.generate("x", temperature=0, max_tokens=2).completion_tokens == 2
    # another thread still waits its turn rather than failing
    it = llm.generate("x", temperature=0, stream=True, max_tokens=3)
    next(it)
    out = []
    th = threading.Thread(target=lambda: out.append(llm.generate("x", temperature=0,
                                                                  max_tokens=2)))
    th.start()
    time.sleep(0.05)
    assert not out
    list(it)
    th.join(5)
    assert out and out[0].completion_tokens == 2


def test_close_beside_this_threads_own_open_stream_does_not_wait():
    """close() from the thread whose stream holds the model returns at once (it waited its
    whole timeout for a lock only this thread could release); the stream then ends cancelled
    and releases the runner."""
    llm = make_llm(chain={}, default_next=9)
    it = llm.generate("x", temperature=0, stream=True, max_tokens=20)
    next(it)
    t = time.perf_counter()
    llm.close(timeout=5)
    assert time.perf_counter() - t < 1
    rest = list(it)
    assert rest[-1].result.finish_reason == "cancelled" and llm.runner.closed


def test_raw_false_without_template_is_plain_completion():
    llm = make_llm()
    r = llm.generate("x", raw=False, temperature=0)
    assert llm.runner.calls[0][1] == [BOS, X] and r.text == "Hello world😀!"


def test_context_above_training_context_is_refused_before_loading(tmp_path):
    from localmoe.api import LLM
    from localmoe.errors import InvalidRequestError
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    n_train = open_model(path).spec.n_ctx_train
    with pytest.raises(InvalidRequestError, match=f"training context of {n_train}") as e:
        LLM(path, backend="torch", n_ctx=n_train * 100)
    assert e.value.param == "n_ctx"


def _fake_cuda(monkeypatch, n):
    """Pretend torch sees ``n`` CUDA devices (0: none); loading weights fails the test."""
    import localmoe.backends.torch_backend as tb

    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    def no_load(*a, **kw):
        raise AssertionError("weights must not load")

    monkeypatch.setattr(tb.TorchBackend, "load", no_load)


@pytest.mark.parametrize("n,device,match", [
    (2, "cuda:7", r"device 'cuda:7' does not exist: 2 CUDA devices visible here \(cuda:0 to cuda:1\)"),
    (1, "cuda:1", r"device 'cuda:1' does not exist: 1 CUDA device visible here \(cuda:0\)"),
    (0, "cuda", "device 'cuda' requested but no CUDA device is visible here; use cpu"),
    (0, "cuda:0", "device 'cuda:0' requested but no CUDA device is visible")])
def test_missing_device_is_refused_before_weights_load(tmp_path, monkeypatch, n, device, match):
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    _fake_cuda(monkeypatch, n)
    with pytest.raises(InvalidRequestError, match=match) as e:
        LLM(path, backend="torch", n_ctx=32, device=device)
    assert e.value.param == "device"


def test_device_index_given_is_the_device_used_and_reported(tmp_path, monkeypatch):
    import localmoe.backends.torch_backend as tb
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    got = []

    class Loaded(Exception):
        pass

    def load(self, model, **kw):
        got.append(kw["device"])
        raise Loaded

    monkeypatch.setattr(tb.TorchBackend, "load", load)
    with pytest.raises(Loaded):
        LLM(path, backend="torch", n_ctx=32, device=" CUDA:7")
    assert got == ["cuda:7"]


def test_backend_options_are_checked_before_loading(tmp_path):
    """A keyword option no backend takes is refused before the model is even opened (with the
    closest known one suggested); one that another backend takes is refused, naming it, before
    the weights load; a known one works."""
    from localmoe.testing.synthetic import write_gguf

    with pytest.raises(InvalidRequestError, match="unknown option 'foo'") as e:
        LLM(str(tmp_path / "missing.gguf"), foo=1)     # no "file not found": checked first
    assert e.value.param == "foo"
    with pytest.raises(InvalidRequestError, match="did you mean 'n_threads'"):
        LLM(str(tmp_path / "missing.gguf"), threads=2)
    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    with pytest.raises(InvalidRequestError, match="'n_batch' is an option of the llamacpp "
                                                  "backend, not of 'torch'"):
        LLM(path, backend="torch", n_ctx=32, n_batch=64)
    with pytest.raises(InvalidRequestError, match="'cuda_graphs' is an option of the triton"):
        LLM(path, backend="torch", n_ctx=32, cuda_graphs=False)
    assert LLM(path, backend="torch", n_ctx=32, n_threads=1).generate(
        "a", max_tokens=2).completion_tokens >= 1


def test_chat_refuses_unknown_parameters_like_generate():
    llm = make_llm()
    with pytest.raises(InvalidRequestError, match="did you mean 'max_tokens'") as e:
        llm.chat([{"role": "user", "content": "x"}], max_token=2)
    assert e.value.param == "max_token"
    r = llm.chat([{"role": "user", "content": "x"}], max_tokens=2, temperature=0, user="u")
    assert r["usage"]["completion_tokens"] <= 2
    # a string where the message list goes is named as such (it was "a non-empty list")
    with pytest.raises(InvalidRequestError, match="list of .* objects, got a string") as e:
        llm.chat("hi")
    assert e.value.param == "messages"


def test_model_name_is_the_name_the_user_gave(tmp_path):
    from localmoe.api import LLM
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "my-model.Q8_0.gguf", "tiny-llama")
    said = []
    assert LLM(path, backend="torch", n_ctx=32,
               progress=lambda f, m: said.append(m)).model_name == "my-model.Q8_0"
    assert "opened my-model.Q8_0" in said     # the load's progress line too, not general.name
    assert LLM(str(path), backend="torch", n_ctx=32).model_name == "my-model.Q8_0"
    # an already opened ModelFile is named by its file too, not by general.name
    mf = open_model(path)
    assert LLM(mf, backend="torch", n_ctx=32).model_name == "my-model.Q8_0" != mf.name


def test_context_overflow_message_names_both_surfaces():
    from localmoe.errors import ContextOverflowError

    msg = str(ContextOverflowError(10, 8))
    assert "10 tokens" in msg and "holds 8" in msg and "n_ctx" in msg and "--ctx-size" in msg


def test_non_finite_logits_are_an_error_not_an_empty_reply(tmp_path, monkeypatch):
    """Damaged weights (a span of 0xff bytes in the tensor data) gave NaN logits, and greedy
    sampling of NaN picked token 0: an empty reply with finish "stop" and exit 0. The engine
    raises ModelLoadError for non-finite prompt logits; the CLI prints it as one error line."""
    from click.testing import CliRunner

    from localmoe.cli import cli
    from localmoe.api import LLM
    from localmoe.errors import ModelLoadError
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    llm = LLM(path, backend="torch", n_ctx=64)
    assert llm.generate("hello", max_tokens=2, temperature=0).text is not None
    real = llm.runner.forward
    monkeypatch.setattr(llm.runner, "forward",
                        lambda batch, **kw: [x * float("nan") for x in real(batch, **kw)])
    with pytest.raises(ModelLoadError, match="non-finite logits"):
        llm.generate("hello again", max_tokens=2, temperature=0)
    # all-zero logits (llama.cpp's answer to NaN block scales) would sample uniformly
    monkeypatch.setattr(llm.runner, "forward",
                        lambda batch, **kw: [x * 0.0 for x in real(batch, **kw)])
    with pytest.raises(ModelLoadError, match="the same logit for every token"):
        llm.generate("hello once more", max_tokens=2, temperature=0)
    # a file whose tensor data is damaged: the CLI reports it instead of an empty answer
    data = bytearray(path.read_bytes())
    data[-4096:] = b"\xff" * 4096
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    r = CliRunner().invoke(cli, ["generate", "-m", str(bad), "--backend", "torch", "--greedy",
                                 "-n", "2", "hi"])
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.exit_code == 1 and lines[-1].startswith("error: the model computed non-finite"), \
        r.output
    assert lines[-1].endswith(f"download {bad} again"), lines[-1]   # the file, not its stem


def test_grammar_masks_the_runner_and_a_failure_still_propagates():
    """A constraint overrides what the runner's logits prefer (every token the grammar
    allows, computed during the forward pass), and a runner failure under a constraint is
    raised as is (the mask thread is waited for, not left holding the grammar)."""
    pytest.importorskip("llguidance")
    import re

    llm = make_llm()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["n"]}
    r = llm.generate("x", temperature=0, json_schema=schema, max_tokens=40)
    assert r.finish_reason == "stop" and re.fullmatch(r'\{"n": [0-9]{1,2}\}', r.text), r.text
    assert llm.generate("x", temperature=0).text == "Hello world😀!"  # unconstrained again
    llm.runner.fail_at_call = len(llm.runner.calls) + 3
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate("x", temperature=0, json_schema=schema)
    r = llm.generate("x", temperature=0, json_object=True, max_tokens=40)
    assert r.text.startswith("{")


class DeviceRunner(FakeRunner):
    """A runner that can keep its logits on the GPU (as the triton runner): the engine asks
    for them with ``on_device=True`` and launches the next forward ahead of detokenizing."""

    supports_device_logits = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.asked = []

    def forward(self, batch, all_logits=False, on_device=False):
        self.asked.append(on_device)
        return super().forward(batch, all_logits)


def test_device_logits_are_asked_of_a_runner_that_can_keep_them(monkeypatch):
    """A runner that says ``supports_device_logits`` gets ``on_device=True`` on prefill and
    decode (the Sampler samples such logits where they are); $LOCALMOE_DEVICE_SAMPLING=0 stops
    asking. The device path, forced on these CPU logits, gives the NumPy path's text under a
    grammar (packed mask) and without."""
    pytest.importorskip("llguidance")

    runner = DeviceRunner()
    llm = LLM.from_parts(runner, FakeTokenizer(), model_name="fake")
    monkeypatch.delenv("LOCALMOE_DEVICE_SAMPLING", raising=False)
    assert llm.generate("x", temperature=0).text == "Hello world😀!"
    assert len(runner.asked) > 3 and all(runner.asked)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["n"]}
    texts = {}
    for env in ("0", "1", "no", "true"):  # the on/off words of every LOCALMOE_* switch
        monkeypatch.setenv("LOCALMOE_DEVICE_SAMPLING", env)
        runner.asked = []
        texts[env] = [llm.generate("x", temperature=0, json_schema=schema, max_tokens=12).text,
                      llm.generate("x", temperature=0, repeat_penalty=1.5, max_tokens=12).text]
        assert any(runner.asked) == (env in ("1", "true")), env
    assert texts["1"] == texts["0"] and texts["0"][0].startswith('{"n": ')


def _same_stream_as_plain(other, kw):
    """Generate greedily with ``kw`` on a plain fake engine and on ``other``: returns
    ``(out, held)``: per engine the (deltas, text, finish reason, token ids) and how many
    tokens its runner holds (checked equal to the engine's record of its cache)."""
    out, held = [], []
    for llm in (make_llm(), other):
        deltas, r = collect(llm.generate("x", temperature=0, stream=True, **kw))
        out.append((deltas, r.text, r.finish_reason, r.token_ids))
        (seq,) = llm.runner.seqs.values()
        assert llm._cached == seq
        held.append(len(seq))
    return out, held


@pytest.mark.parametrize("kw", [
    dict(), dict(stop=("o wo",)), dict(stop=("world😀",)), dict(stop=("Hello world😀!",)),
    dict(stop=("!x",)), dict(max_tokens=3), dict(max_tokens=1)])
def test_forward_ahead_gives_the_same_stream_and_a_consistent_cache(kw, monkeypatch):
    """With device logits the next forward is launched before detokenizing: the events,
    text, finish reason and tokens are those of the plain loop, and the engine's record of
    the cached tokens matches what the runner holds (a stop string leaves one forward spent)."""
    monkeypatch.delenv("LOCALMOE_DEVICE_SAMPLING", raising=False)
    ahead = LLM.from_parts(DeviceRunner(), FakeTokenizer(), model_name="fake")
    out, held = _same_stream_as_plain(ahead, kw)
    assert out[0] == out[1]
    assert all(ahead.runner.asked)
    string_stop = out[0][2] == "stop" and out[0][3][-1] != EOS
    assert held[1] == held[0] + string_stop  # the forward launched ahead of the stop string


class PipeRunner(DeviceRunner):
    """A runner that also takes a decode step's token as a device tensor (as the triton
    runner's static-buffer step): the engine launches the step before reading the token."""

    supports_device_tokens = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.piped = 0

    def forward(self, batch, all_logits=False, on_device=False, tokens_on_device=None):
        if tokens_on_device is not None:
            assert [t for _, t in batch] == [[0]] * len(batch)   # placeholders
            batch = [(sid, [int(t)]) for (sid, _), t in zip(batch, tokens_on_device.tolist())]
            self.piped += 1
        return super().forward(batch, all_logits, on_device)


@pytest.mark.parametrize("kw", [
    dict(), dict(stop=("o wo",)), dict(stop=("world😀",)), dict(max_tokens=3), dict(max_tokens=1),
    dict(max_tokens=2), dict(repeat_penalty=1.3, presence_penalty=0.5),
    dict(json_schema={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                              "maximum": 99}},
                      "required": ["n"]}, max_tokens=40),
    dict(json_object=True, max_tokens=6)])
def test_pipelined_steps_give_the_same_stream_and_a_consistent_cache(kw, monkeypatch):
    """A step launched with its token still on the device (Sampler.launch, read after the
    launch): the events, text, finish reason and tokens are those of the plain loop (penalties
    included: the device counts see every token); the engine's record of the cached tokens
    matches the runner's, which hold one spent step after an end token or a stop string and
    none past the budget; under a grammar the masks are those of the plain loop.
    LOCALMOE_PIPELINE=0 turns it off."""
    if "json_schema" in kw or "json_object" in kw:
        pytest.importorskip("llguidance")
    monkeypatch.setenv("LOCALMOE_DEVICE_SAMPLING", "1")   # the device path on these CPU logits
    piped = LLM.from_parts(PipeRunner(), FakeTokenizer(), model_name="fake")
    out, held = _same_stream_as_plain(piped, kw)
    assert out[0] == out[1]
    n = len(out[0][3])
    assert piped.runner.piped == max(0, n - 1) + (out[0][2] == "stop" and n < (
        kw.get("max_tokens") or 10 ** 9))
    assert held[1] == held[0] + (out[0][2] == "stop")
    for off in ("0", "false", "Off"):   # the on/off words of every LOCALMOE_* switch
        monkeypatch.setenv("LOCALMOE_PIPELINE", off)
        piped.runner.piped = 0
        assert piped.generate("x", temperature=0, **kw).text == out[0][1]
        assert piped.runner.piped == 0


def test_forward_ahead_cancel_and_close(monkeypatch):
    monkeypatch.delenv("LOCALMOE_DEVICE_SAMPLING", raising=False)
    llm = LLM.from_parts(DeviceRunner(chain={}, default_next=9), FakeTokenizer(),
                         model_name="fake")
    cancel = threading.Event()
    n, result = 0, None
    for ev in llm.generate("x", temperature=0, stream=True, cancel=cancel):
        if ev.done:
            result = ev.result
            break
        n += 1
        if n == 3:
            cancel.set()
    assert result.finish_reason == "cancelled" and result.completion_tokens == 3
    it = llm.generate("x", temperature=0, stream=True)
    next(it)
    it.close()
    (seq,) = llm.runner.seqs.values()
    assert llm._cached == seq
    r = llm.generate("x", temperature=0, max_tokens=2)
    assert r.completion_tokens == 2 and r.text == " the the"


def test_a_model_argument_is_optional_and_none_is_explained_by_the_engine():
    """``LLM()`` means the default model, as ``LLM(None)`` (it raised a TypeError naming the
    internal class); the bare engine, which opens paths only, says what it needs."""
    import inspect

    from localmoe.engine.engine import Engine

    assert inspect.signature(LLM).parameters["model"].default is None
    with pytest.raises(InvalidRequestError, match="model must be a ModelFile or the path"):
        Engine()


@pytest.mark.parametrize("model", [5, 1.5, b"m.gguf", ["m.gguf"], {"name": "smollm2"}])
def test_a_model_that_is_no_path_or_name_is_refused_before_any_lookup(model, monkeypatch):
    """``LLM(5)`` was looked up in the store as the model name '5' ("no model named '5'");
    a model argument that is neither a str/PathLike (nor a ModelFile, nor None) is an
    InvalidRequestError naming ``model`` and what it must be, before the store is asked."""
    import localmoe.io.store as store

    def no_lookup(*a, **k):
        raise AssertionError("the store was asked")
    monkeypatch.setattr(store, "resolve_model", no_lookup)
    with pytest.raises(InvalidRequestError) as ei:
        LLM(model)
    assert ei.value.param == "model", ei.value
    msg = str(ei.value)
    assert msg.startswith("model must be a path or a model name") and type(model).__name__ in msg
    assert "no model named" not in msg


def test_wrong_argument_types_are_request_errors():
    """Arguments of the wrong type get a LocalMoEError naming the argument, not an
    AttributeError/TypeError from inside (fresh-user finding)."""
    llm = make_llm()
    cases = [lambda: llm.generate("x", params="x"), lambda: llm.generate("x", params={"a": 1}),
             lambda: llm.count_tokens(None), lambda: llm.count_tokens(["a"]),
             lambda: llm.chat_stream([{"role": "user", "content": "hi"}], tools=5),
             lambda: llm.generate("x", stream="yes"), lambda: llm.close("x")]
    for case in cases:
        with pytest.raises(InvalidRequestError):
            case()
    assert llm.count_tokens("x") >= 1 and not llm.runner.closed


BROKEN_TEMPLATE = "{% for m in messages %}{{ m.content }"   # Jinja: unexpected '}'


def test_a_chat_template_that_does_not_compile_loads_for_plain_completions(tmp_path, caplog):
    """A model whose embedded chat template has a syntax error could not be loaded at all
    (LLM raised the TemplateError), not even for a raw completion: it loads with one warning
    naming the error; raw generation works; chat, generate(raw=False) and render_chat raise
    the same TemplateError (a LocalMoEError) loading used to."""
    import logging

    from localmoe.errors import TemplateError
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "bad.gguf", "tiny-llama", chat_template=BROKEN_TEMPLATE)
    with caplog.at_level(logging.WARNING):
        llm = LLM(path, backend="torch", n_ctx=64)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert warned[0].startswith("bad: the chat template has a syntax error at line 1: "
                                "unexpected '}'") and "plain completions work" in warned[0]
    try:
        r = llm.generate("hello", raw=True, max_tokens=3, temperature=0)
        assert r.completion_tokens == 3
        want = "the chat template has a syntax error at line 1: unexpected '}'"
        msgs = [{"role": "user", "content": "hi"}]
        for call in (lambda: llm.chat(msgs, max_tokens=2),
                     lambda: llm.chat(msgs, max_tokens=2, stream=True),
                     lambda: llm.generate("hi", raw=False, max_tokens=2),
                     lambda: llm.chat_stream(msgs),
                     lambda: llm.render_chat(msgs)):
            with pytest.raises(TemplateError) as e:
                out = call()
                if not isinstance(out, (str, dict)):
                    next(iter(out))   # a stream raises when first advanced at the latest
            assert isinstance(e.value, LocalMoEError) and str(e.value) == want
        # the engine still works after the refusals
        assert llm.generate("hello", max_tokens=2, temperature=0).completion_tokens == 2
    finally:
        llm.close()


def test_a_tool_use_template_that_does_not_compile_is_dropped_with_a_warning(tmp_path, caplog):
    """A broken ``tokenizer.chat_template.tool_use`` variant stopped the load too: the model
    loads with the default template (chat with and without tools works) and one warning."""
    import logging

    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    mf = open_model(write_gguf(tmp_path / "t.gguf", "tiny-llama"))
    mf.metadata["tokenizer.chat_template.tool_use"] = BROKEN_TEMPLATE
    with caplog.at_level(logging.WARNING):
        llm = LLM(mf, backend="torch", n_ctx=128)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "tool-use variant" in warned[0] and "line 1" in warned[0], warned
    try:
        assert llm.template.tool_source is None and llm.template.tool_error
        msgs = [{"role": "user", "content": "hi"}]
        assert "<|im_start|>user\nhi" in llm.render_chat(msgs)
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        assert llm.tokenizer.decode(llm.prompt_ids(messages=msgs, tools=[tool])).endswith(
            llm.render_chat(msgs))   # the default template, which ignores tools
    finally:
        llm.close()


def test_good_and_missing_chat_templates_load_without_a_warning(tmp_path, caplog):
    import logging

    from localmoe.text.chat_template import ChatTemplate
    from localmoe.testing.synthetic import write_gguf

    good = write_gguf(tmp_path / "good.gguf", "tiny-llama")
    base = write_gguf(tmp_path / "base.gguf", "tiny-llama", chat_template=None)
    with caplog.at_level(logging.WARNING):
        a, b = LLM(good, backend="torch", n_ctx=64), LLM(base, backend="torch", n_ctx=64)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    try:
        assert type(a.template) is ChatTemplate and b.template is None
        assert a.render_chat([{"role": "user", "content": "hi"}]).startswith("<|im_start|>")
        assert b.render_chat([{"role": "user", "content": "hi"}]) == "User: hi\nAssistant:"
    finally:
        a.close()
        b.close()
