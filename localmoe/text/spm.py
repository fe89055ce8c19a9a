"""SentencePiece BPE with byte fallback, as llama.cpp runs it (``llm_tokenizer_spm_session``)."""

from __future__ import annotations

import heapq

__all__ = ["SpmModel"]


class SpmModel:
    """llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm_session``) on one fragment.

    Symbols start as the fragment's characters; the adjacent pair whose concatenation is a
    vocabulary entry with the highest score is merged first (leftmost on ties), until no pair
    merges. A final symbol outside the vocabulary becomes its UTF-8 bytes as ``<0xXX>`` tokens
    (byte fallback; the unknown token when the vocabulary has no byte tokens). This is exact
    (including score ties) and needs no build step, which matters for 256k-entry vocabularies:
    expressing it as ``tokenizers`` BPE merges took ~10 s per load.

    Args:
        tokens: vocabulary entries by id (U+2581 for spaces, ``<0xXX>`` byte tokens).
        scores: merge score of every entry (float, higher merges first).
        unk_id: id used for a byte the vocabulary has no ``<0xXX>`` token for, or None (the
            byte is then dropped).
    """

    def __init__(self, tokens: list[str], scores: list[float], unk_id: int | None):
        self.vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            self.vocab[t] = i
        self.scores = scores
        self.byte_ids = [self.vocab.get(f"<0x{b:02X}>") for b in range(256)]
        self.unk_id = unk_id

    def encode(self, text: str) -> list[int]:
        """Token ids of one raw fragment (spaces already U+2581, prefix space already added)."""
        vocab, scores = self.vocab, self.scores
        syms = list(text)
        n = len(syms)
        if n == 0:
            return []
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        heap: list = []
        push = heapq.heappush

        for i in range(n - 1):
            t = syms[i] + syms[i + 1]
            tid = vocab.get(t)
            if tid is not None:
                heap.append((-scores[tid], i, t))
        heapq.heapify(heap)
        pop = heapq.heappop
        while heap:
            _, left, t = pop(heap)
            right = nxt[left]
            if right < 0 or not syms[left] or syms[left] + syms[right] != t:
                continue  # stale
            syms[left] = t
            syms[right] = ""
            nr = nxt[right]
            nxt[left] = nr
            if nr >= 0:
                prev[nr] = left
            pl = prev[left]
            if pl >= 0:
                t2 = syms[pl] + t
                tid = vocab.get(t2)
                if tid is not None:
                    push(heap, (-scores[tid], pl, t2))
            if nr >= 0:
                t2 = t + syms[nr]
                tid = vocab.get(t2)
                if tid is not None:
                    push(heap, (-scores[tid], left, t2))
        out: list[int] = []
        i = 0
        while i >= 0:
            sym = syms[i]
            tid = vocab.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                for b in sym.encode("utf-8"):
                    bid = self.byte_ids[b]
                    if bid is None:
                        bid = self.unk_id
                    if bid is not None:
                        out.append(bid)
            i = nxt[i]
        return out
