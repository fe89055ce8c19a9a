"""Paged KV cache with pluggable storage formats.

Layout: the cache owns a pool of fixed-size token blocks (``block_size`` tokens each) per layer;
every sequence has a block table mapping its logical block ``p // block_size`` to a physical
block, as in vLLM's PagedAttention (Kwon et al., 2023). A token at position ``p`` of a sequence
lives in *slot* ``block_table[p // block_size] * block_size + p % block_size``.

How a slot's K (or V) values are stored is decided by a *codec*, one per format name
(``f16``, ``int4``, ...). Codecs are registered with :func:`register_codec`; the float formats
live here, the quantized ones in :mod:`localmoe.kv.quant`. The cache never subclasses per bit
width: one :class:`PagedKVCache` drives any (K codec, V codec) pair.
"""

from __future__ import annotations

import dataclasses

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from localmoe.errors import ContextOverflowError, KVCacheFormatError, LocalMoEError

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
FLOAT_FORMATS = ("f32", "f16", "bf16")
# Key grouping of the int formats: "token" = groups of G consecutive channels of one token
# (per-token scales), "channel" = per channel over the tokens of one cache page (KIVI).
KEY_GROUPINGS = ("token", "channel")
_GROUPING_ALIASES = {"c": "channel", "channel": "channel", "t": "token", "token": "token"}
# Key grouping that KVSpec.parse gives keys of CHANNEL_KEY_FORMATS when the user names none
# ("int4" rather than "int4:c"/"int4:t"); measured in docs/KV-QUALITY.md. A KVFormat built
# directly (no parse) without a grouping is per token.
DEFAULT_KEY_GROUPING = "channel"
CHANNEL_KEY_FORMATS = ("int4", "int3", "int2")
# Fraction of each head's channels that per-channel keys keep in fp16 per token (dense-and-sparse
# outliers, KVQuant) when the spec names no ``koutliers``; by key format, 0 where absent.
# Empty: ``int4,koutliers=0.03125`` (2 of every 64 channels, +0.75 bits per key) meets the +1%
# perplexity target on SmolLM2-135M and Gemma-3-270M (docs/KV-QUALITY.md), but the Triton decode
# kernel's outlier path made per-channel int4 decode attention 1.7-4.8x slower on the H200
# (docs/KV-QUALITY.md); ``{"int4": 2 / 64}`` here makes it the default once that path is fast.
DEFAULT_CHANNEL_KEY_OUTLIERS: dict[str, float] = {}


