"""Launch choices of the Triton kernels, read from data (``kernels/configs/*.json``).

Tile sizes, warps, programs per SM and the other launch choices of decode attention
(:func:`localmoe.kernels.decode_attention.decode_attention`), the quantized GEMV
(:func:`localmoe.kernels.quant_gemv.gemv_config`), the two launches of the fused MoE
(:func:`localmoe.kernels.fused_moe.moe_config`) and the MoE router
(:func:`localmoe.kernels.router.router_config`) are measured per device and kept as ordered rule
lists in one JSON file per device, not as code. A file is picked by the device's name,
normalized by :func:`device_key` (``torch.cuda.get_device_name`` ``"NVIDIA H200"`` ->
``nvidia_h200.json``); a CUDA device without a file of its own uses ``default.json``; every
other device (CPU tensors, run through the Triton interpreter) uses ``cpu.json``.
``LOCALMOE_LAUNCH_CONFIG=FILE`` (:data:`CONFIG_ENV`) makes every CUDA device use ``FILE``.

File layout::

    {"about": "...", "extends": "default",          # optional: knobs not given come from there
     "tile":  [{"when": {"pairs": {"min": 16}, "k_fmt": "int3", "k_chan": false},
                "block_n": 64, "num_warps": 4, "waves": 4.0, "why": "measured ..."},
               ...,
               {"block_n": 128, "num_warps": 4, "waves": 2.0}],      # last: no "when"
     "swap_ab": [...], "sz_pre": [...], "v_join": [...], "num_stages": [...],
     "fused_reduce": [...],
     "gemv": [{"when": {"n": {"min": 32768}}, "BN": 4, "CH": 64, "num_warps": 4, "xb": true,
               "stages": 1},
              {"BN": 1, "CH": 32, "num_warps": 1, "xb": false, "stages": 1}],
     "gemv_split": [...], "moe_gate_up": [...], "moe_down": [...], "router": [...]}

Each knob (:data:`KNOBS`) is a list of rules; the first rule whose ``when`` matches gives the
knob's fields (every rule gives all of them but the optional ones), and the last rule has no
``when`` (the fallback).
``why`` is a free-text note (where the choice was measured). Conditions (all must hold) test
features of one launch; each knob names the features it may test:

* decode attention, knobs ``tile`` (``block_n`` tokens per tile, ``num_warps``, ``waves``
  programs per SM), ``swap_ab``, ``sz_pre``, ``v_join``, ``num_stages``, ``fused_reduce`` (the
  fields of :class:`LaunchChoice`), features (:func:`launch_features`):

  - ``k_fmt``, ``v_fmt``: storage format of keys / values, ``"float"`` (f16/bf16/f32),
    ``"int8"``, ``"int4"``, ``"int3"``, ``"int2"`` or ``"fp4"`` (:func:`codec_format`);
  - ``k_chan``: keys grouped per channel (KIVI) rather than per token;
  - ``extras``: a side that reads outliers (per-token), sink or window buffers (per-token),
    or rotated keys;
  - ``pairs``: batch x kv heads, the (sequence, kv head) pairs of the launch;
  - ``max_len``: longest sequence in tokens (None, unknown, counts as longer than any bound).

* quantized GEMV of ``tokens`` rows of x against an ``[n, k]`` weight of GGUF type ``qtype``
  (the name, ``"Q8_0"``, ``"Q6_K"``, ...): knob ``gemv`` (``BN`` weight rows per program,
  ``CH`` chunks per K tile, ``num_warps``, ``xb``: x loaded once per row rather than per
  thread, ``stages``: 1 for a plain K loop, 2-4 to pipeline its loads through shared memory
  with that many buffers, Triton's ``tl.range(num_stages=)``; optional ``lookahead``, false
  when left out: the next tile's loads issued into registers before this tile's dots) and
  knob ``gemv_split``
  (``min_programs``, ``max_split``: K is split in two, four, ... while the grid has fewer
  than ``min_programs`` programs, at most ``max_split`` ways).

* fused MoE, knobs ``moe_gate_up`` (launch 1) and ``moe_down`` (launch 2), fields ``BN``,
  ``CH``, ``num_warps``, ``xb``, ``stages`` as for the GEMV, and ``maxnreg`` (a cap on
  registers per thread; 0: the compiler's choice); ``moe_gate_up`` also ``split`` (K parts per row block,
  the last to finish adding them), ``moe_down`` also ``experts_tile`` (a token's top-k
  experts as one dimension of the tile, every expert's rows requested at once, rather than
  their K loops one after another); features ``tokens``, ``top_k``,
  ``n_experts``, ``d_model``, ``d_ff`` (per expert), ``qtype`` (of that launch's weights).

* MoE router, knob ``router`` (``num_warps``) and the fused logits + routing launch of the
  decode step, knob ``router_fused`` (``num_warps``, ``experts_per_program``: logits per
  program, ``packed_topk``: one packed-key reduction per pick); features ``tokens``, ``n_experts``, ``top_k``.

A condition's value is a value (equal), a list (any of) or, for the numeric features
(:data:`NUMERIC`), ``{"min": a, "max": b}`` (bounds inclusive, either may be left out).
Lookups are cached per bucket of the bounds the rules use, so a launch costs one dict lookup.

:func:`write_config` writes rule lists into a file of this layout (the tuning script
``benchmarks/bench_quant_kernels.py --sweep --write-config``); :func:`tuned_rules` turns
measured timings of candidate choices into rules with their ``why`` notes.

Raises :class:`~localmoe.errors.LocalMoEError` for a file that does not follow this layout.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localmoe.errors import LocalMoEError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class Knob:
    """One knob: the ``fields`` each of its rules gives, the ``features`` its conditions
    may test, and ``optional`` fields a rule may leave out (a lookup gives one only where the
    rule has it; the launchers read a missing one as false)."""

    fields: tuple[str, ...]
    features: tuple[str, ...]
    optional: tuple[str, ...] = ()


ATTENTION_FEATURES = ("k_fmt", "v_fmt", "k_chan", "extras", "pairs", "max_len")
GEMV_FEATURES = ("tokens", "n", "k", "qtype")
MOE_FEATURES = ("tokens", "top_k", "n_experts", "d_model", "d_ff", "qtype")
ROUTER_FEATURES = ("tokens", "n_experts", "top_k")
_QUANT_TILE = ("BN", "CH", "num_warps", "xb", "stages")
_QUANT_OPTIONAL = ("lookahead",)

KNOBS: dict[str, Knob] = {
    "tile": Knob(("block_n", "num_warps", "waves"), ATTENTION_FEATURES),
    "swap_ab": Knob(("swap_ab",), ATTENTION_FEATURES),
    "sz_pre": Knob(("sz_pre",), ATTENTION_FEATURES),
    "v_join": Knob(("v_join",), ATTENTION_FEATURES),
    "num_stages": Knob(("num_stages",), ATTENTION_FEATURES),
    "fused_reduce": Knob(("fused_reduce",), ATTENTION_FEATURES),
    "gemv": Knob(_QUANT_TILE, GEMV_FEATURES, _QUANT_OPTIONAL),
    "gemv_split": Knob(("min_programs", "max_split"), GEMV_FEATURES),
    "moe_gate_up": Knob(_QUANT_TILE + ("split", "maxnreg"), MOE_FEATURES, _QUANT_OPTIONAL),
    "moe_down": Knob(_QUANT_TILE + ("experts_tile", "maxnreg"), MOE_FEATURES, _QUANT_OPTIONAL),
    "router": Knob(("num_warps",), ROUTER_FEATURES),
    "router_fused": Knob(("num_warps", "experts_per_program", "packed_topk"), ROUTER_FEATURES),
    "gemm": Knob(("BM", "BN", "num_warps", "num_stages"), GEMV_FEATURES),
    "moe_gemm": Knob(("BM", "BN", "num_warps", "num_stages"), MOE_FEATURES),
}
"""Knob name -> its fields and features; every configuration file (with what it extends)
gives rules for all of them."""

ATTENTION_KNOBS = ("tile", "swap_ab", "sz_pre", "v_join", "num_stages", "fused_reduce")
"""The knobs :meth:`LaunchTable.choose` combines into one :class:`LaunchChoice`."""

CHOICE_FIELDS = tuple(f for knob in ATTENTION_KNOBS for f in KNOBS[knob].fields)
"""Every field of :class:`LaunchChoice`, in knob order."""

FEATURES = ATTENTION_FEATURES

NUMERIC = frozenset({"pairs", "max_len", "tokens", "n", "k", "top_k", "n_experts", "d_model",
                     "d_ff"})
"""Features with numbers for values: their conditions may give bounds."""


@dataclass(frozen=True)
class LaunchChoice:
    """One decode-attention launch's choices: ``block_n`` tokens per tile, ``num_warps`` per
    program, ``waves`` programs per SM the split count aims for, ``swap_ab`` products
    transposed, ``sz_pre`` sides (``"k"``/``"v"``) whose per-token scales are loaded once per
    tile, ``v_join`` one dot over the joined 2/3-bit value planes, ``num_stages`` software
    pipeline stages, ``fused_reduce`` splits merged in the same launch."""

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
    """The features attention rules test (see the module docstring) of one launch."""
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


def _cuts(rule_lists: list[list[dict]]) -> dict[str, tuple[int, ...]]:
    """Numeric feature -> the sorted thresholds its conditions in ``rule_lists`` use."""
    cuts: dict[str, set[int]] = {}
    for rules in rule_lists:
        for rule in rules:
            for f, cond in rule.get("when", {}).items():
                if f in NUMERIC:
                    cuts.setdefault(f, set()).update(_bounds(cond))
    return {f: tuple(sorted(c)) for f, c in cuts.items()}


def _bucket_key(cuts: dict[str, tuple[int, ...]], names: tuple[str, ...],
                feats: dict[str, Any]) -> tuple:
    """Cache key of ``feats``: numeric features by the bucket of ``cuts`` they fall in (None
    stays None: unknown, longer than any bound), the others by value."""
    key = []
    for f in names:
        v = feats[f]
        if f in NUMERIC and v is not None:
            v = bisect.bisect_right(cuts.get(f, ()), v)
        key.append(v)
    return tuple(key)


class LaunchTable:
    """The rules of one configuration file (with what it extends) and per-bucket caches.

    Args:
        name: file stem (``"default"``, ``"cpu"``, ``"nvidia_h200"``).
        knobs: knob -> rule list (:data:`KNOBS`).
    """

    def __init__(self, name: str, knobs: dict[str, list[dict]]):
        self.name = name
        self.knobs = knobs
        self._knob_cuts = {knob: _cuts([rules]) for knob, rules in knobs.items()}
        self._attn_cuts = _cuts([knobs[k] for k in ATTENTION_KNOBS if k in knobs])
        self._cache: dict[tuple, LaunchChoice] = {}
        self._picks: dict[tuple, dict[str, Any]] = {}

    def pick(self, knob: str, feats: dict[str, Any]) -> dict[str, Any]:
        """Fields of the first rule of ``knob`` that matches ``feats`` (uncached)."""
        for rule in self.knobs[knob]:
            if all(_matches(c, feats[f]) for f, c in rule.get("when", {}).items()):
                spec = KNOBS[knob]
                return dict({k: rule[k] for k in spec.fields},
                            **{k: rule[k] for k in spec.optional if k in rule})
        raise LocalMoEError(f"launch config {self.name}: no rule of {knob} matches {feats}")

    def lookup(self, knob: str, **feats: Any) -> dict[str, Any]:
        """Fields of ``knob`` for one launch (a new dict), cached per bucket; ``feats`` gives
        every feature of the knob (:data:`KNOBS`), e.g. ``lookup("gemv", tokens=1, n=5120,
        k=2048, qtype="Q8_0")``.

        Raises:
            KeyError: a feature of the knob is missing.
        """
        key = (knob,) + _bucket_key(self._knob_cuts[knob], KNOBS[knob].features, feats)
        hit = self._picks.get(key)
        if hit is None:
            hit = self._picks[key] = self.pick(knob, feats)
        return dict(hit)

    def choose(self, k_codec: Any, v_codec: Any, batch: int = 1, n_kv_heads: int = 1,
               max_len: int | None = None) -> LaunchChoice:
        """The decode-attention :class:`LaunchChoice` for keys/values stored by
        ``k_codec``/``v_codec``, ``batch`` sequences, ``n_kv_heads`` and ``max_len`` tokens
        (None: unknown, long)."""
        feats = launch_features(k_codec, v_codec, batch, n_kv_heads, max_len)
        key = _bucket_key(self._attn_cuts, ATTENTION_FEATURES, feats)
        hit = self._cache.get(key)
        if hit is None:
            fields: dict[str, Any] = {}
            for knob in ATTENTION_KNOBS:
                fields.update(self.pick(knob, feats))
            hit = self._cache[key] = LaunchChoice(**fields)
        return hit


def device_key(name: str) -> str:
    """File stem for a device name: lower case, runs of other characters as ``_``
    (``"NVIDIA H200"`` -> ``"nvidia_h200"``)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _numeric_cond(cond: Any) -> bool:
    if isinstance(cond, dict):
        return bool(cond) and set(cond) <= {"min", "max"} and all(map(_is_number, cond.values()))
    if isinstance(cond, list):
        return bool(cond) and all(map(_is_number, cond))
    return _is_number(cond)


