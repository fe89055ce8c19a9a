"""Dense gemma3 (Gemma-3-270M) -> llama.cpp's ``gemma4`` MoE layout.

No llama.cpp MoE architecture has Gemma-3's block (pre+post "sandwich" norms around attention
and FFN, per-head q/k RMSNorm, tanh-GELU GLU, interleaved 512-token sliding windows with their
own RoPE base, ``sqrt(d_model)`` embedding scale) except ``gemma4`` (``src/models/gemma4*.cpp``),
whose MoE block adds three things Gemma-3 lacks; each is neutralized exactly or to ~1e-5:

1. **V is RMS-normalized per head** (no weight) before attention. ``attn_v`` is stored in F32
   multiplied by ``alpha = sqrt(eps) * 2**-q``: then ``mean(v'^2) << eps`` and
   ``rmsnorm(v') = v' / sqrt(mean(v'^2) + eps) = v * 2**-q * (1 - O(2**-2q mean(v^2) / 2))``;
   ``attn_output`` is multiplied by ``2**q`` exactly (its fp16 block scales). ``q`` is chosen
   from the largest ``mean(v^2)`` seen on the calibration text so the relative error stays
   below ~1e-5 (:func:`v_norm_exponent`).
2. **A dense MLP runs beside the experts**, each branch with its own post-norm, summed before
   the block's post-FFN norm. The dense branch is written with zero weights (``rmsnorm(0) = 0``,
   ``post_ffw_norm_1 = 0``), the expert branch's ``post_ffw_norm_2`` is all ones, so the layer
   computes ``post_ffw_norm(rmsnorm(moe))`` = ``post_ffw_norm(moe)`` up to ``eps``.
3. **The router reads its own norm**: ``logits = W (rmsnorm(x) / sqrt(d_model) * s)`` of the
   residual ``x``; with ``s = ffn_norm * sqrt(d_model)`` and ``W`` = the trained router this is
   the router applied to the FFN input ``ffn_norm(x)``, as in the reference.

Also: attention scale 1.0 in gemma4 (Gemma-3 uses ``1/sqrt(head_dim)``: folded into
``attn_q_norm``, a power of two for head_dim 256); ``rope_freqs`` (proportional RoPE of global
layers) all ones; the per-layer sliding-window flags written as an array.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from localmoe.testing.moefy import gguf_out
from localmoe.testing.moefy.arch_llama import provenance_kvs

__all__ = ["write_gemma4_moe", "v_norm_exponent", "DENSE_BRANCH_WIDTH"]

#: width of the (all-zero) dense MLP branch gemma4 requires in MoE layers
DENSE_BRANCH_WIDTH = 32


def v_norm_exponent(max_mean_v2: float, eps: float, tol: float = 1e-5) -> int:
    """Smallest ``q >= 4`` with ``2**-2q * max_mean_v2 / 2 <= tol`` (the relative error of the
    linearized V norm, see the module docstring)."""
    q = math.ceil(0.5 * math.log2(max(max_mean_v2, 1e-12) / (2 * tol)))
    return max(4, q)


def _copy(model_file, name):
    info = model_file.tensor_info(name)
    return gguf_out.OutTensor(name, tuple(info.shape), info.qtype,
                              lambda: model_file.raw_tensor(name).data)


def _f32(name, arr):
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    return gguf_out.OutTensor(name, tuple(arr.shape), "F32", lambda: arr)


def _layer_tensors(model_file, layer, plan, st, q, attn_scale, eps, fused):
    p = f"blk.{layer}."
    mf = model_file
    load = lambda n: mf.load_tensor(p + n, dtype=None).numpy()   # noqa: E731
    lp = plan.layers[layer]
    E, Fe = lp.groups.shape
    D = lp.router.shape[1]
    alpha = math.sqrt(eps) * 2.0 ** -q
    ffn_norm = load("ffn_norm.weight")
    wo = mf.raw_tensor(p + "attn_output.weight")
    wo_q = mf.tensor_info(p + "attn_output.weight").qtype
    out = [_copy(mf, p + "attn_norm.weight"), _copy(mf, p + "attn_q.weight"),
           _copy(mf, p + "attn_k.weight"),
           _f32(p + "attn_v.weight", load("attn_v.weight") * alpha),
           gguf_out.OutTensor(p + "attn_output.weight", tuple(wo.shape), wo_q,
                              lambda: gguf_out.scale_blocks_pow2(wo.data, wo_q, q)),
           _f32(p + "attn_q_norm.weight", load("attn_q_norm.weight") * attn_scale),
           _copy(mf, p + "attn_k_norm.weight"), _copy(mf, p + "post_attention_norm.weight"),
           _copy(mf, p + "ffn_norm.weight"),
           _f32(p + "ffn_gate.weight", np.zeros((DENSE_BRANCH_WIDTH, D))),
           _f32(p + "ffn_up.weight", np.zeros((DENSE_BRANCH_WIDTH, D))),
           _f32(p + "ffn_down.weight", np.zeros((D, DENSE_BRANCH_WIDTH))),
           _f32(p + "post_ffw_norm_1.weight", np.zeros(D)),
           _f32(p + "pre_ffw_norm_2.weight", ffn_norm),
           _f32(p + "post_ffw_norm_2.weight", np.ones(D)),
           _copy(mf, p + "post_ffw_norm.weight"),
           _f32(p + "ffn_gate_inp.weight", lp.router.numpy()),
           _f32(p + "ffn_gate_inp.scale", ffn_norm * math.sqrt(D))]
    if fused:
        out.append(gguf_out.OutTensor(p + "ffn_gate_up_exps.weight", (E, 2 * Fe, D), st.gate_qtype,
                                      lambda: np.concatenate([st.gate, st.up], axis=1)))
    else:
        out += [gguf_out.OutTensor(p + "ffn_gate_exps.weight", (E, Fe, D), st.gate_qtype, lambda: st.gate),
                gguf_out.OutTensor(p + "ffn_up_exps.weight", (E, Fe, D), st.up_qtype, lambda: st.up)]
    out.append(gguf_out.OutTensor(p + "ffn_down_exps.weight", (E, D, Fe), st.down_qtype,
                                  lambda: st.down))
    return out


def write_gemma4_moe(model_file, plan, stored: dict, out: str | Path, *, v_exponent: int,
                     fused_gate_up: bool = False) -> Path:
    """Write the gemma4 GGUF of ``plan`` (see the module docstring).

    Args:
        model_file: the dense gemma3 source (GGUF).
        plan: :class:`.plan.MoePlan`; stored: ``{layer: .experts.StoredExperts}``.
        v_exponent: ``q`` of the V-norm neutralization (:func:`v_norm_exponent`).
        fused_gate_up: write ``ffn_gate_up_exps`` (gate rows then up rows) instead of separate
            ``ffn_gate_exps``/``ffn_up_exps``.
    """
    import gguf

    T = gguf.GGUFValueType
    spec = model_file.spec
    E, Fe = plan.layers[0].groups.shape
    n = spec.n_layers
    pattern = spec.sliding_window_pattern or 6
    swa = [bool((i + 1) % pattern) for i in range(n)]
    attn_scale = spec.attn_scale or 1.0 / math.sqrt(spec.head_dim)
    src_name = str(model_file.metadata.get("general.name", Path(plan.source).stem))
    kvs = gguf_out.source_kvs(model_file.path, "gemma3", "gemma4",
                              drop={"gemma4.feed_forward_length", "general.name"})
    kvs += [("gemma4.feed_forward_length", DENSE_BRANCH_WIDTH, T.UINT32, None),
            ("gemma4.expert_count", E, T.UINT32, None),
            ("gemma4.expert_used_count", plan.cfg.top_k, T.UINT32, None),
            ("gemma4.expert_feed_forward_length", Fe, T.UINT32, None),
            ("gemma4.attention.sliding_window_pattern", swa, T.ARRAY, T.BOOL),
            ("gemma4.rope.freq_base_swa", float(spec.rope_base_local or 10000.0), T.FLOAT32, None),
            ("gemma4.attention.key_length_swa", spec.head_dim, T.UINT32, None),
            ("gemma4.attention.value_length_swa", spec.v_head_dim, T.UINT32, None),
            ("gemma4.rope.dimension_count", spec.rope_dim or spec.head_dim, T.UINT32, None),
            ("gemma4.rope.dimension_count_swa", spec.rope_dim or spec.head_dim, T.UINT32, None),
            ("gemma4.embedding_length_per_layer_input", 0, T.UINT32, None),
            # llama.cpp's hparams default this to 30 (Gemma 2/4); Gemma-3 has no final cap
            ("gemma4.final_logit_softcapping", float(spec.final_logit_softcap or 0.0),
             T.FLOAT32, None),
            ("moefy.v_norm_exponent", int(v_exponent), T.UINT32, None)]
    kvs += provenance_kvs(plan, src_name)
    tensors = [_copy(model_file, "token_embd.weight"),
               _f32("rope_freqs.weight", np.ones((spec.rope_dim or spec.head_dim) // 2))]
    for l in range(n):
        tensors += _layer_tensors(model_file, l, plan, stored[l], v_exponent, attn_scale,
                                  spec.norm_eps, fused_gate_up)
    tensors.append(_copy(model_file, "output_norm.weight"))
    return gguf_out.write_gguf(out, "gemma4", kvs, tensors)
