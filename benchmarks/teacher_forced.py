"""Top-1 agreement of the quantized triton runner with the torch reference on real text.

For each GGUF model and activation precision (``--precisions``: the decode GEMVs' int8 codes,
or int8 codes plus their rounding error's, "int16"), feeds the same 256 tokens of mixed
prose/code/QA text (:data:`localmoe.testing.agreement.DEFAULT_TEXT`) one at a time to both
runners and reports top-1 agreement and the max / mean |delta log-softmax| against the torch
runner in each ``--ref-dtypes`` (dequantized weights). The fast path's bar is top-1 >= 99%.

Usage (GPU machine):
    python benchmarks/teacher_forced.py --models smollm2.gguf gemma3.gguf \
        --out benchmarks/results/teacher_forced_h200-<date>.json

Output: ``{"machine", "gpu", "date", "command", "rows": [{"model", "act_precision",
"tokens", "dtype", "ref_dtype", "top1", "max_dlogsm", "mean_dlogsm", "disagree",
"nonfinite"}]}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from localmoe.io.loader import open_model
from localmoe.testing.agreement import teacher_forced


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", required=True, type=Path)
    ap.add_argument("--precisions", default="int8,int16")
    ap.add_argument("--ref-dtypes", default="same,float32",
                    help="the torch runner's dtypes (same: the triton runner's)")
    ap.add_argument("--n-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = []
    for path in a.models:
        mf = open_model(str(path))
        for ref in a.ref_dtypes.split(","):
            for prec in a.precisions.split(","):
                r = teacher_forced(mf, a.n_tokens, device=a.device,
                                   ref_dtype=None if ref == "same" else getattr(torch, ref),
                                   act_precision=prec)
                row = {"model": path.name, "act_precision": prec,
                       **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps({
            "machine": platform.node(), "date": datetime.date.today().isoformat(),
            "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None,
            "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
