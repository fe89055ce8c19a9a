"""Byte forms of vocabulary entries: GPT-2's byte-level alphabet, SentencePiece spaces, byte tokens.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``, most ``tokenizer.json`` files)
spell every byte as one printable character (:func:`bytes_to_unicode`, GPT-2's table);
SentencePiece vocabularies write a space as U+2581 (:data:`SPM_SPACE`) and a byte-fallback
token as ``<0xXX>``. These helpers turn a stored entry back into the bytes it stands for.
"""

from __future__ import annotations

__all__ = ["bytes_to_unicode", "BYTE_ENCODER", "BYTE_DECODER", "SPM_SPACE",
           "byte_level_to_bytes", "parse_byte_token"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table (256 entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_ENCODER = bytes_to_unicode()  # byte (int) -> its character in byte-level vocabularies
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}
SPM_SPACE = "\u2581"  # SentencePiece's space marker


def byte_level_to_bytes(text: str) -> bytes:
    """Undo GPT-2's byte-to-unicode mapping (characters outside the table are kept as UTF-8)."""
    out = bytearray()
    for ch in text:
        b = BYTE_DECODER.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def parse_byte_token(text: str) -> int | None:
    """``"<0x0A>"`` -> 10, anything else -> None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None
