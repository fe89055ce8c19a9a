"""Constrained decoding on our own vocabularies (localmoe.text.grammar): the masks of JSON
schemas and tool calls on SmolLM2 (byte-level BPE) and Gemma-3 (SentencePiece) tokenizers,
schema errors naming the keyword, the compile cache and timeout."""

from __future__ import annotations

import json

import numpy as np
import pytest

from localmoe.errors import InvalidRequestError
from localmoe.text import grammar as g
from localmoe.text.tool_calls import parse_tool_calls

pytest.importorskip("llguidance")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tok(request, smollm2_path, gemma3_path):
    from localmoe.io.loader import open_model
    from localmoe.text.tokenizer import Tokenizer

    path = smollm2_path if request.param == "smollm2" else gemma3_path
    return Tokenizer.from_model(open_model(path))


def _walk(tok, grammar, text: str):
    """Feed ``text``'s tokens through a fresh constraint; returns it (asserting each token
    was allowed)."""
    c = grammar.start()
    for t in tok.encode(text, add_special=False):
        allowed = c.allowed()
        assert allowed.shape == (tok.vocab_size,) and allowed.dtype == bool
        assert allowed[t], (text, tok.token_bytes(t))
        assert c.accept(t)
    return c


def _first_step_allows(tok, grammar, prefix: str, cont: str) -> bool:
    """Whether, after ``prefix``, the first token of ``cont`` (tokenized alone) is allowed."""
    c = _walk(tok, grammar, prefix)
    return bool(c.allowed()[tok.encode(cont, add_special=False)[0]])


def test_valid_json_passes_and_only_then_ends(tok):
    gr = g.Grammar.json_schema(tok, PERSON)
    text = '{"name": "Ann", "age": 31, "tags": ["b"]}'
    c = _walk(tok, gr, text)
    assert c.accepting and c.done
    ends = [i for i in tok.eog_ids if c.allowed()[i]]
    assert ends  # an end-of-generation token may follow a complete value
    c2 = _walk(tok, gr, '{"name": "Ann"')
    assert not c2.accepting
    assert not any(c2.allowed()[i] for i in tok.eog_ids)  # no ending inside the object


def test_invalid_continuations_are_masked(tok):
    gr = g.Grammar.json_schema(tok, PERSON)
    assert not _first_step_allows(tok, gr, '{"name": "Ann", "age": ', '"')  # integer, not string
    assert not _first_step_allows(tok, gr, '{"name": "Ann", "age": 3', ".")  # no fraction
    assert not _first_step_allows(tok, gr, '{"name": "Ann", "age": 31, "tags": ["', "c")  # enum
    # all properties given and the object closed: no more keys
    assert not _first_step_allows(tok, gr, '{"name": "Ann", "age": 31, "tags": []', ",")
    assert _first_step_allows(tok, gr, '{"name": "Ann", "age": 31', "}")
    # control tokens never match text
    c = _walk(tok, gr, '{"name": "')
    ctrl = sorted(tok.control_ids - set(tok.eog_ids))
    assert ctrl and not c.allowed()[ctrl].any()


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'),
])
def test_tool_call_grammar_in_each_syntax_parses(tok, fmt, text):
    gr = g.Grammar.tool_calls(tok, TOOLS, fmt=fmt, parallel=False)
    c = _walk(tok, gr, text)
    assert c.accepting
    if fmt != "mistral" or tok.token_to_id("[TOOL_CALLS]") is None:
        calls = parse_tool_calls(text, fmt, ["get_weather", "add"]).tool_calls
        assert len(calls) == 1 and calls[0].name in ("add", "get_weather")


