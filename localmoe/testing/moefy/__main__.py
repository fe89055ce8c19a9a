"""CLI: ``python -m localmoe.testing.moefy`` (build a MoE GGUF from a dense one, or a preset)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    from localmoe.testing.moefy.config import PRESETS

    ap = argparse.ArgumentParser(
        prog="python -m localmoe.testing.moefy",
        description="turn a dense GGUF (SmolLM2 llama, Gemma-3) into a MoE GGUF llama.cpp runs")
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="build a preset into the store's moefy/ folder (other options ignored "
                         "except --out, --force, --threads)")
    ap.add_argument("--source", help="dense GGUF path or store name (smollm2, gemma3-270m)")
    ap.add_argument("--out", help="output .gguf")
    ap.add_argument("--experts", type=int, help="experts per layer (must divide d_ff)")
    ap.add_argument("--top-k", type=int, help="experts per token")
    ap.add_argument("--split", choices=("cluster", "random"), default="cluster")
    ap.add_argument("--router", choices=("trained", "centroid"), default="trained")
    ap.add_argument("--no-refit", action="store_true", help="per-expert scales only, no down refit")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--shared-frac", type=float, default=0.0, metavar="F",
                    help="keep a fraction F in [0, 1) of each FFN's neurons as an always-on "
                         "shared expert (written as qwen2moe; llama sources); 0 = none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan", help="save/reuse the plan (.npz) here")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--force", action="store_true", help="rebuild a cached preset")
    ap.add_argument("--check", action="store_true",
                    help="compare llama.cpp's logits on the result with the in-memory reference")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    import torch

    from localmoe.errors import LocalMoEError
    from localmoe.testing.moefy.build import build_preset, moefy
    from localmoe.testing.moefy.config import PRESETS, MoefyConfig

    if a.threads:
        torch.set_num_threads(a.threads)
    from localmoe.io.console import note as say  # stderr (dropped when closed), not stdout
    try:
        if a.out is not None:  # a path that cannot be written is found before the work
            why = _out_problem(Path(a.out))
            if why:
                say(f"error: --out {a.out}: {why}")
                return 2
        if a.preset:
            if a.out:
                source, cfg = PRESETS[a.preset]
                res = moefy(source, a.out, cfg, plan_path=a.plan, progress=say)
                print(json.dumps({"path": str(res["path"]), "seconds": res["seconds"],
                                  "stats": res["stats"]}))
            else:
                print(build_preset(a.preset, force=a.force, progress=say))
            return 0
        if not (a.source and a.out) or a.experts is None or a.top_k is None:  # (0: checked)
            _parser().error("give --preset, or --source, --out, --experts and --top-k")
        cfg = MoefyConfig(a.experts, a.top_k, split=a.split, router=a.router,
                          refit_down=not a.no_refit, calib_tokens=a.calib_tokens, seed=a.seed,
                          shared_frac=a.shared_frac)
        res = moefy(a.source, a.out, cfg, plan_path=a.plan, progress=say)
        report = {"path": str(res["path"]), "seconds": res["seconds"], "stats": res["stats"]}
        if a.check:
            from localmoe.io.loader import open_model
            from localmoe.testing.moefy.build import check_with_llamacpp, resolve_source
            from localmoe.testing.moefy.texts import corpus

            mf = open_model(resolve_source(a.source))
            from localmoe.text.tokenizer import Tokenizer

            tok = Tokenizer.from_model(mf)
            ids = tok.encode(corpus("python-docstrings", heldout=True)[:2000], add_special=True)[:256]
            report["llamacpp"] = check_with_llamacpp(res["path"], mf, res["plan"], ids)
        print(json.dumps(report))
        return 0
    except (LocalMoEError, ValueError, OSError, KeyError) as e:
        say(f"error: {e}")
        return 2


def _out_problem(out: Path) -> str | None:
    """Why ``out`` cannot be the output file (a folder; a file where a folder of its path
    must be), or None."""
    if out.is_dir():
        return "is a folder; give the .gguf file to write"
    for parent in out.parents:
        if parent.exists():
            return None if parent.is_dir() else f"{parent} is a file, not a folder"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
