"""Dense llama (SmolLM2) -> ``qwen2moe`` MoE with an always-on shared expert, the layout
llama.cpp runs as ``qwen2moe`` (``src/models/qwen2moe.cpp``: softmax router, top-k *not*
renormalized, SiLU GLU experts, plus a SiLU GLU shared expert times ``sigmoid(x . w_gate)``).

What differs from the source beyond the FFNs, and why the result computes the same:

* RoPE: llama GGUF files store ``attn_q``/``attn_k`` rows permuted for llama.cpp's interleaved
  ("normal") RoPE; qwen2moe applies NEOX RoPE, so the rows are put back in the original order
  (block copies of whole rows, nothing re-quantized). Both compute the same attention.
* ``attn_q/k/v.bias``: qwen2 models have them; zeros are written (F32).
* ``output.weight``: when the source ties it to ``token_embd`` a copy of the embedding's blocks is
  written, so the file does not depend on a loader's tied-embedding fallback.
* The shared expert's gate ``ffn_gate_inp_shexp`` is required by llama.cpp; the plan's gate
  (:func:`.plan.open_gate`) is tiny, so ``sigmoid`` is 0.5 (to ~1e-4) and the stored shared down
  projection holds twice the fitted weights (:func:`.experts.stored_experts`).

Per block: ``ffn_gate_inp`` (F32 ``[E, d_model]``), ``ffn_{gate,up}_exps [E, d_ff_expert,
d_model]``, ``ffn_down_exps [E, d_model, d_ff_expert]``, ``ffn_gate_inp_shexp`` (F32
``[d_model]``), ``ffn_{gate,up}_shexp [F_s, d_model]``, ``ffn_down_shexp [d_model, F_s]``.
Metadata: ``qwen2moe.expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
``expert_shared_feed_forward_length`` (and ``feed_forward_length`` = the expert width).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from localmoe.testing.moefy import gguf_out
from localmoe.testing.moefy.arch_llama import provenance_kvs

__all__ = ["write_qwen2moe_moe", "neox_rows"]


def neox_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that turns a llama-GGUF (interleaved-RoPE permuted) ``attn_q``/``attn_k``
    matrix of ``n_heads`` heads back into the original (NEOX-RoPE) order: ``[n_heads *
    head_dim]`` int64 indices of stored rows."""
    h = np.arange(n_heads)[:, None, None] * head_dim
    half = np.arange(2)[None, :, None]
    j = 2 * np.arange(head_dim // 2)[None, None, :]
    return (h + j + half).reshape(-1)


def write_qwen2moe_moe(model_file, plan, stored: dict, out: str | Path) -> Path:
    """Write the qwen2moe GGUF of ``plan`` (a plan with a shared expert, from a llama source).

    Args:
        model_file: the dense llama source (GGUF).
        plan: :class:`.plan.MoePlan` whose layers have ``shared`` neurons;
            stored: ``{layer: .experts.StoredExperts}`` with ``shared`` set.
        out: output path.
    """
    import gguf

    U = gguf.GGUFValueType.UINT32
    s = model_file.spec
    E, Fe = plan.layers[0].groups.shape
    fs = stored[0].shared[6]
    src_name = str(model_file.metadata.get("general.name", Path(plan.source).stem))
    kvs = gguf_out.source_kvs(model_file.path, "llama", "qwen2moe",
                              drop={"qwen2moe.feed_forward_length", "general.name"})
    kvs += [("qwen2moe.feed_forward_length", Fe, U, None), ("qwen2moe.expert_count", E, U, None),
            ("qwen2moe.expert_used_count", plan.cfg.top_k, U, None),
            ("qwen2moe.expert_feed_forward_length", Fe, U, None),
            ("qwen2moe.expert_shared_feed_forward_length", fs, U, None)]
    kvs += provenance_kvs(plan, src_name)
    names = model_file.tensor_names()
    rows = {"attn_q": neox_rows(s.n_heads, s.head_dim), "attn_k": neox_rows(s.n_kv_heads, s.head_dim)}
    tensors = []
    for name in names:
        parts = name.split(".")
        info = model_file.tensor_info(name)
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            if parts[2] == "ffn_gate":
                tensors += _moe_tensors(int(parts[1]), plan, stored)
            continue
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in rows:
            r = rows[parts[2]]
            tensors.append(gguf_out.OutTensor(name, tuple(info.shape), info.qtype, (
                lambda n=name, r=r: gguf_out.take_rows(model_file.raw_tensor(n).data, r))))
            continue
        tensors.append(gguf_out.OutTensor(name, tuple(info.shape), info.qtype,
                                          (lambda n=name: model_file.raw_tensor(n).data)))
        if len(parts) == 4 and parts[0] == "blk" and parts[2] == "attn_v":
            p = f"blk.{parts[1]}."
            for t, n in (("attn_q", s.n_heads), ("attn_k", s.n_kv_heads), ("attn_v", s.n_kv_heads)):
                tensors.append(gguf_out.OutTensor(p + t + ".bias", (n * s.head_dim,), "F32", (
                    lambda k=n * s.head_dim: np.zeros(k, np.float32))))
    if "output.weight" not in names:
        info = model_file.tensor_info("token_embd.weight")
        tensors.append(gguf_out.OutTensor("output.weight", tuple(info.shape), info.qtype,
                                          lambda: model_file.raw_tensor("token_embd.weight").data))
    return gguf_out.write_gguf(out, "qwen2moe", kvs, tensors)


def _moe_tensors(layer: int, plan, stored: dict) -> list:
    lp, st = plan.layers[layer], stored[layer]
    p = f"blk.{layer}."
    E, Fe = lp.groups.shape
    D = lp.router.shape[1]
    g, u, d, gq, uq, dq, fs = st.shared
    return [
        gguf_out.OutTensor(p + "ffn_gate_inp.weight", (E, D), "F32",
                           lambda: lp.router.numpy().astype(np.float32)),
        gguf_out.OutTensor(p + "ffn_gate_exps.weight", (E, Fe, D), st.gate_qtype, lambda: st.gate),
        gguf_out.OutTensor(p + "ffn_up_exps.weight", (E, Fe, D), st.up_qtype, lambda: st.up),
        gguf_out.OutTensor(p + "ffn_down_exps.weight", (E, D, Fe), st.down_qtype, lambda: st.down),
        gguf_out.OutTensor(p + "ffn_gate_inp_shexp.weight", (D,), "F32",
                           lambda: lp.sh_gate.numpy().astype(np.float32)),
        gguf_out.OutTensor(p + "ffn_gate_shexp.weight", (fs, D), gq, lambda: g),
        gguf_out.OutTensor(p + "ffn_up_shexp.weight", (fs, D), uq, lambda: u),
        gguf_out.OutTensor(p + "ffn_down_shexp.weight", (D, fs), dq, lambda: d),
    ]
