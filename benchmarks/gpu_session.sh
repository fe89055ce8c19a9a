#!/usr/bin/env bash
# One stage of a GPU measurement session on a machine with an NVIDIA GPU and no package index
# (docs/DEVELOPMENT.md, "GPU measurements"): each stage fits in one 10-minute call and writes
# what it measured under $OUT (default ./gpu-out).
#
#   benchmarks/gpu_session.sh install  the wheels and localmoe only (then export PYTHONPATH=/tmp/site)
#   benchmarks/gpu_session.sh check    GPU tests of the kernels and the triton backend (~4 min)
#   benchmarks/gpu_session.sh quant    GPU tests of every weight type's kernels (IQ4_NL/IQ4_XS, Q2_K,
#                                      Q3_K included), the launch tape and the sampler, then the
#                                      expert launches' times by expert type, cold and with
#                                      their weights in L2 (--l2: a prefetch's bound) (~8 min)
#   benchmarks/gpu_session.sh history  the slow-state checks of graph_history.py on the Qwen3
#                                      file: the kernels it slows (profiled), the logits' hash,
#                                      the allocator's reserved MiB, other histories (~8 min)
#   benchmarks/gpu_session.sh slots    the MoE launches and the decode graph with and without
#                                      the slot-table read, A/B/A/B (~8 min)
#   benchmarks/gpu_session.sh int2gap  int2 KV at 64k: the graph against its kernels' sum with the
#                                      long-context tile varied (INT2_VARIANTS), f16 beside (~8 min)
#   benchmarks/gpu_session.sh trace    time stamps of every program of the MoE's two launches
#                                      (benchmarks/trace_moe.py), 1 and 8 tokens (~4 min)
#   benchmarks/gpu_session.sh ahead    GPU tests of the look-ahead K loops, then the trace of the
#                                      MoE launches with look-ahead tiles beside the table's
#                                      and whole-K down tiles (~5 min)
#   benchmarks/gpu_session.sh aheadgraph  the decode graph with the table's one-token MoE rules
#                                      changed (AHEAD_VARIANTS), A/B/A/B in fresh processes (~6 min)
#   benchmarks/gpu_session.sh codeab   the decode graph (and the MoE trace) of the working tree
#                                      against older copies of some of its files (CODE_AB_DIR,
#                                      default .ab/: the same relative paths), A/B/A/B (~5 min)
#   benchmarks/gpu_session.sh codeablong  the same swap timed by vs_llamacpp at long context
#                                      (CODE_AB_KV, CODE_AB_DEPTHS: f16/int2 at 64k, 16k) (~7 min)
#   benchmarks/gpu_session.sh envab    the decode graph with environment switches (ENV_VARIANTS,
#                                      {tag: {VAR: value}}) against none, A/B/A/B in fresh
#                                      processes (~1 min per variant)
#   benchmarks/gpu_session.sh attn     decode attention at 1 x 16k / 64k: f16, int2:c/int2,
#                                      int4:c/int4, the table's tile against 16-token tiles
#                                      and 16 waves (~6 min; ATTN_CONTEXTS, ATTN_BATCHES,
#                                      ATTN_FORMATS, ATTN_VARIANTS: other cases)
#   benchmarks/gpu_session.sh tune     sweep of the MoE gate/up split and the fused router
#                                      (rules printed and saved, not written to kernels/configs)
#   benchmarks/gpu_session.sh qwen3    localmoe rows of vs_llamacpp on the Qwen3-30B-A3B-shaped
#                                      file: f16/int4/int2 KV at 0, 16k, 64k (~6 min)
#   benchmarks/gpu_session.sh presets  localmoe rows on the OLMoE and Mixtral-shaped files
#   benchmarks/gpu_session.sh llama    llama.cpp rows on all three files (needs LLAMA_SRC: the
#                                      llama-cpp-python sdist's vendor tree as a .tar.xz;
#                                      LLAMA_PRESETS, LLAMA_KV, LLAMA_DEPTHS, LLAMA_TTFT,
#                                      LLAMA_TIMEOUT: seconds per llama-bench run); a later
#                                      qwen3 stage on the same warm machine merges its rows
#
# Packages the machine lacks travel as wheels in WHEELS (default .whl/): they are installed
# into /tmp/site; localmoe itself is installed editable without dependencies.
set -u
STAGE=${1:?usage: gpu_session.sh install|check|quant|history|slots|trace|ahead|aheadgraph|codeab|codeablong|envab|int2gap|attn|tune|qwen3|presets|llama}
OUT=${OUT:-$PWD/gpu-out}
WHEELS=${WHEELS:-.whl}
MODELS=${MODELS:-/tmp/models}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
export PYTHONUNBUFFERED=1
# the synthetic Qwen3-30B-A3B file under $MODELS (written on first use): its path in F
qwen3_file() {
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import vs_llamacpp as V; from pathlib import Path; print(V.ensure_file('qwen3-30b-a3b', Path('$MODELS'), None))" \
    >"$OUT/file.log" 2>&1 || { cat "$OUT/file.log"; exit 1; }
  F=$(tail -1 "$OUT/file.log")
}
# codeab / codeablong: the older files under CODE_AB_DIR (default .ab/, at their paths in the
# tree) in FILES, the tree's own copied to /tmp/ab-new; `use DIR` puts one set in place
code_ab_files() {
  AB=${CODE_AB_DIR:-.ab}
  FILES=$(cd "$AB" && find . -type f -name '*.py' | sed 's|^\./||')
  [ -n "$FILES" ] || { echo "$STAGE: no .py files under $AB" >&2; exit 2; }
  mkdir -p /tmp/ab-new
  for f in $FILES; do mkdir -p "/tmp/ab-new/$(dirname "$f")"; cp "$f" "/tmp/ab-new/$f"; done
}
use() { for f in $FILES; do cp "$1/$f" "$f"; done; }
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# localmoe.kernels, not localmoe: the repository root holds a localmoe/ folder, so a plain
# "import localmoe" succeeds there without the install that maps kernels/ and backends/ in
python3 -c "import localmoe.kernels" 2>/dev/null || \
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/pip.log" 2>&1
python3 -c "import localmoe, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" \
  || exit 1