def test_tool_call_grammar_refuses_undeclared_names_and_bad_arguments(tok):
    gr = g.Grammar.tool_calls(tok, TOOLS, fmt="hermes")
    head = '<tool_call>\n{"name": "'
    assert not _first_step_allows(tok, gr, head, "rm")
    assert _first_step_allows(tok, gr, head, "add")
    assert not _first_step_allows(tok, gr, head + 'add", "arguments": {"a": ', '"')
    named = g.Grammar.tool_calls(tok, TOOLS, fmt="hermes", name="get_weather", parallel=False)
    assert not _first_step_allows(tok, named, head, "add")
    # one call unless parallel: after the first block only an end token may follow
    one = _walk(tok, named, head + 'get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert one.done


@pytest.mark.parametrize("schema,needle", [
    ({"type": "array", "uniqueItems": True}, '"uniqueItems"'),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, '"not"'),
    ({"if": {}, "then": {}}, '"if", "then"'),
    ({"type": "strng"}, '"strng"'),
    ({"$ref": "#/$defs/missing"}, "/$defs/missing"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON Schema object"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
])
def test_bad_schemas_are_refused_naming_the_problem(tok, schema, needle):
    for check in (lambda: g.validate_schema(schema, True, "rf.schema"),
                  lambda: g.Grammar.json_schema(tok, schema, param="rf.schema")):
        with pytest.raises(InvalidRequestError) as ei:
            check()
        assert ei.value.param == "rf.schema" and needle in str(ei.value), str(ei.value)


@pytest.mark.parametrize("schema,needle", [
    ({"type": "string", "pattern": "(("}, 'regex parse error: unclosed group in pattern "(("'),
    ({"type": "object", "minProperties": 3, "properties": {"a": {"type": "string"}},
      "required": ["a"], "additionalProperties": False},
     "minProperties is greater than the number of properties the schema allows")])
def test_schema_errors_are_one_line(schema, needle):
    """A bad regex ended the message at 'regex parse error:' (its detail was on later
    lines); llguidance's minProperties numbers (required keys subtracted) misled."""
    with pytest.raises(InvalidRequestError) as ei:
        g.validate_schema(schema, True, "rf.schema")
    msg = str(ei.value)
    assert "\n" not in msg and needle in msg, msg


def test_self_referencing_ref_fails_in_one_line(tok):
    """A schema that only refers to itself compiles but allows no token: the error was two
    lines ending in llguidance's '<non-verbose/>' marker."""
    c = g.Grammar.json_schema(tok, {"$ref": "#"}).start()
    with pytest.raises(InvalidRequestError) as ei:
        c.allowed()
    msg = str(ei.value)
    assert "\n" not in msg and "non-verbose" not in msg and "$ref" in msg, msg


def test_non_strict_ignores_unsupported_keywords(tok):
    gr = g.Grammar.json_schema(tok, {"type": "array", "items": {"type": "integer"},
                                     "uniqueItems": True}, strict=False)
    assert _walk(tok, gr, "[1, 2]").accepting


def test_compile_is_cached_per_schema_and_fast(tok):
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 7}}}
    a = g.Grammar.json_schema(tok, schema)
    b = g.Grammar.json_schema(tok, json.dumps(schema))  # the same schema as text
    assert a is b
    assert a.compile_ms < 5000  # the 50 ms target is a benchmark (bench_grammar.py)
    c1, c2 = a.start(), a.start()  # independent states
    _walk(tok, a, '{"q": "x')
    assert c1.allowed().sum() == c2.allowed().sum()


def test_compile_over_the_time_limit_is_refused(tok, monkeypatch):
    """A compile still running after COMPILE_TIMEOUT_S is refused (the request does not wait
    for it); simulated by an engine whose compile takes 2 s."""
    import threading
    import time
    import types

    import llguidance

    release = threading.Event()

    class SlowMatcher:
        grammar_from_json_schema = staticmethod(llguidance.LLMatcher.grammar_from_json_schema)

        def __init__(self, *a, **k):
            release.wait(2.0)

    fake = types.SimpleNamespace(LLMatcher=SlowMatcher, LLParserLimits=llguidance.LLParserLimits,
                                 LLTokenizer=llguidance.LLTokenizer,
                                 TokenizerWrapper=llguidance.TokenizerWrapper)
    g.grammar_tokenizer(tok)  # built with the real engine
    monkeypatch.setattr(g, "_ll", lambda: fake)
    monkeypatch.setattr(g, "COMPILE_TIMEOUT_S", 0.2)
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError) as ei:
        g.Grammar.json_schema(tok, {"type": "object", "properties": {"slow": {}}}, param="rf")
    release.set()
    assert time.perf_counter() - t0 < 1.5
    assert "did not compile within 0.2 s" in str(ei.value) and ei.value.param == "rf"


