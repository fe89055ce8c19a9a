"""Which codec class stores each KV format: an explicit table, extensible with :func:`register_codec`.

The float formats are :class:`~localmoe.kv.codec.FloatCodec`, the quantized ones
:class:`~localmoe.kv.quant_codec.QuantCodec`. The table is written out here (no codec registers
itself on import), so looking a format up never depends on what was imported before.
"""

from __future__ import annotations

from localmoe.errors import KVCacheFormatError
from localmoe.kv.codec import FloatCodec
from localmoe.kv.formats import FLOAT_FORMATS, QUANT_FORMATS
from localmoe.kv.quant_codec import QuantCodec

__all__ = ["register_codec", "get_codec_class"]

_CODECS: dict[str, type] = {**{name: FloatCodec for name in FLOAT_FORMATS},
                            **{name: QuantCodec for name in QUANT_FORMATS}}


def register_codec(name: str, cls: type) -> None:
    """Register ``cls`` (a :class:`~localmoe.kv.codec.KVCodec` subclass) as the storage of
    format ``name`` (replacing the built-in one, if any)."""
    _CODECS[name] = cls


def get_codec_class(name: str) -> type:
    """Codec class for a format name.

    Raises:
        KVCacheFormatError: no implementation is registered for the format.
    """
    if name not in _CODECS:
        raise KVCacheFormatError(f"KV cache format {name!r} is not implemented in this build")
    return _CODECS[name]
