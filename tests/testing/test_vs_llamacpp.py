"""benchmarks/vs_llamacpp.py's llama.cpp rows, against a stand-in ``llama-bench`` (a script that
answers like the real one, and is slow or fails where told): each KV type's prompts and each
(KV type, depth)'s generation are separate runs, so one slow or failing run empties only its
own row's figures and says why."""
from __future__ import annotations

import importlib.util
import json
import stat
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_llamacpp.py"

FAKE = r'''#!PYTHON
import json, sys, time
a = sys.argv[1:]
opt = {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("-")}
kv, depth = opt.get("-ctk", "f16"), int(opt.get("-d", "0"))
n_gen = int(opt["-n"])
if (kv, depth) == SLOW:
    time.sleep(30)
if (kv, n_gen) == FAIL:
    sys.stderr.write("CUDA error: out of memory\n")
    sys.exit(1)
speed = {"f16": 1000.0, "q8_0": 800.0, "q4_0": 500.0}[kv] / (1 + depth / 1000)
recs = []
if n_gen == 0:
    for p in opt["-p"].split(","):
        recs.append({"type_k": kv, "type_v": kv, "n_prompt": int(p), "n_gen": 0,
                     "n_depth": 0, "avg_ts": 10 * speed, "build_commit": "abc123"})
else:
    recs.append({"type_k": kv, "type_v": kv, "n_prompt": 0, "n_gen": n_gen,
                 "n_depth": depth, "avg_ts": speed, "build_commit": "abc123"})
print(json.dumps(recs))
'''


def _tool():
    spec = importlib.util.spec_from_file_location("vs_llamacpp_under_test", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake(tmp_path, slow=(None, None), fail=(None, None)) -> Path:
    exe = tmp_path / "llama-bench"
    exe.write_text(FAKE.replace("PYTHON", sys.executable)
                   .replace("SLOW", repr(tuple(slow))).replace("FAIL", repr(tuple(fail))))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def _rows(tmp_path, **kw):
    tool = _tool()
    tool.gpu_mem_used_mib = lambda: None           # no nvidia-smi here
    return tool.run_llama_bench(_fake(tmp_path, **kw), tmp_path / "m.gguf", [0, 1000], 64, 512,
                                ["f16", "q4_0"], ttft_prompt=4096, reps=1, timeout=5)


def test_rows_of_every_kv_type_and_depth(tmp_path):
    rows = _rows(tmp_path)
    got = {(r["kv"], r["ctx"]): r for r in rows}
    assert list(got) == [("f16", 0), ("f16", 1000), ("q4_0", 0), ("q4_0", 1000)]
    assert got["f16", 0]["tpot_ms"] == 1.0 and got["f16", 1000]["tpot_ms"] == 2.0
    assert got["q4_0", 0]["prefill_tok_s"] == 5000.0 and got["q4_0", 1000]["prefill_tok_s"] is None
    assert got["f16", 0]["ttft_4096_ms"] == round(1e3 * 4096 / 10000, 1)
    assert all("llama_error" not in r and r["build"] == "abc123" for r in rows)
    json.dumps(rows)


def test_a_slow_run_empties_only_its_own_row(tmp_path):
    rows = _rows(tmp_path, slow=("q4_0", 1000))
    got = {(r["kv"], r["ctx"]): r for r in rows}
    slow = got["q4_0", 1000]
    assert slow["tpot_ms"] is None and "timed out after 5 s" in slow["llama_error"]
    assert got["q4_0", 0]["tpot_ms"] == 2.0 and got["q4_0", 0]["prefill_tok_s"] == 5000.0
    assert got["f16", 1000]["tpot_ms"] == 2.0 and "llama_error" not in got["f16", 1000]


def test_a_failing_run_says_why(tmp_path):
    rows = _rows(tmp_path, fail=("q4_0", 0))           # q4_0's prompt run fails
    got = {(r["kv"], r["ctx"]): r for r in rows}
    row = got["q4_0", 0]
    assert row["prefill_tok_s"] is None and "ttft_4096_ms" not in row
    assert "exit 1" in row["llama_error"] and "out of memory" in row["llama_error"]
    assert row["tpot_ms"] == 2.0                       # its generation run went through
    assert "llama_error" not in got["q4_0", 1000]      # the prompts' error: on the depth-0 row
    assert got["f16", 0]["prefill_tok_s"] == 10000.0