def test_closed_objects_keeps_values_and_explicit_choices():
    s = {"type": "object", "properties": {"required": {"type": "object", "properties": {
        "x": {"enum": [{"properties": 1}]}}}}, "required": ["required"]}
    out = g.closed_objects(s)
    assert out["additionalProperties"] is False
    assert out["properties"]["required"]["additionalProperties"] is False
    assert out["properties"]["required"]["properties"]["x"] == {"enum": [{"properties": 1}]}
    assert out["required"] == ["required"]
    opened = {"type": "object", "properties": {}, "additionalProperties": True}
    assert g.closed_objects(opened) == opened
    assert s["properties"]["required"].get("additionalProperties") is None  # not mutated


def test_mask_matches_bits(tok):
    """The bool mask is the engine's bitmask unpacked in id order (bit i of word i // 32)."""
    gr = g.Grammar.json_schema(tok, {"enum": ["yes", "no"]})
    c = gr.start()
    allowed = c.allowed()
    bits = c._bits.view(np.uint32)
    for i in np.flatnonzero(allowed)[:50]:
        assert (int(bits[i // 32]) >> (i % 32)) & 1
    assert allowed.sum() < tok.vocab_size // 100  # only tokens starting '"', '"y', '"n'...


def test_markers_that_are_control_tokens_are_written_as_tokens(tok):
    """A tool-call marker that is one control token (Mistral's [TOOL_CALLS]) must be produced
    as that token: its text never matches a control token. Checked with a control token both
    vocabularies have."""
    marker = "<|im_start|>" if tok.token_to_id("<|im_start|>") is not None else "<start_of_turn>"
    tid = tok.token_to_id(marker)
    assert tok.is_control(tid)
    assert g.lark_literal(tok, marker) == f"<[{tid}]>"
    assert g.lark_literal(tok, "<tool_call>") == '"<tool_call>"'  # plain text in both
    c = g.Grammar.lark(tok, f'start: {g.lark_literal(tok, marker)} "x"\n').start()
    assert np.flatnonzero(c.allowed()).tolist() == [tid]


def test_numbers_get_at_most_six_fraction_digits(tok):
    gr = g.Grammar.json_schema(tok, {"type": "object", "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["x"]})
    assert _walk(tok, gr, '{"x": 12.345678}').accepting
    assert not _first_step_allows(tok, gr, '{"x": 12.345678', "9")  # a 7th digit
    assert not _first_step_allows(tok, gr, '{"x": 12', "e")  # no exponent
    exact = g.Grammar.json_schema(tok, {"type": "number", "multipleOf": 0.5})
    assert g.closed_objects({"type": "number", "multipleOf": 0.5}) == {"type": "number",
                                                                        "multipleOf": 0.5}
    assert _walk(tok, exact, "2.5").accepting


def test_allowed_bits_is_the_packed_mask(tok):
    """The packed mask the GPU sampler uploads: bit i % 32 of word i // 32 = allowed()[i],
    step after step, and it is a new array each time."""
    gr = g.Grammar.json_schema(tok, PERSON)
    a, b = gr.start(), gr.start()
    n_words = (tok.vocab_size + 31) // 32
    prev = None
    for t in tok.encode('{"name": "Al', add_special=False):
        bits = a.allowed_bits()
        assert bits.dtype == np.int32 and bits.shape == (n_words,)
        unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little")[: tok.vocab_size]
        assert np.array_equal(unpacked.astype(bool), b.allowed())
        assert prev is None or not np.array_equal(prev, bits)  # the mask does change
        prev = bits
        assert a.accept(t) and b.accept(t)


def test_an_engine_failure_on_an_allowed_token_is_an_error_not_a_stop(tok):
    """A pattern whose repetition needs more regex states than the engine's limit compiles
    and allows its opening quote, then fails on consuming it: that is a request error, not an
    output of one quote ended as if complete."""
    gr = g.Grammar.json_schema(tok, {"type": "string", "pattern": "^a{1000000}$"})
    c = gr.start()
    allowed = np.flatnonzero(c.allowed())
    assert len(allowed) >= 1
    with pytest.raises(InvalidRequestError, match="could not go on"):
        c.accept(int(allowed[0]))

