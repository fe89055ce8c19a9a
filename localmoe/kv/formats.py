"""KV storage format names and :class:`KVFormat`, the format of one side (K or V) of the cache.

A format is a name of :data:`KV_FORMAT_TABLE` (aliases such as ``q4_0`` accepted) with options:
a group size (``int4:g64``) and, for the keys of the int formats, a grouping (``int4:c`` per
channel, KIVI; ``int4:t`` per token). The whole cache's format, with outliers, sinks and a
recent window, is a :class:`~localmoe.kv.spec.KVSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass

from localmoe.errors import KVCacheFormatError

__all__ = ["KV_FORMAT_TABLE", "FLOAT_FORMATS", "QUANT_FORMATS", "KEY_GROUPINGS",
           "DEFAULT_KEY_GROUPING", "CHANNEL_KEY_FORMATS", "MIN_GROUP_SIZE", "KVFormat",
           "default_key_grouping"]

# name -> (bits per value, default group size). Group size 0 = not grouped.
KV_FORMAT_TABLE: dict[str, tuple[int, int]] = {
    "f32": (32, 0),
    "f16": (16, 0),
    "bf16": (16, 0),
    "int8": (8, 32),
    "int4": (4, 32),
    "int3": (3, 32),
    "int2": (2, 32),
    "fp4": (4, 16),
}
_ALIASES = {
    "fp16": "f16", "float16": "f16", "half": "f16", "fp32": "f32", "float32": "f32",
    "bfloat16": "bf16", "q8_0": "int8", "q8": "int8", "q4_0": "int4", "q4": "int4",
    "q3": "int3", "q2": "int2", "e2m1": "fp4", "nvfp4": "fp4",
}
# Smallest group size ``:gN`` accepted: each group costs an fp16 scale and zero (32 bits), so
# below 16 values a 4-bit format stores more than int8 does (g8: 8 bits per value, g1: 36, more
# than f16); the kernels and codecs are tested with groups of 16 to 128 (fp4's fixed group is 16).
MIN_GROUP_SIZE = 16
FLOAT_FORMATS = ("f32", "f16", "bf16")
QUANT_FORMATS = ("int8", "int4", "int3", "int2", "fp4")
# Key grouping of the int formats: "token" = groups of G consecutive channels of one token
# (per-token scales), "channel" = per channel over the tokens of one cache page (KIVI).
KEY_GROUPINGS = ("token", "channel")
GROUPING_ALIASES = {"c": "channel", "channel": "channel", "t": "token", "token": "token"}
# Key grouping that KVSpec.parse gives keys of CHANNEL_KEY_FORMATS when the user names none
# ("int4" rather than "int4:c"/"int4:t"); measured in docs/KV-QUALITY.md. A KVFormat built
# directly (no parse) without a grouping is per token.
DEFAULT_KEY_GROUPING = "channel"
CHANNEL_KEY_FORMATS = ("int4", "int3", "int2")


def default_key_grouping(name: str) -> str:
    """Grouping KVSpec.parse gives keys of format ``name`` when none is named."""
    return DEFAULT_KEY_GROUPING if name in CHANNEL_KEY_FORMATS else "token"


@dataclass(frozen=True)
class KVFormat:
    """One storage format for K or V.

    Attributes:
        name: canonical name, a key of :data:`KV_FORMAT_TABLE`.
        bits: bits per stored value, scales excluded.
        group_size: values sharing one scale (and zero point); 0 for float formats.
        grouping: key grouping of an int format, ``"channel"`` or ``"token"``; ``""`` when none
            was named (the codec's default, per token).
    """

    name: str
    bits: int
    group_size: int = 0
    grouping: str = ""

    @property
    def is_float(self) -> bool:
        return self.name in FLOAT_FORMATS

    @classmethod
    def parse(cls, text: str) -> "KVFormat":
        """Parse ``"int4"``, ``"q4_0"``, ``"int4:g64"`` (group size 64), ``"int4:c"`` (keys
        per channel, KIVI), ``"int4:t:g16"`` (per-token groups of 16 channels), ...

        Options after ``:`` (any order): ``gN`` group size along head_dim (a power of two
        from :data:`MIN_GROUP_SIZE`; at most the model's head_dim, which
        :meth:`~localmoe.kv.spec.KVSpec.check_head_dims` checks once a model is known),
        ``c``/``channel`` or ``t``/``token`` key grouping (int formats only; see
        :data:`KEY_GROUPINGS`). Without a grouping option the codec's default applies.

        Raises:
            KVCacheFormatError: unknown name or option, an empty option (``"int4:"``,
                ``"int4::c"``), bad group size, grouping on a float or fp4 format.
        """
        if isinstance(text, KVFormat):
            return text
        raw = str(text).strip().lower()
        name, colon, opts = raw.partition(":")
        name = _ALIASES.get(name, name)
        if name not in KV_FORMAT_TABLE:
            raise KVCacheFormatError(
                f"unknown KV cache format {text!r}; choose one of: {', '.join(KV_FORMAT_TABLE)}")
        bits, group = KV_FORMAT_TABLE[name]
        grouping = ""
        seen_group = False
        if colon and "" in opts.split(":"):   # "int4:", "int4::c": a doubled or trailing colon
            raise KVCacheFormatError(
                f"empty KV format option in {text!r} (a doubled or trailing ':'?); use e.g. "
                "'int4:g64' (group size) or 'int4:c' (keys per channel), or no ':' at all")
        for opt in opts.split(":") if colon else ():
            if opt in GROUPING_ALIASES and name not in FLOAT_FORMATS and name != "fp4":
                if grouping:
                    what = "contradictory" if grouping != GROUPING_ALIASES[opt] else "repeated"
                    raise KVCacheFormatError(
                        f"{what} key groupings in {text!r}; give one of ':c' (per channel) or "
                        "':t' (per token)")
                grouping = GROUPING_ALIASES[opt]
                continue
            if name == "fp4" and opt == f"g{group}" and not seen_group:
                seen_group = True       # the one group fp4 has, spelled out
                continue
            if name == "fp4" and opt.startswith("g"):
                raise KVCacheFormatError(
                    f"fp4 has a fixed group of {group} values (one E4M3 scale per {group}, the "
                    f"NVFP4 layout); drop {':' + opt!r} from {text!r}")
            if seen_group and opt.startswith("g"):
                raise KVCacheFormatError(f"two group sizes in {text!r}; give one ':gN'")
            if name in FLOAT_FORMATS or not opt.startswith("g") or not opt[1:].isdigit():
                extra = (" (fp4 and float formats have no key grouping option)"
                         if opt in GROUPING_ALIASES else "")
                raise KVCacheFormatError(
                    f"bad KV format option {opt!r} in {text!r}{extra}; use e.g. 'int4:g64' "
                    "(group size) or 'int4:c' (keys per channel)")
            group = int(opt[1:])
            seen_group = True
            if group < MIN_GROUP_SIZE or group & (group - 1):
                raise KVCacheFormatError(
                    f"KV group size must be a power of two from {MIN_GROUP_SIZE} up (16, 32, "
                    f"64, ...; at most the model's head_dim), got {group} in {text!r}")
        return cls(name, bits, group, grouping)

    def __str__(self) -> str:
        default = KV_FORMAT_TABLE[self.name][1]
        out = self.name
        if self.grouping:
            out += ":c" if self.grouping == "channel" else ":t"
        return out if self.group_size == default else f"{out}:g{self.group_size}"