def _check_rule(name: str, knob: str, i: int, last: bool, rule: Any) -> None:
    spec = KNOBS[knob]
    if not isinstance(rule, dict) or not isinstance(rule.get("when", {}), dict):
        raise LocalMoEError(f"launch config {name}: rule {i} of {knob} is not an object "
                            f"with a 'when' object")
    when = rule.get("when", {})
    bad = (set(rule) - set(spec.fields) - set(spec.optional) - {"when", "why"}
           or set(spec.fields) - set(rule) or set(when) - set(spec.features))
    if bad or ("when" in rule) == last:
        raise LocalMoEError(f"launch config {name}: rule {i} of {knob} is malformed "
                            f"({sorted(bad) if bad else 'only the last rule has no when'})")
    for f, cond in when.items():
        if f in NUMERIC and not _numeric_cond(cond):
            raise LocalMoEError(f"launch config {name}: rule {i} of {knob}: the condition on "
                                f"{f} must be a number, a list of numbers or "
                                f"{{\"min\": a, \"max\": b}}, got {cond!r}")


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
            _check_rule(name, knob, i, i == len(rules) - 1, rule)


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LocalMoEError(f"cannot read launch config {path}: {e}") from None


def _read(name: str, seen: tuple[str, ...] = (), path: Path | None = None) -> dict[str, list[dict]]:
    data = _load_json(path or CONFIG_DIR / f"{name}.json")
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
    return _complete_table(name, _read(name))


