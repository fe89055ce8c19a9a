"""Where the generated text ends when generation is cut inside a multi-byte character."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from localmoe.api import LLM

from tests.engine.test_engine import BYTE0, EOS, FakeRunner, FakeTokenizer, X

# "x" -> "Hel" "lo" then the euro sign's three bytes one token each, then EOS
EURO = [BYTE0 + b for b in "€".encode()]
CHAIN = {X: 2, 2: 3, 3: EURO[0], EURO[0]: EURO[1], EURO[1]: EURO[2], EURO[2]: EOS}


@pytest.mark.parametrize("max_tokens,text", [(2, "Hello"), (3, "Hello"), (4, "Hello"),
                                             (5, "Hello€"), (None, "Hello€")])
def test_cut_inside_a_character_ends_at_the_last_whole_one(max_tokens, text):
    llm = LLM.from_parts(FakeRunner(chain=CHAIN), FakeTokenizer())
    r = llm.generate("x", temperature=0, max_tokens=max_tokens)
    assert r.text == text and "\ufffd" not in r.text
    evs = list(llm.generate("x", temperature=0, max_tokens=max_tokens, stream=True))
    assert "".join(e.delta for e in evs) == text
    assert evs[-1].result.completion_tokens == (max_tokens or 6)


def test_context_end_and_cancel_inside_a_character():
    import threading

    llm = LLM.from_parts(FakeRunner(chain=CHAIN, n_ctx=5), FakeTokenizer())  # 2 prompt tokens
    r = llm.generate("x", temperature=0)
    assert r.finish_reason == "length" and r.text == "Hello"  # cut after the euro's first byte
    llm = LLM.from_parts(FakeRunner(chain=CHAIN), FakeTokenizer())
    cancel = threading.Event()
    out = []
    for ev in llm.generate("x", temperature=0, stream=True, cancel=cancel):
        out.append(ev)
        if ev.delta == "lo":
            cancel.set()  # stops after the next token (the euro's first byte)
    assert out[-1].result.finish_reason == "cancelled"
    assert "\ufffd" not in out[-1].result.text


@pytest.mark.slow
@pytest.mark.llamacpp
def test_generate_json_never_ends_in_a_replacement_character(smollm2_path):
    """The reported case: `generate --json -n N` cutting an emoji's bytes showed U+FFFD. Greedy
    SmolLM2 answers "I love I love I love 🍕 ..." with the pizza's 4 bytes in 3 tokens (7-9)."""
    prompt = "Repeat exactly: I love 🍕 I love 🍕 I love 🍕"
    for n, want in ((7, "I love I love I love"), (8, "I love I love I love"),
                    (9, "I love I love I love 🍕")):
        r = subprocess.run([sys.executable, "-m", "localmoe", "generate", "-m", str(smollm2_path),
                            "--backend", "llamacpp", "--greedy", "-n", str(n), "--json", prompt],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        assert d["completion_tokens"] == n and d["text"].strip() == want, (n, d["text"])
