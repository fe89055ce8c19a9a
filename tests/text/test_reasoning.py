"""ReasoningSplitter: a leading <think> block split off, the same for every split of the text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localmoe.text.reasoning import ReasoningSplitter


def split_reasoning(text: str, cuts, start_in_think=False) -> tuple[str, str]:
    sp = ReasoningSplitter(start_in_think)
    ev, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        ev += sp.push(text[prev:c])
        prev = c
    ev += sp.finish()
    return ("".join(t for k, t in ev if k == "reasoning"), "".join(t for k, t in ev if k == "content"))


REASONING_CASES = [
    ("<think>\nThe user wants weather.\nCall the tool.\n</think>\n\nSure <b>x</b>", False,
     ("The user wants weather.\nCall the tool.", "Sure <b>x</b>")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("no thinking here <think>x</think>", False, ("", "no thinking here <think>x</think>")),
    ("<thi", False, ("", "<thi")),
    ("<think>cut off by max_tok", False, ("cut off by max_tok", "")),
    ("\nreasoning first</think>\n\nanswer", True, ("reasoning first", "answer")),
    ("<think>\n\n</think>\n\nanswer </thin", False, ("", "answer </thin")),
    ("", False, ("", "")),
]


@pytest.mark.parametrize("text,opened,expected", REASONING_CASES)
def test_reasoning_splitter_cases_every_split(text, opened, expected):
    assert split_reasoning(text, [], opened) == expected
    assert split_reasoning(text, list(range(len(text))), opened) == expected


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(REASONING_CASES), cuts=st.lists(st.integers(0, 80), max_size=8))
def test_reasoning_splitter_random_splits(case, cuts):
    text, opened, expected = case
    assert split_reasoning(text, [c for c in cuts if c <= len(text)], opened) == expected


def test_reasoning_streams_before_the_block_closes():
    sp = ReasoningSplitter()
    assert sp.push("<think>\nstep one") == [("reasoning", "step one")]
    assert sp.push(" and two </th") == [("reasoning", " and two")]
    assert sp.push("ink>\n\nHi") == [("content", "Hi")]