# Largest ``sinks=``/``window=`` accepted (tokens); the cache clamps both to its context size.
MAX_SIDE_TOKENS = 1 << 24


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

        Options after ``:`` (any order): ``gN`` group size along head_dim (power of two),
        ``c``/``channel`` or ``t``/``token`` key grouping (int formats only; see
        :data:`KEY_GROUPINGS`). Without a grouping option the codec's default applies.

        Raises:
            KVCacheFormatError: unknown name or option, bad group size, grouping on a float or
                fp4 format.
        """
        if isinstance(text, KVFormat):
            return text
        raw = str(text).strip().lower()
        name, _, opts = raw.partition(":")
        name = _ALIASES.get(name, name)
        if name not in KV_FORMAT_TABLE:
            raise KVCacheFormatError(
                f"unknown KV cache format {text!r}; choose one of: {', '.join(KV_FORMAT_TABLE)}")
        bits, group = KV_FORMAT_TABLE[name]
        grouping = ""
        seen_group = False
        for opt in (o for o in opts.split(":") if o) if opts else ():
            if opt in _GROUPING_ALIASES and name not in FLOAT_FORMATS and name != "fp4":
                if grouping and grouping != _GROUPING_ALIASES[opt]:
                    raise KVCacheFormatError(
                        f"contradictory key groupings in {text!r}; use one of ':c' (per "
                        "channel) or ':t' (per token)")
                grouping = _GROUPING_ALIASES[opt]
                continue
            if name == "fp4" and opt.startswith("g"):
                raise KVCacheFormatError(
                    f"fp4 has a fixed group of {group} values (one E4M3 scale per {group}, the "
                    f"NVFP4 layout); drop {':' + opt!r} from {text!r}")
            if seen_group and opt.startswith("g"):
                raise KVCacheFormatError(f"two group sizes in {text!r}; give one ':gN'")
            if name in FLOAT_FORMATS or not opt.startswith("g") or not opt[1:].isdigit():
                extra = (" (fp4 and float formats have no key grouping option)"
                         if opt in _GROUPING_ALIASES else "")
                raise KVCacheFormatError(
                    f"bad KV format option {opt!r} in {text!r}{extra}; use e.g. 'int4:g64' "
                    "(group size) or 'int4:c' (keys per channel)")
            group = int(opt[1:])
            seen_group = True
            if group <= 0 or group & (group - 1):
                raise KVCacheFormatError(f"KV group size must be a power of two, got {group}")
        return cls(name, bits, group, grouping)

    def __str__(self) -> str:
        default = KV_FORMAT_TABLE[self.name][1]
        out = self.name
        if self.grouping:
            out += ":c" if self.grouping == "channel" else ":t"
        return out if self.group_size == default else f"{out}:g{self.group_size}"


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
        choices = ", ".join(KV_FORMAT_TABLE)
        if isinstance(kv, str) and not kv.strip():  # `--kv-cache ""` is no request for f16
            raise KVCacheFormatError(
                f"empty KV cache format; choose one of: {choices} (leave it out for f16)")
        for side, val in (("keys", k), ("values", v)):
            if val is not None and not str(val).strip():
                raise KVCacheFormatError(
                    f"empty KV cache format for the {side}; choose one of: {choices}, or "
                    f"leave it unset")
        if isinstance(kv, str) and ("," in kv or "=" in kv):
            # the str() syntax: "int2,outliers=0.04,sinks=4,window=64", "k=int4,v=int2"
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
                try:
                    if not eq:
                        base_fmt = key
                    elif key in ("k", "v") and not val.strip():  # "k=int4,v=": not f16
                        raise KVCacheFormatError(
                            f"empty KV cache format {part!r} in {kv!r}; give {key}= one of: "
                            f"{choices}, or leave {key}= out")
                    elif key == "k":
                        k = k or val
                    elif key == "v":
                        v = v or val
                    elif key in ("outliers", "outlier_frac"):
                        outlier_frac = float(val[:-1]) / 100 if val.endswith("%") else float(val)
                    elif key in ("koutliers", "key_outliers", "key_outlier_frac"):
                        key_outlier_frac = (float(val[:-1]) / 100 if val.endswith("%")
                                            else float(val))
                    elif key in ("sinks", "sink_tokens"):
                        sink_tokens = int(val)
                    elif key == "window":
                        window = int(val)
                    elif key in ("kgroup", "key_grouping"):
                        kgroup = kgroup or val
                    else:
                        raise ValueError(key)
                except ValueError:
                    raise KVCacheFormatError(
                        f"bad KV cache option {part!r} in {kv!r}; use e.g. "
                        "'int2,outliers=0.04,sinks=4,window=64' or 'k=int4,v=int2'") from None
            kv = base_fmt or ("f16" if not (k and v) else k)
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
            g = _GROUPING_ALIASES.get(str(kgroup).strip().lower())
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
        return cls(kf, vf, float(outlier_frac), int(sink_tokens), int(window),
                   None if key_outlier_frac is None else float(key_outlier_frac))

    @property
    def is_float(self) -> bool:
        return self.k.is_float and self.v.is_float

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


class KVCodec:
    """Storage of one tensor kind (K or V) of one layer in one format.

    Subclasses implement :meth:`alloc`, :meth:`write`, :meth:`read` and
    :meth:`bits_per_value`. Shapes: ``slots`` LongTensor[T]; ``x`` float Tensor[T, n_kv_heads,
    head_dim]; ``positions`` LongTensor[T] (token positions, for sink/window rules).
    """

    def __init__(self, fmt: KVFormat, n_kv_heads: int, head_dim: int, kv_spec: KVSpec):
        self.fmt = fmt
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.kv_spec = kv_spec

    def alloc(self, n_slots: int, device: Any) -> dict[str, torch.Tensor]:
        raise KVCacheFormatError(f"KV format {self.fmt.name} has no storage implementation")

    def write(self, store: dict[str, torch.Tensor], slots: torch.Tensor, x: torch.Tensor,
              positions: torch.Tensor, seq_row: int | None = None, *,
              start: int | None = None) -> None:
        """Store ``x`` at ``slots``; ``seq_row`` is the sequence's row in per-sequence buffers.
        ``start`` (Python int, optional): ``positions`` is known to be ``start .. start+T-1``,
        so a codec can decide sink/window/page membership without reading ``positions`` back
        from the device (:class:`PagedKVCache` passes it to codecs whose ``write`` takes it)."""
        raise KVCacheFormatError(f"KV format {self.fmt.name} cannot be written")

    def read(self, store: dict[str, torch.Tensor], slots: torch.Tensor,
             positions: torch.Tensor | None = None, seq_row: int | None = None, *,
             start: int | None = None) -> torch.Tensor:
        """float32 [L, n_kv_heads, head_dim] of ``slots``; ``positions``/``seq_row`` let a
        codec serve sink/window tokens from its full-precision buffers; ``start`` as for
        :meth:`write`."""
        raise KVCacheFormatError(f"KV format {self.fmt.name} cannot be read")

    @classmethod
    def bits_per_value(cls, fmt: KVFormat, head_dim: int, kv_spec: KVSpec, *, role: str = "k",
                       block_size: int = 16) -> float:
        """Stored bits per value of ``fmt`` for ``role`` ("k"/"v") with ``block_size``-token
        pages."""
        return float(fmt.bits)

    def bytes_per_token(self) -> float:
        """Bytes per token for this layer and tensor kind (all kv heads)."""
        return self.bits_per_value(self.fmt, self.head_dim, self.kv_spec,
                                   role=getattr(self, "role", "k"),
                                   block_size=getattr(self, "block_size", 16)) * self.head_dim \
            * self.n_kv_heads / 8.0


_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class FloatCodec(KVCodec):
    """Plain float storage: ``data`` Tensor[n_slots, n_kv_heads, head_dim] of f32/f16/bf16.
    Sinks and windows need nothing here (everything is full precision already)."""

    def alloc(self, n_slots, device):
        return {"data": torch.zeros(n_slots, self.n_kv_heads, self.head_dim,
                                    dtype=_DTYPES[self.fmt.name], device=device)}

    def write(self, store, slots, x, positions, seq_row=None, *, start=None):
        store["data"][slots] = x.to(store["data"].dtype)

    def read(self, store, slots, positions=None, seq_row=None, *, start=None):
        return store["data"][slots].float()


_CODECS: dict[str, type] = {name: FloatCodec for name in FLOAT_FORMATS}


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


def _make_codec(cls: type, fmt: KVFormat, n_kv_heads: int, head_dim: int, kv_spec: KVSpec,
                role: str, max_seqs: int, block_size: int = 16) -> KVCodec:
    """Instantiate a codec, passing ``role``/``max_seqs``/``block_size`` to codecs that take
    them (the quantized ones: key grouping and rotation, per-sequence sink/window buffers,
    per-page channel scales)."""
    try:
        return cls(fmt, n_kv_heads, head_dim, kv_spec, role=role, max_seqs=max_seqs,
                   block_size=block_size)
    except TypeError:
        return cls(fmt, n_kv_heads, head_dim, kv_spec)


def _takes_start(method: Any) -> bool:
    """Whether a codec's ``write``/``read`` accepts the ``start`` keyword (codecs registered
    from outside may predate it)."""
    try:
        return "start" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def register_codec(name: str, cls: type) -> None:
    """Register ``cls`` (a :class:`KVCodec` subclass) as the storage of format ``name``."""
    _CODECS[name] = cls


def get_codec_class(name: str) -> type:
    """Codec class for a format name.

    Raises:
        KVCacheFormatError: no implementation is registered for the format.
    """
    if name not in _CODECS:
        try:  # the quantized codecs register themselves on import
            import localmoe.kv.quant as kv_quant  # noqa: F401
        except ImportError:
            pass
    if name not in _CODECS:
        raise KVCacheFormatError(f"KV cache format {name!r} is not implemented in this build")
    return _CODECS[name]


class PagedKVCache:
    """Paged K/V storage for all layers of a model and several sequences.

    Args:
        spec: ModelSpec (n_layers, n_kv_heads, head_dim, v_head_dim used).
        kv_spec: storage formats.
        n_ctx: maximum tokens per sequence.
        max_seqs: sequences that may be live at once (the block pool holds
            ``max_seqs * ceil(n_ctx / block_size)`` blocks unless ``n_blocks`` is given).
        block_size: tokens per block.
        device: torch device of the storage.

    Raises:
        KVCacheFormatError: a format has no codec.
    """

    def __init__(self, spec: Any, kv_spec: KVSpec, n_ctx: int, max_seqs: int = 1,
                 block_size: int = 16, device: Any = "cpu", n_blocks: int | None = None):
        self.spec = spec
        self.kv_spec = kv_spec
        self.n_ctx = int(n_ctx)
        self.max_seqs = int(max_seqs)
        self.block_size = int(block_size)
        self.device = torch.device(device)
        self.blocks_per_seq = math.ceil(self.n_ctx / self.block_size)
        self.n_blocks = int(n_blocks or self.max_seqs * self.blocks_per_seq)
        n_slots = self.n_blocks * self.block_size
        kcls = get_codec_class(kv_spec.k.name)
        vcls = get_codec_class(kv_spec.v.name)
        # sinks/window beyond the context hold every token anyway: size the side buffers to it
        cspec = dataclasses.replace(kv_spec, sink_tokens=min(kv_spec.sink_tokens, self.n_ctx),
                                    window=min(kv_spec.window, self.n_ctx))
        self.k_codec = _make_codec(kcls, kv_spec.k, spec.n_kv_heads, spec.head_dim, cspec,
                                   "k", self.max_seqs, self.block_size)
        self.v_codec = _make_codec(vcls, kv_spec.v, spec.n_kv_heads, spec.v_head_dim, cspec,
                                   "v", self.max_seqs, self.block_size)
        # codecs that take ``start`` get it, so the decode path needs no host-device sync
        self._start_kw = {side: (_takes_start(c.write), _takes_start(c.read))
                          for side, c in (("k", self.k_codec), ("v", self.v_codec))}
        self.k_stores = [self.k_codec.alloc(n_slots, self.device) for _ in range(spec.n_layers)]
        self.v_stores = [self.v_codec.alloc(n_slots, self.device) for _ in range(spec.n_layers)]
        self._free_blocks = list(range(self.n_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._rows: dict[int, int] = {}          # seq id -> row of the per-sequence side buffers
        self._free_rows = list(range(self.max_seqs - 1, -1, -1))
        self._next_id = 0

    # --- sequence bookkeeping -------------------------------------------------------------
    def new_seq(self) -> int:
        """Start an empty sequence and return its id.

        Raises:
            LocalMoEError: ``max_seqs`` sequences are already live.
        """
        if len(self._tables) >= self.max_seqs:
            raise LocalMoEError(
                f"the KV cache holds at most {self.max_seqs} concurrent sequences; "
                "free one or create the runner with a larger max_seqs")
        sid = self._next_id
        self._next_id += 1
        self._tables[sid] = []
        self._lens[sid] = 0
        row = self._free_rows.pop()
        self._rows[sid] = row
        for codec, stores in ((self.k_codec, self.k_stores), (self.v_codec, self.v_stores)):
            if hasattr(codec, "reset_row"):
                for st in stores:
                    codec.reset_row(st, row)
        return sid

    def seq_row(self, seq_id: int) -> int:
        """Row (0 .. max_seqs-1) of a live sequence in the per-sequence sink/window buffers."""
        self._check(seq_id)
        return self._rows[seq_id]

    def _check(self, seq_id: int) -> None:
        if seq_id not in self._tables:
            raise LocalMoEError(f"unknown KV cache sequence id {seq_id}")

    def free_seq(self, seq_id: int) -> None:
        """Release a sequence's blocks (unknown ids are ignored)."""
        blocks = self._tables.pop(seq_id, None)
        self._lens.pop(seq_id, None)
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)
        if blocks:
            self._free_blocks.extend(reversed(blocks))

    def seq_len(self, seq_id: int) -> int:
        """Committed tokens of a sequence."""
        self._check(seq_id)
        return self._lens[seq_id]

    def truncate(self, seq_id: int, n: int) -> None:
        """Keep the first ``n`` committed tokens; blocks past them go back to the pool.

        Codecs need no notice: side-buffer entries are tagged with their positions, and a
        per-channel key page cut in the middle keeps its codes and scales until a later write
        completes it again (its tokens before ``n`` are then re-quantized from the ring or from
        those codes)."""
        self._check(seq_id)
        n = max(0, min(int(n), self._lens[seq_id]))
        self._lens[seq_id] = n
        keep = math.ceil(n / self.block_size)
        table = self._tables[seq_id]
        while len(table) > keep:
            self._free_blocks.append(table.pop())

    def reserve(self, seq_id: int, n_new: int) -> None:
        """Make room for ``n_new`` more tokens.

        Raises:
            ContextOverflowError: the sequence would exceed ``n_ctx``.
            LocalMoEError: the shared block pool is exhausted.
        """
        self._check(seq_id)
        total = self._lens[seq_id] + int(n_new)
        if total > self.n_ctx:
            raise ContextOverflowError(total, self.n_ctx)
        table = self._tables[seq_id]
        need = math.ceil(total / self.block_size) - len(table)
        if need > len(self._free_blocks):
            raise LocalMoEError("the KV cache block pool is exhausted; lower the number of "
                                "concurrent sequences or the context size")
        for _ in range(need):
            table.append(self._free_blocks.pop())

    def commit(self, seq_id: int, n_new: int) -> None:
        """Count ``n_new`` written tokens as part of the sequence (after all layers wrote)."""
        self._check(seq_id)
        self._lens[seq_id] += int(n_new)

    # --- data -----------------------------------------------------------------------------
    def _memo(self) -> dict:
        """Small cache of index tensors built from the block tables (every layer of a forward
        step asks for the same ones); entries are checked against the table before reuse."""
        m = self.__dict__.get("_index_memo")
        if m is None or len(m) > 256:
            m = self.__dict__["_index_memo"] = {}
        return m

    def block_table(self, seq_id: int) -> torch.Tensor:
        """Physical block ids of a sequence, IntTensor[n_blocks_used] on the cache device
        (shared between calls while the table is unchanged: do not modify it)."""
        self._check(seq_id)
        table = tuple(self._tables[seq_id])
        memo = self._memo()
        hit = memo.get(("bt", seq_id))
        if hit is not None and hit[0] == table:
            return hit[1]
        out = torch.tensor(table, dtype=torch.int32, device=self.device)
        memo[("bt", seq_id)] = (table, out)
        return out

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Slot indices (LongTensor[end-start], cache device) of positions [start, end)
        (shared between calls while the blocks holding them are unchanged: do not modify it).
        When the blocks holding the range are physically consecutive (always for a range inside
        one block, e.g. a decode token) the tensor is made on the device with ``arange``, so no
        host-to-device copy (and no stream sync) is needed.

        Raises:
            LocalMoEError: ``end`` beyond the reserved blocks.
        """
        self._check(seq_id)
        table = self._tables[seq_id]
        bs = self.block_size
        if end > len(table) * bs:
            raise LocalMoEError("KV cache positions beyond the reserved blocks; call reserve()")
        span = tuple(table[start // bs:-(-end // bs)]) if end > start else ()
        memo = self._memo()
        hit = memo.get((seq_id, start, end))
        if hit is not None and hit[0] == span:
            return hit[1]
        if span and all(b - a == 1 for a, b in zip(span, span[1:])):
            first = span[0] * bs + start % bs
            out = torch.arange(first, first + end - start, device=self.device)
        else:
            pos = torch.arange(start, end)
            blocks = torch.tensor(table, dtype=torch.long)[pos // bs]
            out = (blocks * bs + pos % bs).to(self.device)
        memo[(seq_id, start, end)] = (span, out)
        return out

    def write(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K[T, n_kv_heads, head_dim] and V[T, n_kv_heads, v_head_dim] at positions
        ``start .. start+T-1`` of ``layer`` (space must be reserved first).

        ``start`` (a Python int) is passed on to the codecs, which therefore never read the
        position tensor back to the host: a one-token decode write issues no host-device sync
        (the slot tensor is built from the Python block table)."""
        start = int(start)
        t = k.shape[0]
        slots = self.slots(seq_id, start, start + t)
        pos = torch.arange(start, start + t, device=self.device)
        row = self._rows[seq_id]
        for side, codec, store, x in (("k", self.k_codec, self.k_stores[layer], k),
                                      ("v", self.v_codec, self.v_stores[layer], v)):
            kw = {"start": start} if self._start_kw[side][0] else {}
            codec.write(store, slots, x, pos, seq_row=row, **kw)

    def read(self, layer: int, seq_id: int, end: int, start: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K[L, n_kv_heads, head_dim], V[L, n_kv_heads, v_head_dim] (float32) of
        positions [start, end) — the reference path; fused kernels read the stores directly."""
        start = int(start)
        slots = self.slots(seq_id, start, end)
        pos = torch.arange(start, end, device=self.device)
        row = self._rows[seq_id]
        out = []
        for side, codec, store in (("k", self.k_codec, self.k_stores[layer]),
                                   ("v", self.v_codec, self.v_stores[layer])):
            kw = {"start": start} if self._start_kw[side][1] else {}
            out.append(codec.read(store, slots, positions=pos, seq_row=row, **kw))
        return out[0], out[1]

    # --- accounting -----------------------------------------------------------------------
    def footprint(self) -> int:
        """Bytes allocated for K/V storage over all layers (sink/window buffers included)."""
        total = 0
        for store in self.k_stores + self.v_stores:
            for t in store.values():
                total += t.numel() * t.element_size()
        return total

    def used_bytes(self) -> int:
        """Bytes of K/V data held by live sequences' committed tokens (format-exact)."""
        per_tok = self.kv_spec.bytes_per_token(self.spec, self.block_size)
        return int(per_tok * sum(self._lens.values()))