say "installed"

case "$STAGE" in
  check)
    timeout 420 python3 -m pytest -q -p no:cacheprovider \
      tests/kernels/test_fused_moe.py tests/kernels/test_router.py tests/kernels/test_pdl.py \
      tests/backends/test_triton_quant.py >"$OUT/check.log" 2>&1
    say "tests rc=$?"; tail -5 "$OUT/check.log"
    ;;
  quant)
    timeout 330 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_gemv.py \
      tests/kernels/test_quant_gemm.py tests/kernels/test_qtensor.py tests/kernels/test_sampling.py \
      tests/backends/test_launch_tape.py "tests/backends/test_triton_quant.py::test_low_bit_and_iq4_files_run_in_their_blocks" \
      >"$OUT/quant.log" 2>&1
    say "tests rc=$?"; tail -5 "$OUT/quant.log"
    timeout 240 python3 benchmarks/bench_quant_kernels.py --models qwen3-30b-a3b --tokens 1 8 \
      --expert-qtypes Q4_K IQ4_XS Q3_K --l2 --out "$OUT/expert_qtypes.json" >"$OUT/expert_qtypes.log" 2>&1
    say "expert qtypes rc=$?"; tail -15 "$OUT/expert_qtypes.log"
    ;;
  history)
    qwen3_file
    # session 25: the slow state needs both prompts and then any allocation; a recapture
    # restores it. Which kernels slow down, do the logits stay the same, does any cudaMalloc
    # (reserved MiB) or only one after both prompts flip it, and is a second prompt enough
    # Then one with LOCALMOE_GRAPH_REFRESH=1 (a graph captured again when the allocator grew;
    # session 26: it does not catch the slow state)
    for spec in "profile:fresh,warm512,ttft4096,alloc,fresh,recapture,fresh --profile" \
                "bigalloc:fresh,bigalloc,fresh" "pp:fresh,warm512,pp512,alloc,fresh" \
                "ttft2:fresh,ttft4096,ttft4096,alloc,fresh" \
                "refresh:fresh,warm512,ttft4096,alloc,fresh,fresh"; do
      tag=${spec%%:*}
      [ "$tag" = refresh ] && R=1 || R=0   # (0 is the default)
      LOCALMOE_GRAPH_REFRESH=$R timeout 130 python3 benchmarks/graph_history.py "$F" ${spec#*:} \
        --host-only >"$OUT/history-$tag.jsonl" 2>"$OUT/history-$tag.err"
      say "history $tag rc=$?"; python3 benchmarks/graph_history.py summarize "$OUT/history-$tag.jsonl"
    done
    ;;
  slots)
    # session 26: the decode MoE kernels skip the identity slot table (one dependent load less
    # per program). A/B/A/B: the launches alone, then the decode graph in fresh processes
    for i in 1 2; do
      for v in "" "--slot-table"; do
        tag=slots${v:+-table}-$i
        timeout 80 python3 benchmarks/bench_quant_kernels.py --models qwen3-30b-a3b --tokens 1 8 \
          $v --out "$OUT/$tag.json" >"$OUT/$tag.log" 2>&1
        say "$tag rc=$?"; grep -E "moe|quant\+moe" "$OUT/$tag.log" | head -4
      done
    done
    qwen3_file
    for i in 1 2; do
      for t in 0 1; do
        LOCALMOE_MOE_SLOT_TABLE=$t timeout 55 python3 benchmarks/graph_history.py "$F" fresh \
          --host-only >"$OUT/graph-slots$t-$i.jsonl" 2>&1
        say "graph slot_table=$t rc=$?"; grep -o '"graph_ms": \[[^]]*\]' "$OUT/graph-slots$t-$i.jsonl"
      done
    done
    ;;
  trace)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_trace.py \
      >"$OUT/trace-tests.log" 2>&1
    say "trace tests rc=$?"; tail -3 "$OUT/trace-tests.log"
    # session 29 (sm_90 SASS): down with the whole K of Qwen3's experts (24 chunks) in one
    # 32-chunk tile has 128 registers, so its 512 programs still fit one wave (4 per SM) with
    # every weight load in flight at once; 16-chunk tiles: two round trips instead of three
    timeout 300 python3 benchmarks/trace_moe.py --tokens 1 8 \
      --variant 'split1={"gate_up": {"split": 1}}' \
      --variant 'split4={"gate_up": {"split": 4}}' \
      --variant 'down_k32={"down": {"BN": 4, "CH": 32, "num_warps": 4, "experts_tile": true}}' \
      --variant 'down_k16={"down": {"BN": 4, "CH": 16, "num_warps": 4, "experts_tile": true}}' \
      --out "$OUT/trace_moe.json" >"$OUT/trace_moe.log" 2>&1
    say "trace rc=$?"; cat "$OUT/trace_moe.log" | head -150
    timeout 120 python3 benchmarks/trace_moe.py --tokens 1 --no-route \
      --out "$OUT/trace_moe_noroute.json" >"$OUT/trace_moe_noroute.log" 2>&1
    say "trace no-route rc=$?"; head -40 "$OUT/trace_moe_noroute.log"
    ;;
  ahead)
    # session 30: the K loops with the next tile's loads issued before this tile's dots
    # (lookahead; sm_90: gate/up CH 8 128 registers, CH 16 220: two waves; down CH 8 92; in
    # the H200 table for Qwen3's one-token launches since session 30, measured on an H100).
    # AHEAD_TESTS=0 skips the GPU tests; AHEAD_TRACE: {name: fused_moe config} to trace
    # (the table's own launch is traced first; "{}" traces it again, for order effects;
    # "@alloc" / "@empty_cache" steps between; default: the table against the plain loops)
    if [ "${AHEAD_TESTS:-1}" = 1 ]; then
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py \
        tests/kernels/test_quant_gemv.py -k "lookahead" >"$OUT/ahead-tests.log" 2>&1
      say "lookahead tests rc=$?"; tail -3 "$OUT/ahead-tests.log"
    fi
    VARS=$(python3 -c '
import json, os, shlex
v = json.loads(os.environ.get("AHEAD_TRACE") or json.dumps({
    "t2": {},     # the table again (the launch gaps of later graphs in a process)
    "plain": {"gate_up": {"CH": 16, "lookahead": False}, "down": {"lookahead": False}},
    "t3": {}}))
print(" ".join(shlex.quote(f"--variant={k}={json.dumps(c)}") for k, c in v.items()))')
    eval "timeout 300 python3 benchmarks/trace_moe.py --tokens 1 $VARS --out \"\$OUT/trace_ahead.json\"" \
      >"$OUT/trace_ahead.log" 2>&1
    say "trace rc=$?"; grep -E "^==|->loop |last_exit|last_entry" "$OUT/trace_ahead.log" | head -90
    ;;
  aheadgraph)
    qwen3_file
    # AHEAD_VARIANTS: {tag: {knob: changes to the knob's first rule that Qwen3-30B-A3B's
    # one-token launch matches}}; every tag's table and the table itself, alternated twice
    # (default: the plain K loops of before session 30 against the table's look-ahead)
    python3 - "$OUT" <<'PY'
