"""``moefy``: dense GGUF in, MoE GGUF out (see the package docstring)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from localmoe.testing.moefy.config import PRESETS, TARGET_ARCH, MoefyConfig, check_request

__all__ = ["moefy", "resolve_source", "preset_path", "build_preset", "check_with_llamacpp"]


def resolve_source(source: str | os.PathLike) -> Path:
    """A dense model path: an existing file, or a store name (``smollm2``, ``gemma3-270m``).

    Raises:
        FileNotFoundError: neither.
    """
    p = Path(source).expanduser()
    if p.is_file():
        return p
    from localmoe.io.store import ModelStore

    found = ModelStore().find(str(source))
    if found is None:
        raise FileNotFoundError(f"no model file or store entry {str(source)!r} "
                                f"(run `localmoe pull {source}` first)")
    return Path(found)


def moefy(source: str | os.PathLike, out: str | os.PathLike, cfg: MoefyConfig, *,
          plan_path: str | os.PathLike | None = None, progress=None) -> dict:
    """Build a MoE GGUF from a dense GGUF.

    Args:
        source: dense GGUF path or store name (llama such as SmolLM2, or gemma3).
        out: the GGUF to write (llama -> Mixtral-style ``llama``, or ``qwen2moe`` with
            ``cfg.shared_frac > 0``; gemma3 -> ``gemma4``).
        cfg: :class:`~localmoe.testing.moefy.config.MoefyConfig`.
        plan_path: where to save the plan (``.npz``); when it exists and was built from the same
            source and config it is reused instead of recomputed.
        progress: ``progress(message)`` callback.

    Returns:
        ``{"path", "plan", "seconds", "stats"}``; ``stats`` holds the stage timings.

    Raises:
        UnsupportedModelError: source family not supported or already a MoE.
        ValueError: ``n_experts`` not dividing ``d_ff``, ``top_k`` out of range, bad options.
        FileNotFoundError: no such source.
    """
    from localmoe.io.loader import open_model
    from localmoe.testing.moefy.experts import stored_experts
    from localmoe.testing.moefy.plan import MoePlan, build_plan

    t0 = time.perf_counter()
    src = resolve_source(source)
    mf = open_model(src)
    check_request(mf.spec, cfg, mf.tensor_names())   # before any work
    plan = None
    if plan_path and Path(plan_path).is_file():
        cached = MoePlan.load(plan_path)
        if cached.cfg == cfg and Path(cached.source).name == src.name:
            plan = cached
    if plan is None:
        plan = build_plan(mf, cfg, progress=progress)
        if plan_path:
            plan.save(plan_path)
    t1 = time.perf_counter()
    stored = {l: stored_experts(mf, l, lp) for l, lp in enumerate(plan.layers)}
    target = TARGET_ARCH[mf.spec.arch]
    if cfg.shared_frac:
        from localmoe.testing.moefy.arch_qwen2moe import write_qwen2moe_moe

        path = write_qwen2moe_moe(mf, plan, stored, out)
    elif target == "llama":
        from localmoe.testing.moefy.arch_llama import write_llama_moe

        path = write_llama_moe(mf, plan, stored, out)
    else:
        from localmoe.testing.moefy.arch_gemma4 import v_norm_exponent, write_gemma4_moe

        q = v_norm_exponent(plan.stats.get("max_mean_v2", 256.0), mf.spec.norm_eps)
        path = write_gemma4_moe(mf, plan, stored, out, v_exponent=q)
    stats = dict(plan.stats, write_s=round(time.perf_counter() - t1, 2))
    return {"path": Path(path), "plan": plan, "seconds": round(time.perf_counter() - t0, 2),
            "stats": stats}


def preset_path(preset: str, root: str | os.PathLike | None = None) -> Path:
    """Where a preset's GGUF is cached: ``<store root>/moefy/<preset>.gguf``."""
    if root is None:
        from localmoe.io.store.model_store import default_root

        root = default_root()
    return Path(root) / "moefy" / f"{preset}.gguf"


def build_preset(preset: str, *, root=None, force: bool = False, progress=None) -> Path:
    """Build (or reuse) a preset (:data:`~localmoe.testing.moefy.config.PRESETS`) in the cache.

    Raises:
        KeyError: unknown preset.
    """
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    source, cfg = PRESETS[preset]
    out = preset_path(preset, root)
    if out.is_file() and not force:
        return out
    moefy(source, out, cfg, plan_path=out.with_suffix(".plan.npz"), progress=progress)
    return out


def check_with_llamacpp(path, model_file, plan, tokens: list[int]) -> dict:
    """Logit agreement of llama.cpp on the written file with the in-memory reference of the
    same plan (:func:`.moe_model.moe_transformer`), as docs/PARITY_LLAMACPP.md measures it."""
    import torch

    from localmoe.testing.moefy.evaluate import llamacpp_logits, logit_agreement
    from localmoe.testing.moefy.experts import stored_experts
    from localmoe.testing.moefy.moe_model import moe_transformer

    stored = {l: stored_experts(model_file, l, lp) for l, lp in enumerate(plan.layers)}
    model = moe_transformer(model_file, plan, stored)
    with torch.no_grad():
        ours = model.forward_full(torch.tensor(tokens, dtype=torch.int64))
    return logit_agreement(ours, llamacpp_logits(path, tokens))
