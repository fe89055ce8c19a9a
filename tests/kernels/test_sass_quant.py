"""The ``stages`` launch choice really pipelines the quantized kernels' K loops: compiled for
sm_90 with the installed Triton and its ptxas (no GPU needed; benchmarks/sass_quant.py, in a
child process without TRITON_INTERPRET, which would have made the kernels interpreted), the
loop issues asynchronous copies into shared memory (``LDGSTS``) with ``stages`` 3 and plain
loads without (a change that silently drops the pipelining fails here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "sass_quant.py"


def _sass(kind: str, qtype: str, *cfgs: dict) -> list[dict]:
    """benchmarks/sass_quant.py's JSON line of each launch choice (skips without ptxas)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "nvdisasm").exists():
        pytest.skip("this Triton has no NVIDIA toolchain (ptxas, nvdisasm)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    args = [a for c in cfgs for a in ("--config", json.dumps(c))]
    r = subprocess.run([sys.executable, str(TOOL), kind, "--qtype", qtype, "--json", *args],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("kind,qtype,cfg", [
    ("gate_up", "Q4_K", {"BN": 32, "CH": 16, "num_warps": 4, "split": 2}),
    ("down", "Q4_K", {"BN": 4, "CH": 8, "num_warps": 2, "experts_tile": True}),
    ("gemv", "Q8_0", {"BN": 2, "CH": 32, "num_warps": 2}),
], ids=["gate_up-Q4_K", "down-Q4_K", "gemv-Q8_0"])
def test_stages_pipeline_the_k_loop(kind, qtype, cfg):
    plain, piped = _sass(kind, qtype, dict(cfg, stages=1), dict(cfg, stages=3))
    assert plain["ops"].get("LDG", 0) > 0 and "LDGSTS" not in plain["ops"], plain
    assert piped["ops"].get("LDGSTS", 0) > 0, piped
    assert piped["smem"] > plain["smem"]          # the stages' buffers


@pytest.mark.parametrize("kind,qtype,cfg", [
    ("gate_up", "Q4_K", {"BN": 32, "CH": 16, "num_warps": 4, "split": 2}),
    ("down", "Q4_K", {"BN": 4, "CH": 8, "num_warps": 4, "experts_tile": True}),
    ("gemv", "Q6_K", {"BN": 4, "CH": 64, "num_warps": 4}),
], ids=["gate_up-Q4_K", "down-Q4_K", "head-Q6_K"])
def test_no_weight_load_waits_for_the_x_exchange(kind, qtype, cfg):
    """Every global load of a K-loop tile is issued before the loop's first barrier (x's
    words reach the dots through shared memory; a load after that exchange waits one more
    round trip). The tile before session 21 had 1 / 3 / 6 such loads in these three launches
    (the H200 table's one-token choices); the MoE down launch was 6% faster without them."""
    out, = _sass(kind, qtype, dict(cfg, stages=1))
    assert out["ops"].get("LDG", 0) > 0 and out["ops"].get("BAR", 0) > 0, out
    assert out["late_loads"] == 0, out
