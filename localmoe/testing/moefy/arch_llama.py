"""Dense llama (SmolLM2) -> Mixtral-style llama MoE, the layout llama.cpp runs as ``llama`` with
``ffn_*_exps`` (``src/models/llama.cpp``: softmax router, top-k renormalized, SiLU GLU experts).

Everything outside the FFNs is copied block for block, so attention, norms, embeddings, RoPE
(interleaved, GGUF llama row order) and the tokenizer are the source's own. Per block the dense
``ffn_gate/up/down`` become ``ffn_gate_inp`` (F32 ``[E, d_model]``), ``ffn_gate_exps``,
``ffn_up_exps`` ``[E, d_ff_expert, d_model]`` and ``ffn_down_exps`` ``[E, d_model,
d_ff_expert]``; ``llama.feed_forward_length`` becomes the expert width (llama.cpp sizes llama
experts with it) and ``llama.expert_count`` / ``expert_used_count`` are added.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from localmoe.testing.moefy import gguf_out

__all__ = ["write_llama_moe", "provenance_kvs"]


def provenance_kvs(plan, source_name: str) -> list:
    """``general.name`` and ``moefy.*`` keys saying what the file is (llama.cpp ignores them)."""
    import gguf

    S = gguf.GGUFValueType.STRING
    cfg = plan.cfg
    return [
        ("general.name", f"{source_name} moefied {cfg.n_experts}x{cfg.top_k}", S, None),
        ("moefy.source", Path(plan.source).name, S, None),
        ("moefy.config", json.dumps({k: v for k, v in cfg.__dict__.items()
                                     if k != "shared_frac" or v}, sort_keys=True), S, None),
        ("moefy.note", "MoE built from a dense model by localmoe.testing.moefy (experts = split "
                       "FFN neurons, routers trained on calibration text); not a published MoE",
         S, None),
    ]


def write_llama_moe(model_file, plan, stored: dict, out: str | Path) -> Path:
    """Write the Mixtral-style llama GGUF of ``plan``.

    Args:
        model_file: the dense llama source (GGUF).
        plan: :class:`.plan.MoePlan`; stored: ``{layer: .experts.StoredExperts}``.
        out: output path.
    """
    import gguf

    U = gguf.GGUFValueType.UINT32
    E, Fe = plan.layers[0].groups.shape
    src_name = str(model_file.metadata.get("general.name", Path(plan.source).stem))
    kvs = gguf_out.source_kvs(model_file.path, "llama", "llama",
                              drop={"llama.feed_forward_length", "general.name"})
    kvs += [("llama.feed_forward_length", Fe, U, None), ("llama.expert_count", E, U, None),
            ("llama.expert_used_count", plan.cfg.top_k, U, None)]
    kvs += provenance_kvs(plan, src_name)
    tensors = []
    for name in model_file.tensor_names():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            if parts[2] != "ffn_gate":
                continue
            tensors += _moe_tensors(int(parts[1]), plan, stored)
            continue
        info = model_file.tensor_info(name)
        tensors.append(gguf_out.OutTensor(name, tuple(info.shape), info.qtype,
                                          (lambda n=name: model_file.raw_tensor(n).data)))
    return gguf_out.write_gguf(out, "llama", kvs, tensors)


def _moe_tensors(layer: int, plan, stored: dict) -> list:
    lp, st = plan.layers[layer], stored[layer]
    p = f"blk.{layer}."
    E, Fe = lp.groups.shape
    D = lp.router.shape[1]
    return [
        gguf_out.OutTensor(p + "ffn_gate_inp.weight", (E, D), "F32",
                           lambda: lp.router.numpy().astype(np.float32)),
        gguf_out.OutTensor(p + "ffn_gate_exps.weight", (E, Fe, D), st.gate_qtype, lambda: st.gate),
        gguf_out.OutTensor(p + "ffn_up_exps.weight", (E, Fe, D), st.up_qtype, lambda: st.up),
        gguf_out.OutTensor(p + "ffn_down_exps.weight", (E, D, Fe), st.down_qtype, lambda: st.down),
    ]
