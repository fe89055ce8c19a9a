"""StopChecker: end-of-generation tokens, stop strings spanning deltas, hold-back and flush."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localmoe.text.stopping import StopChecker


def _run(checker, deltas):
    """Feed deltas like the engine does; returns (emitted pieces, stopped)."""
    out = []
    for d in deltas:
        emit, stopped = checker.push_text(d)
        out.append(emit)
        if stopped:
            return out, True
    out.append(checker.flush())
    return out, False


def test_eog_tokens():
    c = StopChecker((), eog_ids={2, 106})
    assert c.push_token(5) is False and not c.stopped
    assert c.push_token(106) is True
    assert c.stopped and c.reason == "eog" and c.matched == 106


def test_stop_string_split_across_deltas_never_emitted():
    c = StopChecker(["</answer>"], ())
    pieces, stopped = _run(c, ["The result", " is 42<", "/ans", "wer> and more"])
    assert stopped and "".join(pieces) == "The result is 42"
    assert pieces == ["The result", " is 42", "", ""]
    assert c.reason == "stop_string" and c.matched == "</answer>"
    assert c.push_text("later") == ("", True)
    assert c.flush() == ""


def test_false_prefix_is_released():
    c = StopChecker(["STOP"], ())
    assert c.push_text("go ST") == ("go ", False)
    assert c.held == "ST"
    assert c.push_text("ART") == ("START", False)
    assert c.push_text("S") == ("", False)
    assert c.flush() == "S"  # generation ended otherwise: held text is flushed
    assert c.held == ""


def test_earliest_stop_wins_and_overlaps():
    c = StopChecker(["world", "lo w"], ())
    assert c.push_text("hello world") == ("hel", True)
    assert c.matched == "lo w"
    c = StopChecker(["ab", "abc"], ())
    assert c.push_text("xxabc") == ("xx", True) and c.matched == "abc"


def test_stop_at_start_and_single_char():
    assert StopChecker(["\n"], ()).push_text("\nrest") == ("", True)
    c = StopChecker(["\n\n"], ())
    assert c.push_text("a\n") == ("a", False)
    assert c.push_text("b") == ("\nb", False)


def test_no_stop_strings_passes_through():
    c = StopChecker((), ())
    assert c.push_text("anything") == ("anything", False)
    assert c.flush() == ""
    assert StopChecker("END", ()).stop_strings == ("END",)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab<>/ \n", max_size=40),
    stops=st.lists(st.text(alphabet="ab<>/ \n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
)
def test_stream_equals_one_shot(text, stops, cuts):
    """Any split of the text gives the same output as the whole text at once: the text before
    the earliest stop string, or everything when none occurs. No stop text is ever emitted."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    streamed, stopped = _run(StopChecker(stops, ()), deltas)
    one, one_stopped = _run(StopChecker(stops, ()), [text])
    assert "".join(streamed) == "".join(one) and stopped == one_stopped
    hits = [text.find(s) for s in stops if s in text]
    expected = text[: min(hits)] if hits else text
    assert "".join(streamed) == expected and stopped == bool(hits)
    emitted = ""
    for piece in streamed:
        emitted += piece
        assert not any(s in emitted for s in stops)