def _complete_table(name: str, knobs: dict[str, list[dict]]) -> LaunchTable:
    missing = set(KNOBS) - set(knobs)
    if missing:
        raise LocalMoEError(f"launch config {name}: no rules for {', '.join(sorted(missing))} "
                            "(add them, or 'extends' a file that has them)")
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
        elif os.environ.get(CONFIG_ENV):
            table = load_file(os.environ[CONFIG_ENV])
        else:
            import torch

            table = load_table(device_key(torch.cuda.get_device_name(device)))
        _BY_DEVICE[key] = table
    return table


CONFIG_ENV = "LOCALMOE_LAUNCH_CONFIG"
"""Environment variable: a configuration file used on every CUDA device instead of the
device's own (e.g. rules just written by ``bench_quant_kernels.py --sweep --write-config
FILE``, tried without editing ``kernels/configs``); its ``extends`` names a file there."""


@functools.lru_cache(maxsize=None)
def load_file(path: str | Path) -> LaunchTable:
    """The :class:`LaunchTable` of the configuration file ``path`` (what :data:`CONFIG_ENV`
    names), with the knobs it does not give from the file it ``extends``.

    Raises:
        LocalMoEError: the file is unreadable or malformed, or a knob has no rules.
    """
    path = Path(path)
    return _complete_table(str(path), _read(str(path), path=path))


