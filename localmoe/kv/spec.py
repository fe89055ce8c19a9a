"""The format of a whole KV cache: :class:`KVSpec` (K and V formats, outliers, sinks, window).

:meth:`KVSpec.parse` reads the strings of ``--kv-cache``/``kv_cache=`` (``"int4"``,
``"k=int4,v=int2"``, ``"int2,outliers=0.04,sinks=4,window=64"``, ...); sizes per value and per
token come from the codec of each side (:mod:`localmoe.kv.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localmoe.errors import KVCacheFormatError, LocalMoEError
from localmoe.kv.formats import GROUPING_ALIASES, KV_FORMAT_TABLE, KVFormat, default_key_grouping
from localmoe.kv.registry import get_codec_class

__all__ = ["KVSpec", "DEFAULT_CHANNEL_KEY_OUTLIERS", "MAX_SIDE_TOKENS", "kv_format_table"]

# Fraction of each head's channels that per-channel keys keep in fp16 per token (dense-and-sparse
# outliers, KVQuant) when the spec names no ``koutliers``; by key format, 0 where absent.
# Empty: ``int4,koutliers=0.03125`` (2 of every 64 channels, +0.75 bits per key) meets the +1%
# perplexity target on SmolLM2-135M and Gemma-3-270M (docs/KV-QUALITY.md), but the Triton decode
# kernel's outlier path made per-channel int4 decode attention 1.7-4.8x slower on the H200
# (docs/KV-QUALITY.md); ``{"int4": 2 / 64}`` here makes it the default once that path is fast.
DEFAULT_CHANNEL_KEY_OUTLIERS: dict[str, float] = {}


# Largest ``sinks=``/``window=`` accepted (tokens); the cache clamps both to its context size.
MAX_SIDE_TOKENS = 1 << 24


@dataclass(frozen=True)
class KVSpec:
    """Format of the whole KV cache.

    Attributes:
        k, v: formats of keys and values (may differ, e.g. K4/V2).
        outlier_frac: fraction of channels per head kept in fp16 per token (dense-and-sparse,
            KVQuant, Hooper et al., 2024) for values and per-token keys.
        sink_tokens: first tokens of every sequence kept in full precision (attention sinks).
        window: most recent tokens kept in full precision (0 = none).
        key_outlier_frac: the same fraction for the keys alone (option ``koutliers=``); None =
            the default, see :meth:`key_outliers`.
    """

    k: KVFormat
    v: KVFormat
    outlier_frac: float = 0.0
    sink_tokens: int = 0
    window: int = 0
    key_outlier_frac: float | None = None

    def key_outliers(self) -> float:
        """Effective outlier fraction of the keys: ``key_outlier_frac`` when set, else
        :data:`DEFAULT_CHANNEL_KEY_OUTLIERS` of the key format for per-channel keys (0 for
        formats it does not name), else ``outlier_frac`` (per-token keys)."""
        if self.key_outlier_frac is not None:
            return self.key_outlier_frac
        if self.k.grouping == "channel":
            return DEFAULT_CHANNEL_KEY_OUTLIERS.get(self.k.name, 0.0)
        return self.outlier_frac

    @classmethod
    def parse(cls, kv: "str | KVSpec | None" = "f16", k: str | None = None, v: str | None = None,
              outlier_frac: float = 0.0, sink_tokens: int = 0, window: int = 0,
              kgroup: str | None = None, key_outlier_frac: float | None = None) -> "KVSpec":
        """Build a spec from CLI/API strings: ``kv`` sets both, ``k``/``v`` override one side.
        ``kv`` may also use the :meth:`__str__` syntax with options, e.g.
        ``"int2,outliers=0.04,sinks=4,window=64"`` or ``"k=int4,v=int2,outliers=2%"``, so
        ``KVSpec.parse(str(spec)) == spec``.

        Key grouping: ``"int4:c"`` (or ``kgroup="channel"``, ``"int4,kgroup=channel"``) stores
        keys per channel over each cache page (KIVI); ``":t"`` / ``kgroup="token"`` per token.
        A grouping given through ``kv`` (both sides) applies to the keys only; values are always
        grouped per token.

        Outliers: ``outliers=F`` (``outlier_frac``) keeps F of each head's channels per token in
        fp16 for values and per-token keys; ``koutliers=F`` (``key_outlier_frac``) sets the
        keys' own fraction (per-channel keys too; ``koutliers=0`` turns the per-channel
        default :data:`DEFAULT_CHANNEL_KEY_OUTLIERS` off).

        Raises:
            KVCacheFormatError: unknown format or out-of-range option, an empty format
                (``""``, ``k=""``, ``"k=int4,v="``; a side that is not named stays f16), an
                empty option (a doubled or trailing comma), a grouping on values
                (``v="int4:c"``), on fp4 or on a float format, ``outliers=``/``sinks=``/
                ``window=`` on a cache with no quantized side (``outliers=`` also with float
                values and keys that do not take it).
        """
        if isinstance(kv, KVSpec) and k is None and v is None and kgroup is None:
            return kv
        _check_not_empty(kv, k, v)
        o = {"k": k, "v": v, "outlier_frac": outlier_frac, "sink_tokens": sink_tokens,
             "window": window, "kgroup": kgroup, "key_outlier_frac": key_outlier_frac}
        if isinstance(kv, str) and ("," in kv or "=" in kv):
            # the str() syntax: "int2,outliers=0.04,sinks=4,window=64", "k=int4,v=int2"
            kv = _apply_option_string(kv, o)
        kf, vf = _side_formats(kv, o["k"], o["v"], o["kgroup"])
        _check_options(kf, vf, o["outlier_frac"], o["key_outlier_frac"], o["sink_tokens"],
                       o["window"])
        kof = o["key_outlier_frac"]
        return cls(kf, vf, float(o["outlier_frac"]), int(o["sink_tokens"]), int(o["window"]),
                   None if kof is None else float(kof))

    @property
    def is_float(self) -> bool:
        return self.k.is_float and self.v.is_float

    def check_head_dims(self, head_dim: int, v_head_dim: int | None = None) -> None:
        """Refuse a group size named with ``:gN`` that is larger than the heads it groups
        (a group is a run of one head's channels of one token): the cache would use groups of
        ``head_dim`` and be reported as ``:gN``. The format's default group is fitted to small
        heads silently, as it was not asked for; per-channel keys and fp4 take no ``:gN``.

        Raises:
            KVCacheFormatError: naming the side, the group size and the largest one allowed.
        """
        sides = (("keys", self.k, head_dim), ("values", self.v, v_head_dim or head_dim))
        for side, fmt, d in sides:
            if (fmt.is_float or fmt.name == "fp4" or (side == "keys" and fmt.grouping == "channel")
                    or fmt.group_size == KV_FORMAT_TABLE[fmt.name][1]):
                continue
            if fmt.group_size > d:
                raise KVCacheFormatError(
                    f"KV group size {fmt.group_size} of the {side} ({fmt}) is larger than this "
                    f"model's head size ({d} channels): a group holds at most one head's "
                    f"channels; use ':g{d}' or less")

    def __str__(self) -> str:
        extra = []
        if self.outlier_frac:
            extra.append(f"outliers={self.outlier_frac:g}")
        if self.sink_tokens:
            extra.append(f"sinks={self.sink_tokens}")
        if self.window:
            extra.append(f"window={self.window}")
        if self.key_outlier_frac is not None:
            extra.append(f"koutliers={self.key_outlier_frac:g}")
        k = self.k
        if k.grouping and k.grouping == default_key_grouping(k.name):
            k = KVFormat(k.name, k.bits, k.group_size)    # the default is left implicit
        same = k == self.v or (not self.v.grouping
                               and KVFormat(k.name, k.bits, k.group_size) == self.v)
        base = str(k) if same else f"k={k},v={self.v}"
        return ",".join([base] + extra)

    def bits_per_value(self, which: str, head_dim: int, block_size: int = 16) -> float:
        """Average stored bits per K (``which="k"``) or V value, scales, zero points and
        outliers included; ``block_size`` (tokens per cache page) matters for per-channel
        keys, whose fp16 scale and zero per channel per page cost ``32 / block_size`` bits."""
        fmt = self.k if which == "k" else self.v
        return get_codec_class(fmt.name).bits_per_value(fmt, head_dim, self, role=which,
                                                        block_size=block_size)

    def bytes_per_token(self, spec: Any, block_size: int = 16) -> float:
        """KV bytes stored per token over all layers of ``spec`` (a ModelSpec) with pages of
        ``block_size`` tokens."""
        k = self.bits_per_value("k", spec.head_dim, block_size) * spec.head_dim
        v = self.bits_per_value("v", spec.v_head_dim, block_size) * spec.v_head_dim
        return spec.n_layers * spec.n_kv_heads * (k + v) / 8.0


def kv_format_table(spec: Any, formats: tuple[str, ...] = ("f16", "bf16", "int8", "int4", "int3",
                                                            "int2", "fp4")) -> list[dict]:
    """Bytes per token of every KV format for a model (for ``localmoe info``).

    Returns:
        ``[{"format": str, "bits_per_value": float (keys), "bits_k": float, "bits_v": float,
        "bytes_per_token": float, "ratio_vs_f16": float}, ...]`` (16-token pages: per-channel
        keys include their per-page scale and zero); formats whose group does not fit
        ``head_dim`` are left out.
    """
    rows = []
    f16 = KVSpec.parse("f16").bytes_per_token(spec)
    for name in formats:
        try:
            kv = KVSpec.parse(name)
            b = kv.bytes_per_token(spec)
            bk = kv.bits_per_value("k", spec.head_dim)
            rows.append({"format": name, "bits_per_value": bk, "bits_k": bk,
                         "bits_v": kv.bits_per_value("v", spec.v_head_dim),
                         "bytes_per_token": b, "ratio_vs_f16": b / f16})
        except LocalMoEError:
            continue
    return rows


def _check_not_empty(kv: Any, k: str | None, v: str | None) -> None:
    """Refuse an empty format for the cache or one side (``""`` is no request for f16)."""
    choices = ", ".join(KV_FORMAT_TABLE)
    if isinstance(kv, str) and not kv.strip():  # `--kv-cache ""` is no request for f16
        raise KVCacheFormatError(
            f"empty KV cache format; choose one of: {choices} (leave it out for f16)")
    for side, val in (("keys", k), ("values", v)):
        if val is not None and not str(val).strip():
            raise KVCacheFormatError(
                f"empty KV cache format for the {side}; choose one of: {choices}, or "
                f"leave it unset")


def _apply_option_string(kv: str, o: dict[str, Any]) -> str:
    """Read the :meth:`KVSpec.__str__` syntax ``kv`` into ``o`` (the keyword arguments of
    :meth:`KVSpec.parse`; ``k``, ``v`` and ``kgroup`` given as arguments win, the numbers in
    ``kv`` win) and return the base format.

    Raises:
        KVCacheFormatError: an empty or repeated option, an option with no value
            (``"sinks="``), an empty ``k=``/``v=``, an unknown option or a value that is not a
            number.
    """
    base_fmt = None
    seen: set[str] = set()
    for part in (p.strip() for p in kv.split(",")):
        if not part:  # "int4,,", "int4,": a doubled or trailing comma
            raise KVCacheFormatError(
                f"empty KV cache option in {kv!r} (a doubled or trailing comma?); use "
                "e.g. 'int2,outliers=0.04,sinks=4,window=64' or 'k=int4,v=int2'")
        key, eq, val = part.partition("=")
        key = key.strip().lower()
        tag = key if eq else "format"
        if tag in seen:
            raise KVCacheFormatError(f"KV cache option {tag!r} given twice in {kv!r}")
        seen.add(tag)
        if not eq:
            base_fmt = key
            continue
        if key in _VALUE_OPTIONS and not val.strip():  # "int4,sinks=": no value
            raise KVCacheFormatError(
                f"KV cache option {part!r} in {kv!r} has no value; give one, e.g. "
                "'int2,outliers=0.04,sinks=4,window=64' or 'int4,kgroup=channel', or leave "
                f"{key}= out")
        try:
            _apply_option(kv, part, key, val, o)
        except ValueError:
            raise KVCacheFormatError(
                f"bad KV cache option {part!r} in {kv!r}; use e.g. "
                "'int2,outliers=0.04,sinks=4,window=64' or 'k=int4,v=int2'") from None
    return base_fmt or ("f16" if not (o["k"] and o["v"]) else o["k"])


def _fraction(val: str) -> float:
    """``"0.04"`` or ``"4%"`` -> 0.04 (ValueError when not a number)."""
    return float(val[:-1]) / 100 if val.endswith("%") else float(val)


# The options of :func:`_apply_option` other than ``k=``/``v=``: name -> (the options' field,
# the parser of its value; None: the first value given wins)
_VALUE_OPTIONS = {
    **dict.fromkeys(("outliers", "outlier_frac"), ("outlier_frac", _fraction)),
    **dict.fromkeys(("koutliers", "key_outliers", "key_outlier_frac"),
                    ("key_outlier_frac", _fraction)),
    **dict.fromkeys(("sinks", "sink_tokens"), ("sink_tokens", int)),
    "window": ("window", int),
    **dict.fromkeys(("kgroup", "key_grouping"), ("kgroup", None)),
}


def _apply_option(kv: str, part: str, key: str, val: str, o: dict[str, Any]) -> None:
    """One ``key=val`` option of :func:`_apply_option_string`.

    Raises:
        KVCacheFormatError: an empty ``k=``/``v=``.
        ValueError: an unknown key or a value that is not a number.
    """
    if key in ("k", "v") and not val.strip():  # "k=int4,v=": not f16
        raise KVCacheFormatError(
            f"empty KV cache format {part!r} in {kv!r}; give {key}= one of: "
            f"{', '.join(KV_FORMAT_TABLE)}, or leave {key}= out")
    if key in ("k", "v"):
        o[key] = o[key] or val
        return
    if key not in _VALUE_OPTIONS:
        raise ValueError(key)
    field_, parse = _VALUE_OPTIONS[key]
    o[field_] = parse(val) if parse is not None else (o[field_] or val)


def _side_formats(kv: Any, k: str | None, v: str | None, kgroup: str | None
                  ) -> tuple[KVFormat, KVFormat]:
    """Key and value formats: ``k``/``v`` override the base ``kv`` (a format string or a
    KVSpec); a grouping given for both sides is the keys'; ``kgroup`` (or the format's default
    grouping) applies to int keys.

    Raises:
        KVCacheFormatError: a bad format, a per-channel grouping on values, an unknown
            ``kgroup`` or a grouping on float/fp4 keys.
    """
    base = KVFormat.parse(kv or "f16") if not isinstance(kv, KVSpec) else None
    kf = KVFormat.parse(k) if k else (kv.k if isinstance(kv, KVSpec) else base)
    vf = KVFormat.parse(v) if v else (kv.v if isinstance(kv, KVSpec) else base)
    if v and vf.grouping == "channel":
        raise KVCacheFormatError(
            f"per-channel grouping applies to keys only, not to values ({v!r}); values are "
            "grouped per token")
    if vf.grouping:  # a grouping given for both sides is the keys' grouping
        vf = KVFormat(vf.name, vf.bits, vf.group_size)
    if kgroup is not None:
        g = GROUPING_ALIASES.get(str(kgroup).strip().lower())
        if g is None:
            raise KVCacheFormatError(
                f"unknown key grouping {kgroup!r}; use 'channel' (KIVI) or 'token'")
        if (kf.is_float or kf.name == "fp4") and g == "token":
            pass  # already per token: nothing to choose
        elif kf.is_float or kf.name == "fp4":
            raise KVCacheFormatError(
                f"key grouping {g!r} needs an int key format (int8/int4/int3/int2), "
                f"not {kf.name}")
        else:
            kf = KVFormat(kf.name, kf.bits, kf.group_size, g)
    elif not kf.grouping and not kf.is_float and kf.name != "fp4":
        kf = KVFormat(kf.name, kf.bits, kf.group_size, default_key_grouping(kf.name))
    return kf, vf


def _check_options(kf: KVFormat, vf: KVFormat, outlier_frac: float,
                   key_outlier_frac: float | None, sink_tokens: int, window: int) -> None:
    """Refuse outlier fractions outside [0, 0.5), options that would do nothing for these
    formats, and sinks/windows outside [0, :data:`MAX_SIDE_TOKENS`]."""
    for frac in (outlier_frac, key_outlier_frac):
        if frac is not None and not (0.0 <= float(frac) < 0.5):
            raise KVCacheFormatError(f"outlier fraction must be in [0, 0.5), got {frac}")
    if key_outlier_frac is not None and float(key_outlier_frac) > 0 and (
            kf.is_float):
        raise KVCacheFormatError(f"key outliers need a quantized key format, not {kf.name}")
    if kf.is_float and vf.is_float:
        # a float cache keeps every token in full precision already: the options that keep
        # some in fp16 would do nothing (and window= is not sliding-window attention)
        cache = kf.name if kf.name == vf.name else f"k={kf.name},v={vf.name}"
        for opt, n in (("outliers", outlier_frac), ("sinks", sink_tokens),
                       ("window", window)):
            if n:
                raise KVCacheFormatError(
                    f"{opt}= does nothing on a float KV cache ({cache}): every token is "
                    f"kept in full precision already; drop it, or use a quantized format, "
                    f"e.g. 'int4,{opt}=...'")
    elif outlier_frac and vf.is_float and (
            kf.is_float or key_outlier_frac is not None or kf.grouping == "channel"):
        keys = ("per channel (they take koutliers=)" if kf.grouping == "channel"
                else "given their own koutliers=")
        raise KVCacheFormatError(
            f"outliers= does nothing here: it applies to quantized values and per-token "
            f"keys, and the values are {vf.name}, the keys {keys}; drop outliers=")
    for opt, n in (("sinks", sink_tokens), ("window", window)):
        if not 0 <= n <= MAX_SIDE_TOKENS:
            hint = (" (any value from the context size up keeps every token in fp16)"
                    if n > MAX_SIDE_TOKENS else "")
            raise KVCacheFormatError(
                f"{opt}= must be between 0 and {MAX_SIDE_TOKENS} tokens, got {n}{hint}")
