"""IncrementalDetokenizer: valid UTF-8 deltas, no lost spaces, deltas concatenate to decode()."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from localmoe.text.detokenizer import IncrementalDetokenizer
from localmoe.text.tokenizer import Tokenizer

from tests.text.test_tokenizer import HARD_STRINGS


def _load(path):
    from localmoe.io.loader import open_model

    return Tokenizer.from_model(open_model(path))


@pytest.fixture(scope="module")
def smollm_tok(smollm2_path):
    return _load(smollm2_path)


@pytest.fixture(scope="module")
def gemma_tok(gemma3_path):
    return _load(gemma3_path)


@pytest.fixture(params=["smollm_tok", "gemma_tok"])
def tok(request):
    return request.getfixturevalue(request.param)


def _stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    deltas = [d.push(i) for i in ids]
    deltas.append(d.flush())
    return deltas


def _assert_valid(deltas):
    for delta in deltas:
        assert isinstance(delta, str)
        delta.encode("utf-8")  # no lone surrogates
        assert "\ufffd" not in delta


@pytest.mark.parametrize("s", HARD_STRINGS)
def test_stream_equals_decode_bank(tok, s):
    ids = tok.encode(s, add_special=False)
    deltas = _stream(tok, ids)
    _assert_valid(deltas)
    assert "".join(deltas) == tok.decode(ids) == s


def test_multibyte_characters_are_held_back(tok):
    """Some token of these strings ends inside a UTF-8 sequence: its push returns '' (or only
    the complete part) and the character arrives whole with a later token."""
    s = "👨‍👩‍👧‍👦 🏳️‍🌈 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 數據 ⅷ 🧬🦀"
    ids = tok.encode(s, add_special=False)
    partial = [i for i in ids if _incomplete(tok.token_bytes(i))]
    assert partial, "expected at least one token holding a partial UTF-8 sequence"
    deltas = _stream(tok, ids)
    _assert_valid(deltas)
    assert "".join(deltas) == s
    assert "" in deltas[:-1]


def _incomplete(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_spaces_are_not_lost(gemma_tok):
    s = " a  b   c\t d \n e "
    ids = gemma_tok.encode(s, add_special=False)
    deltas = _stream(gemma_tok, ids)
    assert "".join(deltas) == s
    # every SentencePiece "\u2581word" piece contributes its space in its own delta
    assert any(d.startswith(" ") and len(d) > 1 for d in deltas)


def test_invalid_bytes_become_replacement_like_decode(gemma_tok):
    b = gemma_tok.token_to_id
    ids = [b("<0xFF>"), b("<0xE4>"), b("<0xB8>"), b("a") or b("<0x61>"), b("<0xF0>")]
    deltas = _stream(gemma_tok, ids)
    assert "".join(deltas) == gemma_tok.decode(ids)
    assert "".join(deltas).count("\ufffd") >= 3
    assert deltas[-1] == "\ufffd"  # the dangling F0 is only resolved at flush


def test_skip_special(gemma_tok):
    ids = gemma_tok.encode("<start_of_turn>hi", parse_special=True)
    assert "".join(_stream(gemma_tok, ids)) == "<bos><start_of_turn>hi"
    assert "".join(_stream(gemma_tok, ids, skip_special=True)) == "hi"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60),
       which=st.sampled_from(["smollm_tok", "gemma_tok"]))
def test_stream_property(request, s, which):
    tok = request.getfixturevalue(which)
    assume(tok.is_lossless(s))
    ids = tok.encode(s, add_special=False)
    deltas = _stream(tok, ids)
    _assert_valid(deltas)
    assert "".join(deltas) == s


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40))
def test_random_ids_stream_equals_decode(smollm_tok, ids):
    """Arbitrary id sequences (invalid UTF-8 included): concatenation == decode, never raises."""
    deltas = _stream(smollm_tok, ids)
    assert "".join(deltas) == smollm_tok.decode(ids)
    for d in deltas:
        d.encode("utf-8")
