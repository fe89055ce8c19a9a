"""The tiny byte-level BPE tokenizer synthetic model files carry (GGUF ``gpt2`` model) and
their ChatML chat template.

:func:`build_tokenizer` learns its merges from a built-in English text (deterministic), so
llama.cpp, ``tokenizers`` and localmoe's own tokenizer all accept the files it goes into.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from localmoe.text.bytelevel import bytes_to_unicode  # GPT-2 byte -> unicode table

__all__ = ["CHATML_TEMPLATE", "SPECIALS", "Tokenizer", "build_tokenizer"]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Own English text the tiny BPE vocabulary is learned from (deterministic merges).
_BPE_TEXT = """
The quick brown fox jumps over the lazy dog. A mixture of experts model routes every token to a
few experts chosen by a small router network, and only those experts run for that token. This
keeps the compute per token low while the total number of parameters stays large. The model
reads the prompt, then writes one token at a time; each new token attends to all the tokens
before it through the key and value cache. When the cache is quantized to a few bits per value,
more tokens fit in the same memory, and the answer should stay the same. Tests compare the
logits of this program with the logits of another program on the same file, position by
position, and they agree when the code is right. Hello world! It is 2025 and the weather is
fine; there are 7 days in a week, 24 hours in a day and 60 minutes in an hour. Please answer the
question in one short sentence, then stop.
"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class Tokenizer:
    """A byte-level BPE vocabulary (GGUF ``gpt2`` model).

    Attributes:
        tokens: token strings (byte-unicode encoded), id = index.
        token_types: GGUF token types (1 normal, 3 control).
        merges: ``"a b"`` merge rules, highest priority first.
        bos_id, eos_id, pad_id, im_start_id, im_end_id: special ids.
    """

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int
    im_start_id: int
    im_end_id: int


def build_tokenizer(n_merges: int = 200, vocab_size: int | None = None) -> Tokenizer:
    """Learn ``n_merges`` BPE merges from the built-in text; optionally pad to ``vocab_size``.

    Padding tokens are plain ASCII strings ``[pad<i>]`` (normal tokens that no merge produces).
    Specials follow the merges: ``<|endoftext|>`` (bos/pad), ``<|im_start|>``, ``<|im_end|>``
    (eos), typed control (3).
    """
    b2u = bytes_to_unicode()
    byte_tokens = [b2u[b] for b in range(256)]
    words = re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", _BPE_TEXT)
    counts = Counter("".join(b2u[b] for b in w.encode("utf-8")) for w in words)
    seqs = {w: list(w) for w in counts}
    merges: list[str] = []
    vocab = list(byte_tokens)
    known = set(vocab)
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in counts.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]  # deterministic tie-break
        a, b = best
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in known:
            vocab.append(merged)
            known.add(merged)
        for w, s in seqs.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    types = [1] * len(vocab)
    n_base = len(vocab)
    if vocab_size is not None:
        need = vocab_size - n_base - len(SPECIALS)
        if need < 0:
            raise ValueError(f"vocab_size {vocab_size} < {n_base + len(SPECIALS)} base tokens")
        vocab += [f"[pad{i}]" for i in range(need)]
        types += [1] * need
    first_special = len(vocab)
    vocab += SPECIALS
    types += [3] * len(SPECIALS)
    eot, ims, ime = first_special, first_special + 1, first_special + 2
    return Tokenizer(vocab, types, merges, bos_id=eot, eos_id=ime, pad_id=eot, im_start_id=ims, im_end_id=ime)
