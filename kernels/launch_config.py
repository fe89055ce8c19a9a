"""Launch choices of the decode-attention kernel, read from data (``kernels/configs/*.json``).

Tile size, warps, programs per SM, transposed products and the other launch choices of
:func:`localmoe.kernels.decode_attention.decode_attention` are measured per device and kept as
ordered rule lists in one JSON file per device, not as code. A file is picked by the device's
name, normalized by :func:`device_key` (``torch.cuda.get_device_name`` ``"NVIDIA H200"`` ->
``nvidia_h200.json``); a CUDA device without a file of its own uses ``default.json``; every
other device (CPU tensors, run through the Triton interpreter) uses ``cpu.json``.

File layout::

    {"about": "...", "extends": "default",          # optional: knobs not given come from there
     "tile":  [{"when": {"pairs": {"min": 16}, "k_fmt": "int3", "k_chan": false},
                "block_n": 64, "num_warps": 4, "waves": 4.0, "why": "measured ..."},
               ...,
               {"block_n": 128, "num_warps": 4, "waves": 2.0}],      # last: no "when"
     "swap_ab": [...], "sz_pre": [...], "v_join": [...], "num_stages": [...],
     "fused_reduce": [...]}

Each knob (:data:`KNOBS`) is a list of rules; the first rule whose ``when`` matches gives the
knob's fields, and the last rule has no ``when`` (the fallback). ``why`` is a free-text note
(where the choice was measured). Conditions (all must hold) test the features of one launch
(:func:`launch_features`):

* ``k_fmt``, ``v_fmt``: storage format of keys / values, ``"float"`` (f16/bf16/f32), ``"int8"``,
  ``"int4"``, ``"int3"``, ``"int2"`` or ``"fp4"`` (:func:`codec_format`);
* ``k_chan``: keys grouped per channel (KIVI) rather than per token;
* ``extras``: a side that reads outliers (per-token), sink or window buffers (per-token), or
  rotated keys;
* ``pairs``: batch x kv heads, the (sequence, kv head) pairs of the launch;
* ``max_len``: longest sequence in tokens (None, unknown, counts as longer than any bound).

A condition's value is a value (equal), a list (any of) or ``{"min": a, "max": b}`` (bounds
inclusive, either may be left out).

Raises :class:`~localmoe.errors.LocalMoEError` for a file that does not follow this layout.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localmoe.errors import LocalMoEError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

KNOBS: dict[str, tuple[str, ...]] = {
    "tile": ("block_n", "num_warps", "waves"),
    "swap_ab": ("swap_ab",),
    "sz_pre": ("sz_pre",),
    "v_join": ("v_join",),
    "num_stages": ("num_stages",),
    "fused_reduce": ("fused_reduce",),
}
"""Knob -> the fields of :class:`LaunchChoice` its rules give."""

CHOICE_FIELDS = tuple(f for fields in KNOBS.values() for f in fields)
"""Every field of :class:`LaunchChoice`, in knob order."""

FEATURES = ("k_fmt", "v_fmt", "k_chan", "extras", "pairs", "max_len")
_BOUNDED = ("pairs", "max_len")  # numeric features: cached by the bucket of the bounds used


@dataclass(frozen=True)
class LaunchChoice:
    """One launch's choices: ``block_n`` tokens per tile, ``num_warps`` per program, ``waves``
    programs per SM the split count aims for, ``swap_ab`` products transposed, ``sz_pre`` sides
    (``"k"``/``"v"``) whose per-token scales are loaded once per tile, ``v_join`` one dot over
    the joined 2/3-bit value planes, ``num_stages`` software pipeline stages, ``fused_reduce``
    splits merged in the same launch."""

    block_n: int
    num_warps: int
    waves: float
    swap_ab: bool
    sz_pre: str
    v_join: bool
    num_stages: int
    fused_reduce: bool


def codec_format(codec: Any) -> str:
    """Format name a rule tests for one side: ``"fp4"``, ``"int{bits}"`` for bits below 16,
    else ``"float"`` (a codec without ``bits``, as the float codecs)."""
    if getattr(codec, "is_fp4", False):
        return "fp4"
    bits = getattr(codec, "bits", 16)
    return "float" if bits >= 16 else f"int{bits}"


def _has_extras(codec: Any) -> bool:
    # per-channel keys' outliers are a score correction and their ring holds incomplete pages:
    # neither counts here
    chan = getattr(codec, "channel", False)
    return bool((getattr(codec, "n_out", 0) and not chan) or getattr(codec, "n_sink", 0)
                or (getattr(codec, "window", 0) and not chan) or getattr(codec, "rotate", False))


def launch_features(k_codec: Any, v_codec: Any, batch: int = 1, n_kv_heads: int = 1,
                    max_len: int | None = None) -> dict[str, Any]:
    """The features rules test (see the module docstring) of one launch."""
    return {"k_fmt": codec_format(k_codec), "v_fmt": codec_format(v_codec),
            "k_chan": bool(getattr(k_codec, "channel", False)),
            "extras": _has_extras(k_codec) or _has_extras(v_codec),
            "pairs": batch * n_kv_heads, "max_len": max_len}


def _matches(cond: Any, value: Any) -> bool:
    if isinstance(cond, list):
        return value in cond
    if isinstance(cond, dict):
        if value is None:  # unknown length: longer than any bound
            return "max" not in cond
        return cond.get("min", value) <= value <= cond.get("max", value)
    return value == cond


def _bounds(cond: Any) -> list[int]:
    """Thresholds t of a numeric condition (its outcome is fixed between them: value >= t)."""
    if isinstance(cond, dict):
        return ([cond["min"]] if "min" in cond else []) + (
            [cond["max"] + 1] if "max" in cond else [])
    values = cond if isinstance(cond, list) else [cond]
    return [t for v in values for t in (v, v + 1)]  # value == v: v >= v and not v >= v + 1


class LaunchTable:
    """The rules of one configuration file (with what it extends) and a per-bucket cache.

    Args:
        name: file stem (``"default"``, ``"cpu"``, ``"nvidia_h200"``).
        knobs: knob -> rule list (:data:`KNOBS`).
    """

    def __init__(self, name: str, knobs: dict[str, list[dict]]):
        self.name = name
        self.knobs = knobs
        cuts: dict[str, set[int]] = {f: set() for f in _BOUNDED}
        for rules in knobs.values():
            for rule in rules:
                for f, cond in rule.get("when", {}).items():
                    if f in cuts:
                        cuts[f].update(_bounds(cond))
        self._cuts = {f: tuple(sorted(c)) for f, c in cuts.items()}
        self._cache: dict[tuple, LaunchChoice] = {}

    def pick(self, knob: str, feats: dict[str, Any]) -> dict[str, Any]:
        """Fields of the first rule of ``knob`` that matches ``feats``."""
        for rule in self.knobs[knob]:
            if all(_matches(c, feats[f]) for f, c in rule.get("when", {}).items()):
                return {k: rule[k] for k in KNOBS[knob]}
        raise LocalMoEError(f"launch config {self.name}: no rule of {knob} matches {feats}")

    def choose(self, k_codec: Any, v_codec: Any, batch: int = 1, n_kv_heads: int = 1,
               max_len: int | None = None) -> LaunchChoice:
        """The :class:`LaunchChoice` for keys/values stored by ``k_codec``/``v_codec``,
        ``batch`` sequences, ``n_kv_heads`` and ``max_len`` tokens (None: unknown, long)."""
        feats = launch_features(k_codec, v_codec, batch, n_kv_heads, max_len)
        key = tuple(feats[f] for f in FEATURES if f not in _BOUNDED) + tuple(
            None if feats[f] is None else tuple(feats[f] >= t for t in self._cuts[f])
            for f in _BOUNDED)
        hit = self._cache.get(key)
        if hit is None:
            fields: dict[str, Any] = {}
            for knob in KNOBS:
                fields.update(self.pick(knob, feats))
            hit = self._cache[key] = LaunchChoice(**fields)
        return hit


def device_key(name: str) -> str:
    """File stem for a device name: lower case, runs of other characters as ``_``
    (``"NVIDIA H200"`` -> ``"nvidia_h200"``)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _check(name: str, data: Any) -> None:
    if not isinstance(data, dict):
        raise LocalMoEError(f"launch config {name}: not a JSON object")
    for knob, rules in data.items():
        if knob in ("about", "extends"):
            continue
        if knob not in KNOBS or not isinstance(rules, list) or not rules:
            raise LocalMoEError(f"launch config {name}: {knob!r} is not a knob with rules "
                                f"(knobs: {', '.join(KNOBS)})")
        for i, rule in enumerate(rules):
            when = rule.get("when", {})
            bad = (set(rule) - set(KNOBS[knob]) - {"when", "why"}
                   or set(KNOBS[knob]) - set(rule) or set(when) - set(FEATURES))
            if bad or ("when" in rule) == (i == len(rules) - 1):
                raise LocalMoEError(f"launch config {name}: rule {i} of {knob} is malformed "
                                    f"({sorted(bad) if bad else 'only the last rule has no when'})")