def device_table(device: Any = None) -> LaunchTable:
    """:func:`table_for` of ``device`` (a torch device or its name); None: ``default.json``
    (a CUDA device without a file of its own)."""
    if device is None:
        return load_table("default")
    if isinstance(device, str):
        import torch

        device = torch.device(device)
    return table_for(device)


# ---- writing (the tuning scripts) -----------------------------------------------------------
def format_config(data: dict[str, Any]) -> str:
    """JSON text of a configuration: one line per top-level entry and per rule."""
    parts = []
    for key, value in data.items():
        if isinstance(value, list):
            rules = ",\n".join(f"    {json.dumps(r, ensure_ascii=False)}" for r in value)
            parts.append(f"  {json.dumps(key)}: [\n{rules}\n  ]")
        else:
            parts.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_config(path: str | Path, knobs: dict[str, list[dict]], about: str = "",
                 extends: str | None = "default") -> dict[str, Any]:
    """Write the rule lists ``knobs`` (knob -> rules) into the configuration file ``path``.

    An existing file keeps its other knobs, ``about`` and ``extends``; the given knobs replace
    its own. A new file gets ``about`` and ``extends`` (None: none; a new device's file takes
    the knobs it does not give from ``default.json``). The result is checked before anything
    is written and :func:`load_table`'s cache is cleared.

    Returns:
        The data written.
    Raises:
        LocalMoEError: malformed rules, or an existing file that cannot be read.
    """
    path = Path(path)
    if path.is_file():
        data = _load_json(path)
        _check(path.stem, data)
    else:
        data = {"about": about} if about else {}
        if extends:
            data["extends"] = extends
    data.update(knobs)
    _check(path.stem, data)
    path.write_text(format_config(data), encoding="utf-8")
    load_table.cache_clear()
    load_file.cache_clear()
    _BY_DEVICE.clear()
    return data


