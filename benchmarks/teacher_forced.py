"""Top-1 agreement of the quantized triton runner with the torch reference on real text.

For each GGUF model and activation precision (``--precisions``: the decode GEMVs' int8 codes,
or int8 codes plus their rounding error's, "int16"), feeds the same 256 tokens of mixed
prose/code/QA text (:data:`localmoe.testing.agreement.DEFAULT_TEXT`) one at a time to both
runners and reports top-1 agreement and the max / mean |delta log-softmax| against the torch
runner in each ``--ref-dtypes`` (dequantized weights). The fast path's bar is top-1 >= 99%.

Without a GPU the kernels run through the Triton interpreter (``TRITON_INTERPRET=1`` is set
here): minutes per token for a real model, so use ``--n-tokens`` of a few dozen there.

Usage (GPU machine):
    python benchmarks/teacher_forced.py --models smollm2.gguf gemma3.gguf \
        --out benchmarks/results/teacher_forced_h200-<date>.json

``--reference-floor`` adds the torch runner in float16 against each reference: on a model whose
logits are nearly tied (the random-weight synthetic presets) float16 rounding alone flips the
top token at many positions, which bounds what any float16 engine can reach there.

Output: ``{"machine", "gpu", "date", "command", "rows": [{"model", "runner", "act_precision",
"tokens", "dtype", "ref_dtype", "top1", "max_dlogsm", "mean_dlogsm", "disagree",
"nonfinite"}]}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():   # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from localmoe.errors import LocalMoEError  # noqa: E402
from localmoe.io.loader import open_model  # noqa: E402
from localmoe.kernels.quant_gemv import ACT_PRECISIONS  # noqa: E402
from localmoe.testing.agreement import teacher_forced  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", required=True, type=Path, help="GGUF files")
    ap.add_argument("--precisions", default="int8,int16",
                    help=f"activation precisions, comma-separated ({', '.join(ACT_PRECISIONS)})")
    ap.add_argument("--ref-dtypes", default="same,float32",
                    help="the torch runner's dtypes (same: the triton runner's)")
    ap.add_argument("--n-tokens", type=int, default=256,
                    help="tokens of text compared (the first 16 are one prefill)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda[:N] or cpu (the Triton interpreter: slow)")
    ap.add_argument("--reference-floor", action="store_true",
                    help="also compare the torch runner in float16 with each reference: what "
                         "float16 rounding alone costs on the model")
    ap.add_argument("--out", type=Path, default=None, help="results JSON path")
    a = ap.parse_args(argv)
    bad = [p for p in a.precisions.split(",") if p not in ACT_PRECISIONS]
    if bad or a.n_tokens < 17:
        ap.error(f"unknown precision {bad[0]!r}" if bad else "--n-tokens must be at least 17")
    try:
        return _run(a)
    except LocalMoEError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(a) -> int:
    rows = []
    for path in a.models:
        mf = open_model(str(path))
        for ref in a.ref_dtypes.split(","):
            ref_dtype = None if ref == "same" else getattr(torch, ref)
            runs = [("triton", p, {"act_precision": p}) for p in a.precisions.split(",")]
            if a.reference_floor:
                runs.append(("torch", None, {"candidate": "torch", "dtype": torch.float16}))
            for cand, prec, opts in runs:
                r = teacher_forced(mf, a.n_tokens, device=a.device, ref_dtype=ref_dtype, **opts)
                row = {"model": path.name, "runner": cand, "act_precision": prec,
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