def _read(name: str, seen: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    path = CONFIG_DIR / f"{name}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LocalMoEError(f"cannot read launch config {path}: {e}") from None
    _check(name, data)
    base = data.get("extends")
    if base in seen + (name,):
        raise LocalMoEError(f"launch config {name}: 'extends' loops back to {base}")
    knobs = _read(base, seen + (name,)) if base else {}
    knobs.update({k: v for k, v in data.items() if k in KNOBS})
    return knobs


@functools.lru_cache(maxsize=None)
def load_table(key: str) -> LaunchTable:
    """The table of ``configs/<key>.json``, else of ``configs/default.json``.

    Raises:
        LocalMoEError: the file is unreadable or malformed, or a knob has no rules.
    """
    name = key if (CONFIG_DIR / f"{key}.json").is_file() else "default"
    knobs = _read(name)
    missing = set(KNOBS) - set(knobs)
    if missing:
        raise LocalMoEError(f"launch config {name}: no rules for {', '.join(sorted(missing))}")
    return LaunchTable(name, knobs)


_BY_DEVICE: dict[str, LaunchTable] = {}


def table_for(device: Any) -> LaunchTable:
    """The :class:`LaunchTable` of a torch device: ``cpu.json`` for anything but CUDA, else the
    file named after the GPU (:func:`device_key`), else ``default.json``."""
    key = str(device)
    table = _BY_DEVICE.get(key)
    if table is None:
        if getattr(device, "type", None) != "cuda":
            table = load_table("cpu")
        else:
            import torch

            table = load_table(device_key(torch.cuda.get_device_name(device)))
        _BY_DEVICE[key] = table
    return table