def _fmt_fields(fields: dict[str, Any]) -> str:
    return ",".join(f"{k}={json.dumps(v)}" for k, v in fields.items())


def _point_note(axis: str, value: int, win: tuple[dict, float],
                ranked: list[tuple[dict, float]]) -> str:
    note = f"{axis}={value}: {_fmt_fields(win[0])} {win[1]:.2f} us"
    other = next((c for c in ranked if c[0] != win[0]), None)
    if other is not None:
        what = "fastest" if other[1] < win[1] else "next"
        note += f" ({what} {_fmt_fields(other[0])} {other[1]:.2f} us)"
    return note


def tuned_rules(knob: str, axis: str, points: list[tuple[int, list[tuple[dict, float | None]]]],
                label: str = "", when: dict[str, Any] | None = None, fallback: bool = True,
                context: str = "", tie: float = 0.02) -> list[dict]:
    """Rules of ``knob`` from timings of candidate choices at several values of one numeric
    feature (what the tuning scripts measure).

    Args:
        knob: a knob of :data:`KNOBS`; each candidate gives exactly its fields.
        axis: the numeric feature the points vary (``"tokens"``, ``"n_experts"``).
        points: ``(value, candidates)`` in ascending order of value, ``candidates`` a list of
            ``(fields, us)``: the time of that choice, summed over the cases measured at that
            value, None where it failed or did not run.
        label: what was measured (shapes, types), for the notes.
        when: conditions every rule adds (e.g. ``{"n": {"min": 32768}}`` for output heads).
        fallback: the last rule has no ``when`` (the knob's last rule); else it keeps ``when``.
        context: the notes' prefix (device, date, script).
        tie: candidates within this fraction of the fastest time count as equally fast; the
            first of them in the candidate list wins (lists put the current or simplest choice
            first), so timing noise neither flips a choice nor splits a rule.
    Returns:
        The fastest candidate (see ``tie``) at each value as rules; neighbouring values with
        the same winner share a rule. A rule covers values up to its last point (``{"max": v}``), the last
        rule every larger value. ``why`` names the measurement: ``context``, ``label``, then
        per point the winner's time and the runner-up's.
    Raises:
        LocalMoEError: no points, a value where no candidate ran, or candidates whose fields
        are not the knob's.
    """
    groups: list[tuple[int, dict, list[str]]] = []   # (last value, fields, notes)
    if not points:
        raise LocalMoEError(f"tuned_rules {knob}: no measurements")
    for value, cands in points:
        ran = [(f, us) for f, us in cands if us is not None]
        if not ran:
            raise LocalMoEError(f"tuned_rules {knob}: no candidate ran at {axis}={value} {label}")
        ranked = sorted(ran, key=lambda c: c[1])
        win = next(c for c in ran if c[1] <= ranked[0][1] * (1 + tie))
        spec = KNOBS[knob]
        if not set(spec.fields) <= set(win[0]) <= set(spec.fields) | set(spec.optional):
            raise LocalMoEError(f"tuned_rules {knob}: candidate {win[0]} does not give "
                                f"exactly {spec.fields} (and optionally {spec.optional})")
        note = _point_note(axis, value, win, ranked)
        if groups and groups[-1][1] == win[0]:
            groups[-1] = (value, groups[-1][1], groups[-1][2] + [note])
        else:
            groups.append((value, dict(win[0]), [note]))
    rules = []
    for i, (last, fields, notes) in enumerate(groups):
        cond = dict(when or {})
        if i < len(groups) - 1:
            cond[axis] = {"max": last}
        why = context + (f"{label}: " if label else "") + "; ".join(notes)
        rule = ({"when": cond} if cond else {}) | fields | {"why": why}
        rules.append(rule)
    if fallback:
        rules[-1].pop("when", None)
    elif "when" not in rules[-1]:
        raise LocalMoEError(f"tuned_rules {knob}: a rule that is not the fallback needs a when")
    return rules
