"""JSON extent scanner: strings, escapes, nesting, resuming, mismatched brackets."""

from __future__ import annotations

import json

from localmoe.text.json_scan import scan_json


def test_scan_json_strings_escapes_nesting():
    s = 'x{"a": "}{\\"]", "b": [1, {"c": "\\\\"}]} tail'
    res, end, _ = scan_json(s, 1)
    assert res == "done"
    assert json.loads(s[1:end]) == {"a": '}{"]', "b": [1, {"c": "\\"}]}
    assert s[end:] == " tail"


def test_scan_json_incomplete_and_resume():
    s = '{"a": "x\\'
    res, end, state = scan_json(s, 0)
    assert res == "incomplete"
    s2 = s + '"y"}'
    res, end, _ = scan_json(s2, 0, state)
    assert res == "done" and json.loads(s2[:end]) == {"a": 'x"y'}


def test_scan_json_mismatched_bracket():
    assert scan_json('{"a": [1}', 0)[0] == "invalid"
    assert scan_json("abc", 0)[0] == "invalid"