import copy, json, os, sys
from localmoe.kernels import launch_config as lc
t = json.load(open("kernels/configs/nvidia_h200.json"))
feats = dict(tokens=1, top_k=8, n_experts=128, d_model=2048, d_ff=768, qtype="Q4_K", n=4096, k=2048)
var = json.loads(os.environ.get("AHEAD_VARIANTS") or json.dumps(
    {"plain": {"moe_gate_up": {"CH": 16, "lookahead": False}, "moe_down": {"lookahead": False}}}))
for tag, knobs in var.items():
    v = copy.deepcopy(t)
    for knob, ch in knobs.items():
        r = next(r for r in v[knob] if all(lc._matches(c, feats[f])
                                           for f, c in r.get("when", {}).items()))
        r.update(ch)
    json.dump(v, open(f"{sys.argv[1]}/lc-{tag}.json", "w"), indent=1)
print(" ".join(var))
PY
    TAGS=$(python3 -c "import json, os; print(' '.join(json.loads(os.environ.get('AHEAD_VARIANTS') or '{\"plain\": 0}')))")
    for i in 1 2; do
      for v in base $TAGS; do
        lc=""; [ "$v" = base ] || lc="$OUT/lc-$v.json"
        LOCALMOE_LAUNCH_CONFIG=$lc timeout 70 python3 benchmarks/graph_history.py "$F" fresh \
          --host-only >"$OUT/graph-$v-$i.jsonl" 2>&1
        say "graph $v rc=$?"; grep -o '"graph_ms": \[[^]]*\]' "$OUT/graph-$v-$i.jsonl"
      done
    done
    ;;
  codeab)
    # a change to the kernels' code (not to a launch choice) against the code before it:
    # CODE_AB_DIR holds the older files at their paths in the tree (e.g. .ab/kernels/fused_moe.py,
    # written by `git show REV:kernels/fused_moe.py`); each run swaps them in or out
    code_ab_files
    qwen3_file
    for i in 1 2; do
      for v in new old; do
        [ $v = new ] && use /tmp/ab-new || use "$AB"
        timeout 70 python3 benchmarks/graph_history.py "$F" fresh --host-only \
          >"$OUT/graph-$v-$i.jsonl" 2>&1
        say "graph $v rc=$?"; grep -o '"graph_ms": \[[^]]*\]' "$OUT/graph-$v-$i.jsonl"
      done
    done
    for v in new old; do
      [ $v = new ] && use /tmp/ab-new || use "$AB"
      timeout 120 python3 benchmarks/trace_moe.py --tokens 1 --variant 't2={}' \
        --out "$OUT/trace-$v.json" >"$OUT/trace-$v.log" 2>&1
      say "trace $v rc=$?"; grep -E "^==|routed|->loop |last_exit|gap" "$OUT/trace-$v.log" | head -30
    done
    use /tmp/ab-new
    ;;
  codeablong)
    # the same swap as codeab, timed by vs_llamacpp's rows at long context (CODE_AB_KV formats
    # at CODE_AB_DEPTHS, default f16 and int2 at 16k and 64k), new/old alternated, two rounds
    code_ab_files; mkdir -p /tmp/ablong
    qwen3_file
    for i in 1 2; do
      for d in ${CODE_AB_DEPTHS:-65536 16384}; do
        for kv in ${CODE_AB_KV:-f16 int2}; do
          for v in new old; do
            [ $v = new ] && use /tmp/ab-new || use "$AB"
            timeout 100 python3 benchmarks/vs_llamacpp.py --preset qwen3-30b-a3b --model-dir "$MODELS" \
              --kv $kv --depths $d --no-eager --out "/tmp/ablong/$v-$kv-$d-$i.json" >"$OUT/ablong.log" 2>&1
            say "$v $kv $d rc=$?"; grep -o '"graph_ms": [0-9.]*\|"tpot_generate_ms": [0-9.]*\|"kernel_us_per_token": [0-9.]*' "$OUT/ablong.log" | head -3 | tr '\n' ' '; echo
          done
        done
      done
    done
    use /tmp/ab-new
    # every run's row in one file (the file count that comes back is limited)
    python3 - "$OUT/ablong.json" /tmp/ablong/*.json <<'PY'
import json, os, sys
rows = {}
for f in sys.argv[2:]:
    d = json.load(open(f))
    rows[os.path.basename(f)[:-5]] = {"gpu": d.get("gpu"), "command": d.get("command"),
                                      "rows": [r for r in d["rows"] if r.get("engine") == "localmoe"]}
json.dump(rows, open(sys.argv[1], "w"), indent=1)
PY
    ;;
  envab)
    # a switch of the fused step read from the environment (ENV_VARIANTS: {tag: {VAR: value}},
    # e.g. '{"nopdl": {"LOCALMOE_PDL": "0"}}') against the defaults
    : "${ENV_VARIANTS:?set ENV_VARIANTS to a JSON object {tag: {VAR: value}}}"
    qwen3_file
    VARS=$ENV_VARIANTS
    TAGS=$(python3 -c "import json, sys; print(' '.join(json.loads(sys.argv[1])))" "$VARS")
    for i in 1 2; do
      for v in base $TAGS; do
        ENVS=$(python3 -c "import json, sys; d = json.loads(sys.argv[1]).get(sys.argv[2], {}); print(' '.join(f'{k}={x}' for k, x in d.items()))" "$VARS" "$v")
        env $ENVS timeout 70 python3 benchmarks/graph_history.py "$F" fresh --host-only \
          >"$OUT/graph-$v-$i.jsonl" 2>&1
        say "graph $v ($ENVS) rc=$?"; grep -o '"graph_ms": \[[^]]*\]' "$OUT/graph-$v-$i.jsonl"
      done
    done
    ;;
  int2gap)
    # session 28: at 64k the int2 graph is ~250 us per token longer than its kernels' sum on the
    # H200 with PDL off as on (f16: shorter), and one shared-memory carveout for every kernel
    # made it worse. Does the split kernel's shape cause the gaps (8 waves of one-warp 16 KB
    # programs)? The default int2 cache at 64k with the H200 table's long-context tile changed
    # (LOCALMOE_LAUNCH_CONFIG files written here), against f16, in fresh processes
    qwen3_file   # (written before the timed runs)
    # the tile variants: INT2_TILES, a JSON object {tag: changes to the rule; the attention
    # knobs fused_reduce, num_stages, sz_pre, swap_ab, v_join get a rule of their own for
    # those cases}; the runs:
    # INT2_VARIANTS (f16, base = the table, or a tag), each at every depth of INT2_DEPTHS
    python3 - "$OUT" <<'PY'
import copy, json, os, sys
from localmoe.kernels import launch_config as lc
t = json.load(open("kernels/configs/nvidia_h200.json"))
i = next(i for i, r in enumerate(t["tile"]) if r.get("when", {}).get("k_chan") is True
         and r["when"].get("k_fmt") == "int2" and "min" in r["when"].get("max_len", {}))
tiles = json.loads(os.environ.get("INT2_TILES") or json.dumps(
    {"w4": {"waves": 4.0}, "w2": {"waves": 2.0},
     "b64": {"block_n": 64, "num_warps": 2, "waves": 4.0},
     "b128": {"block_n": 128, "num_warps": 4, "waves": 2.0}}))
for tag, ch in tiles.items():
    v = copy.deepcopy(t)
    ch = dict(ch)
    for knob in (k for k in lc.ATTENTION_KNOBS if k != "tile"):
        if knob in ch:   # another attention knob (e.g. fused_reduce: the splits merged in the
            # split launch), for the same cases
            v[knob].insert(0, {"when": v["tile"][i]["when"], knob: ch.pop(knob)})
    v["tile"][i].update(ch)
    json.dump(v, open(f"{sys.argv[1]}/lc-{tag}.json", "w"), indent=1)
PY
    for d in ${INT2_DEPTHS:-65536}; do
      for v in ${INT2_VARIANTS:-f16 base w4 w2 b64 b128}; do
        kv=int2; lc=""
        case "$v" in f16) kv=f16;; base) ;; *) lc="$OUT/lc-$v.json";; esac
        LOCALMOE_LAUNCH_CONFIG=$lc timeout 100 python3 benchmarks/vs_llamacpp.py --preset qwen3-30b-a3b \
          --model-dir "$MODELS" --kv $kv --depths $d --no-eager --out "$OUT/int2gap-$v-$d.json" \
          >"$OUT/int2gap-$v-$d.log" 2>&1
        say "int2gap $v $d rc=$?"; grep -o '"graph_ms": [0-9.]*\|"tpot_generate_ms": [0-9.]*\|"kernel_us_per_token": [0-9.]*' "$OUT/int2gap-$v-$d.log" | head -3 | tr '\n' ' '; echo
      done
    done
    ;;
  attn)
    # session 26 (static, sm_90): with the separate reduction kernel the int2:c/int2 split
    # kernel at the table's 64k tile (32 tokens, one warp) has 176 registers; 16-token
    # one-warp tiles 128 and 32-token two-warp tiles 128 (no spill). At 8 waves the grid, not
    # the registers, caps the warps per SM: the variants with 16 waves give them twice as many
    # (ATTN_CONTEXTS, ATTN_BATCHES, ATTN_FORMATS, ATTN_VARIANTS replace those)
    V='[{}, {"block_n": 16, "num_warps": 1, "waves": 8}, {"block_n": 16, "num_warps": 1, "waves": 16}, {"block_n": 32, "num_warps": 1, "waves": 16}, {"block_n": 32, "num_warps": 2, "waves": 16}]'
    timeout 540 python3 benchmarks/bench_attention.py --contexts ${ATTN_CONTEXTS:-16384 65536} \
      --batches ${ATTN_BATCHES:-1} --formats ${ATTN_FORMATS:-f16 int2:c/int2 int4:c/int4} \
      --variants "${ATTN_VARIANTS:-$V}" \
      --out "$OUT/attention.json" >"$OUT/attn.log" 2>&1
    say "attention rc=$?"; tail -25 "$OUT/attn.log"
    ;;
  tune)
    timeout 540 python3 benchmarks/bench_quant_kernels.py --sweep --tune-tokens 1 8 \
      --tune-knobs moe_gate_up router_fused --out "$OUT/tune.json" >"$OUT/tune.log" 2>&1
    say "sweep rc=$?"; tail -30 "$OUT/tune.log"
    ;;
  qwen3)
    timeout 560 python3 benchmarks/vs_llamacpp.py --preset qwen3-30b-a3b --model-dir "$MODELS" \
      --kv f16,int4,int2 --depths 0,16384,65536 --ttft-prompt 4096 --no-eager \
      $( [ -f /tmp/llama-qwen3-30b-a3b.json ] && echo --llama-rows /tmp/llama-qwen3-30b-a3b.json ) \
      --out "$OUT/vs_llamacpp-qwen3.json" >"$OUT/qwen3.log" 2>&1
    say "qwen3 rc=$?"; grep '"engine"' "$OUT/qwen3.log" | cut -c1-400
    ;;
  presets)
    for p in olmoe-1b-7b mixtral-8x7b; do
      timeout 270 python3 benchmarks/vs_llamacpp.py --preset $p --model-dir "$MODELS" \
        --kv f16 --depths 0,16384 --no-eager --out "$OUT/vs_llamacpp-$p.json" >"$OUT/$p.log" 2>&1
      say "$p rc=$?"; grep '"engine"' "$OUT/$p.log" | cut -c1-400
    done
    ;;
  llama)
    : "${LLAMA_SRC:?set LLAMA_SRC to the llama.cpp source tarball}"
    for p in ${LLAMA_PRESETS:-qwen3-30b-a3b olmoe-1b-7b mixtral-8x7b}; do
      timeout 560 python3 benchmarks/vs_llamacpp.py --preset $p --model-dir "$MODELS" \
        --skip-localmoe --llama-src "$LLAMA_SRC" --build-dir /tmp/llama-build \
        --llama-kv "${LLAMA_KV:-f16,q4_0}" --depths "${LLAMA_DEPTHS:-0,16384}" --reps 1 \
        --ttft-prompt "${LLAMA_TTFT:-0}" --llama-timeout "${LLAMA_TIMEOUT:-150}" \
        --out "$OUT/llama-$p.json" >"$OUT/llama-$p.log" 2>&1
      say "llama $p rc=$?"; grep -E '"(kv|ctx|tpot_ms|prefill_tok_s)"' "$OUT/llama-$p.json" | tr -d ' \n'; echo
      # later qwen3/presets stages on this warm machine merge these rows (--llama-rows)
      cp "$OUT/llama-$p.json" "/tmp/llama-$p.json" 2>/dev/null
    done
    ;;
  install) ;;   # the wheels and localmoe only (then: export PYTHONPATH=/tmp/site)
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
