"""Tool-call parser: hard cases per format, and streamed == one-shot for every split."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localmoe.text.tool_calls import (StreamingToolParser, ToolCall, detect_format, new_call_id,
                                      parse_tool_calls)


def stream_parse(text: str, cuts: list[int], fmt: str, names=None):
    """Feed text split at the given cut points; return (content, calls) as parse_tool_calls."""
    p = StreamingToolParser(fmt, names)
    events = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += p.push(text[prev:c])
        prev = c
    events += p.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "call"]
    return content, calls


def both(text, fmt="hermes", names=None):
    """One-shot result, after checking that char-by-char streaming agrees."""
    res = parse_tool_calls(text, fmt, names)
    s_content, s_calls = stream_parse(text, list(range(len(text))), fmt, names)
    assert s_content == res.content
    assert s_calls == res.tool_calls
    return res


# ------------------------------------------------------------------------------ hermes

def test_hermes_single_call_with_braces_and_quotes_in_strings():
    code = 'if (x) { print("}") } else { s = "</tool_call>" }'
    text = ('<tool_call>\n' + json.dumps({"name": "run", "arguments": {"code": code}})
            + '\n</tool_call>')
    res = both(text)
    assert res.content == ""
    assert res.tool_calls == [ToolCall("run", json.dumps({"code": code}, ensure_ascii=False))]


def test_hermes_several_calls_text_before_and_after_nested():
    text = ('Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "opts": {"units": "C", "days": [1, 2]}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>\n'
            'Done.')
    res = both(text)
    assert res.content == "Let me check both.Done."
    assert [c.name for c in res.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(res.tool_calls[0].arguments) == {
        "city": "Paris", "opts": {"units": "C", "days": [1, 2]}}


def test_hermes_invalid_json_stays_content():
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call> bye'
    res = both(text)
    assert res.tool_calls == []
    assert res.content == text


def test_hermes_truncated_json_stays_content():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": "unterminated'
    res = both(text)
    assert res.tool_calls == []
    assert res.content == text


def test_hermes_missing_close_tag_at_end_or_before_next_call():
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n'
            '<tool_call>\n{"name": "b", "arguments": {"x": 1}}')
    res = both(text)
    assert [c.name for c in res.tool_calls] == ["a", "b"]
    assert res.content == ""
    res = both('<tool_call>{"name": "a", "arguments": {}}</tool_')
    assert [c.name for c in res.tool_calls] == ["a"] and res.content == ""


def test_hermes_json_without_name_or_followed_by_garbage_is_content():
    for text in ['<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "a", "arguments": {}} oops </tool_call>',
                 '<tool_call>not json</tool_call>',
                 '<tool_call>[1, 2]</tool_call>']:
        res = both(text)
        assert res.tool_calls == [] and res.content == text, text


def test_hermes_arguments_string_and_parameters_key_and_unicode():
    res = both('<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"caf\\u00e9 ☕\\"}"}</tool_call>')
    assert res.tool_calls == [ToolCall("f", '{"q": "café ☕"}')]
    res = both('<tool_call>{"name": "f", "parameters": {"n": 2}}</tool_call>')
    assert res.tool_calls == [ToolCall("f", '{"n": 2}')]
    res = both('<tool_call>{"name": "f"}</tool_call>')
    assert res.tool_calls == [ToolCall("f", "{}")]


def test_hermes_plain_text_with_angle_brackets_is_untouched():
    text = "a < b and <tool> is not <tool_call but x<tool_cal"
    res = both(text)
    assert res.content == text and res.tool_calls == []


# ------------------------------------------------------------------------------ llama3

def test_llama3_bare_json_and_python_tag_and_semicolons():
    res = both('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "llama3")
    assert res.tool_calls == [ToolCall("get_weather", '{"city": "Oslo"}')]
    assert res.content == ""
    res = both('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": "}"}}',
               "llama3")
    assert res.tool_calls == [ToolCall("a", "{}"), ToolCall("b", '{"k": "}"}')]
    assert res.content == ""


def test_llama3_text_around_and_non_call_json_stays_content():
    text = ('The config is {"debug": true, "name": "x"} and then '
            '{"name": "lookup", "parameters": {"q": "{nested}"}} thanks')
    res = both(text, "llama3")
    assert res.tool_calls == [ToolCall("lookup", '{"q": "{nested}"}')]
    assert res.content == 'The config is {"debug": true, "name": "x"} and thenthanks'


def test_llama3_tool_name_filter_and_nested_lookalike():
    text = '{"name": "not_a_tool", "parameters": {}}'
    assert both(text, "llama3", ["real"]).tool_calls == []
    assert both(text, "llama3", ["real"]).content == text
    # a call-shaped object nested inside another object is data, not a call
    text = '{"example": {"name": "real", "parameters": {}}}'
    res = both(text, "llama3", ["real"])
    assert res.tool_calls == [] and res.content == text


def test_llama3_truncated_stays_content():
    text = '{"name": "real", "parameters": {"a": [1, 2'
    res = both(text, "llama3")
    assert res.tool_calls == [] and res.content == text


# ------------------------------------------------------------------------------ mistral

def test_mistral_v3_array_and_v11_forms():
    res = both('[TOOL_CALLS][{"name": "a", "arguments": {"x": "]["}}, {"name": "b", "arguments": {}}]',
               "mistral")
    assert res.tool_calls == [ToolCall("a", '{"x": "]["}'), ToolCall("b", "{}")]
    res = both('I will call.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]t[CALL_ID]abc123[ARGS]{}',
               "mistral")
    assert res.content == "I will call."
    assert res.tool_calls == [ToolCall("get_weather", '{"city": "Rome"}'), ToolCall("t", "{}")]


def test_mistral_invalid_and_truncated_stay_content():
    for text in ['[TOOL_CALLS][{"name": "a", "arguments": {]',
                 '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}',
                 '[TOOL_CALLS]get weather[ARGS]{}',
                 '[TOOL_CALLS][{"nom": "a"}]']:
        res = both(text, "mistral")
        assert res.tool_calls == [] and res.content == text, text


# ------------------------------------------------------------------------------ streaming

def test_streaming_emits_content_early_and_calls_when_complete():
    p = StreamingToolParser("hermes")
    assert p.push("Hello wor") == [("content", "Hello wor")]
    assert p.push("ld <tool") == [("content", "ld")]  # " <tool" held: may be a marker
    assert p.push('_call>{"name": "f", "arguments": {"a"') == []
    ev = p.push(': 1}}</tool_call>')
    assert ev == [("call", ToolCall("f", '{"a": 1}'))]
    assert p.push("\nafter") == [("content", "after")]
    assert p.finish() == []


def test_streaming_long_arguments_is_linear_enough():
    big = "x" * 200_000
    text = '<tool_call>{"name": "w", "arguments": {"s": "' + big + '"}}</tool_call>'
    p = StreamingToolParser("hermes")
    ev = []
    for i in range(0, len(text), 7):
        ev += p.push(text[i:i + 7])
    ev += p.finish()
    assert ev == [("call", ToolCall("w", json.dumps({"s": big})))]


CASES = [
    ("hermes", 'Hi.\n<tool_call>\n{"name": "a", "arguments": {"s": "}\\"{"}}\n</tool_call>\n'
               '<tool_call>{"name": "b", "arguments": {}}</tool_call> end <tool_call>{bad}</tool_call>'),
    ("hermes", 'x <tool_call>{"name": "a", "arguments": {"n": [1, {"m": 2}]}}'),
    ("llama3", 'pre {"k": 1} {"name": "a", "parameters": {"z": "{"}}; {"name": "b", "parameters": {}} post {"unclosed'),
    ("mistral", 'a [TOOL_CALLS][{"name": "a", "arguments": {}}] b [TOOL_CALLS]c[ARGS]{"q": 1} [TOOL_CALLS]x'),
]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_equals_one_shot_for_random_splits(case, cuts):
    fmt, text = case
    res = parse_tool_calls(text, fmt)
    content, calls = stream_parse(text, [c for c in cuts if c <= len(text)], fmt)
    assert content == res.content
    assert calls == res.tool_calls


def test_cases_parse_to_expected_calls():
    assert [c.name for c in parse_tool_calls(CASES[0][1]).tool_calls] == ["a", "b"]
    assert [c.name for c in parse_tool_calls(CASES[2][1], "llama3").tool_calls] == ["a", "b"]
    assert [c.name for c in parse_tool_calls(CASES[3][1], "mistral").tool_calls] == ["a", "c"]


def test_detect_format():
    assert detect_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_format("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert detect_format("<|start_header_id|>ipython{% if tools %}{% endif %}") == "llama3"
    assert detect_format("<|python_tag|>") == "llama3"
    assert detect_format(None) == "hermes"


def test_unknown_format_rejected():
    with pytest.raises(ValueError):
        StreamingToolParser("nope")


def test_call_ids_fit_the_format():
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())
    ids = {new_call_id("mistral") for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
