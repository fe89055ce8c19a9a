"""The triton runner's decode step with fused per-layer kernels (1-8 sequences, one new token
each), the body its CUDA graphs record (:mod:`localmoe.backends.triton.graphs`).

The shared transformer's block (:meth:`localmoe.model.transformer.Transformer.block`) launches
~23 kernels per layer on the quantized path: every norm, residual add, activation
quantization, RoPE, K/V write and split-K zeroing is its own launch. Inside a CUDA graph each
node still costs ~1.5 us of GPU idle time between kernels, so at 48 layers the node count, not
the bytes read, bounds the step. This step computes the same function with fewer, fatter
kernels:

======================================  =========================================================
per layer                               kernel(s)
======================================  =========================================================
residual add + RMSNorm + int8 quant     :func:`localmoe.kernels.fused_norm.add_rms_norm_quant`
                                        (sums the previous layer's FFN/MoE output, or the split-K
                                        partials of the O projection, into the residual)
q/k/v projection                        quantized GEMV writing split-K partials (no zeroing, no
                                        atomics): :func:`localmoe.kernels.quant_gemv.quant_gemv`
q/k norm + RoPE + K/V append            :func:`localmoe.kernels.qk_rope_append.qk_rope_append`
attention                               :func:`localmoe.kernels.decode_attention.decode_attention`
O projection                            GEMV partials (the attention's reduction writes its int8
                                        input blocks)
add + RMSNorm + quant, router logits    one launch in MoE layers:
                                        :func:`localmoe.kernels.router.norm_router_logits` (dense
                                        FFN layers: :func:`add_rms_norm_quant`)
routing + routed experts                :func:`localmoe.kernels.fused_moe.fused_moe` (2 launches;
                                        the first routes from the logits)
======================================  =========================================================

Dense FFNs and shared experts (Qwen2-MoE) go through the shared model's GLU on the float
normed input. The residual stream is updated in place (one program per row reads its row
before writing it), so the step can be captured once and replayed.

Models the step does not cover (post-attention/FFN norms as in Gemma 3, weights that are not
quantized, q/k/v parts of different types where the fused append needs one row) take the shared
block (:func:`unavailable` says why); both compute the same function (tests compare them).
"""

from __future__ import annotations

import os

import torch

__all__ = ["FusedDecode", "unavailable"]


def unavailable(runner) -> str | None:
    """Why ``runner``'s decode step cannot use :class:`FusedDecode`, or None."""
    from localmoe.backends.triton.quant_model import QuantLinear

    m = runner.model
    if not runner.weights == "quantized":
        return "weights not quantized"
    s = m.spec
    if s.embed_scale or s.final_logit_softcap or s.attn_logit_softcap:
        return "embedding scale or logit soft-capping"
    if s.d_model % 32 or s.v_head_dim % 32:
        return "d_model or the value head size is not a multiple of 32 (int8 blocks)"
    for L in m.layers:
        if "post_attention_norm" in L or "post_ffw_norm" in L:
            return "post-attention/FFN norms"
        for key in ("wqkv", "wo"):
            if not isinstance(L[key], QuantLinear) or any(p.is_float for p in L[key].parts):
                return f"{key} is not a quantized weight"
    if not isinstance(m.output, QuantLinear):
        return "the output head is not a quantized weight"
    return None


class FusedDecode:
    """The fused decode step of a :class:`~localmoe.backends.triton.runner.TritonRunner`.

    Args:
        runner: the runner (``model``, ``cache``); check :func:`unavailable` first.

    Raises:
        ValueError: a KV format the fused append cannot write (the runner says why).
    """

    def __init__(self, runner):
        from localmoe.kernels.fused_norm import MAX_D
        from localmoe.kernels.qk_rope_append import fusable

        why = fusable(runner.cache.k_codec, runner.cache.v_codec, decode=True)
        if why:
            raise ValueError(why)
        self.runner = runner
        # MoE layers: the norm before the experts and the router in one launch
        # (LOCALMOE_NORM_ROUTER=0: two launches, for comparisons)
        self.norm_router = (os.environ.get("LOCALMOE_NORM_ROUTER", "1") != "0"
                            and runner.model.spec.d_model <= MAX_D)
        # ... and the routing (top-k of the logits) done by the experts' first launch, not by
        # the router's last program (LOCALMOE_ROUTE_IN_MOE=0: the router routes)
        self.route_in_moe = os.environ.get("LOCALMOE_ROUTE_IN_MOE", "1") != "0"

    # -- pieces (the fused kernels, with their unfused equivalents where a kernel is absent) --
    @staticmethod
    def _norm_quant(x, deltas, w, eps, out, want_float=None, quant=True, quant_out=None):
        """``(r, hq, hf)``: ``r = x + sum(deltas)`` written to ``out`` (may be ``x``); ``hq``
        the int8 QuantAct of ``rms_norm(r) * w`` (None without ``quant``; written to
        ``quant_out`` if given); ``hf`` the normed rows in ``want_float`` (or None)."""
        from localmoe.kernels.fused_norm import add_rms_norm_quant

        return add_rms_norm_quant(x, deltas, w, eps, residual_out=out, want_float=want_float,
                                  quant=quant, quant_out=quant_out)

    @staticmethod
    def _gemv(xa, lin):
        """Split-K partials ``[S, T, N]`` float32 of ``xa @ lin.T`` (``lin`` a QuantLinear)."""
        from localmoe.kernels.quant_gemv import quant_gemv_partials

        if len(lin.parts) == 1:
            return quant_gemv_partials(xa, lin.parts[0])
        outs = [quant_gemv_partials(xa, p).sum(0) for p in lin.parts]
        return torch.cat(outs, -1)[None]

    # -- the step -------------------------------------------------------------------------
    def step(self, tokens, positions, slots, lens, rows, block_table, max_len: int
             ) -> torch.Tensor:
        """Logits ``[B, vocab]`` float32 of one decode step.

        Args:
            tokens, positions, slots: int64 ``[B]`` device tensors (the new token of each
                sequence, its position and its KV slot).
            lens, rows: int32 ``[B]``: cached tokens per sequence (the new one included) and
                side-buffer rows.
            block_table: int32 ``[B, width]``.
            max_len: the length the attention's splits are planned for (a bucket bound).
        """
        from localmoe.kernels.decode_attention import decode_attention
        from localmoe.kernels.qk_rope_append import qk_rope_append
        from localmoe.kernels.quant_gemv import QuantAct, wide_default

        r = self.runner
        m, c, s = r.model, r.cache, r.spec
        B = tokens.shape[0]
        eps = s.norm_eps
        x = m.embed(tokens)
        deltas: list = []
        ropes = m.layer_rope_tables(positions)
        for i in range(s.n_layers):
            L = m.layers[i]
            x, hq, _ = self._norm_quant(x, deltas, L["attn_norm"], eps, x)
            qkv = self._gemv(hq, L["wqkv"])
            cos2, sin2 = ropes[i][0], ropes[i][1]
            q = qk_rope_append(
                qkv, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim,
                v_head_dim=s.v_head_dim, bias=L.get("bqkv"),
                q_norm_w=L.get("attn_q_norm"), k_norm_w=L.get("attn_k_norm"),
                norm_full=bool(s.qk_norm_full), eps=eps,
                cos=cos2.reshape(B, -1), sin=sin2.reshape(B, -1), style=s.rope_style,
                k_codec=c.k_codec, k_store=c.k_stores[i], v_codec=c.v_codec,
                v_store=c.v_stores[i], slots=slots, positions=positions, seq_rows=rows,
                q_dtype=m.dtype)
            oq = QuantAct.empty(B, s.n_heads * s.v_head_dim, q.device)
            decode_attention(
                q, c.k_codec, c.k_stores[i], c.v_codec, c.v_stores[i], block_table, lens,
                page_size=c.block_size, sm_scale=m.scale, seq_rows=rows,
                sliding_window=m.layer_window(i) or 0, max_len=max_len, quant_out=oq)
            op = self._gemv(oq, L["wo"])
            moe = "router" in L
            routed = None
            if moe and self.norm_router:
                # norm + router logits + routing in one launch; every program of a token reads
                # the old residual, so the new one goes to another buffer
                x, hq, hf, routed = self._norm_route(i, L, x, op)
            else:
                x, hq, hf = self._norm_quant(
                    x, [op], L["ffn_norm"], eps, x,
                    want_float=torch.float32 if moe else m.dtype,
                    quant_out=(QuantAct.empty(B, s.d_model, x.device, wide_default(None, True))
                               if moe else None))
            deltas = self._ffn(i, L, hq, hf, routed=routed)
        _, hq, _ = self._norm_quant(x, deltas, m.output_norm, eps, None)
        return self._head(hq)

    # -- prefill of a new sequence (the body of the prefill graphs) ---------------------------
    def prefill(self, tokens, positions, slots, last) -> tuple[torch.Tensor, list]:
        """``(logits, pending)``: logits ``[1, vocab]`` float32 of the token at index ``last``
        after a prompt that starts a sequence (positions ``0 .. P-1``; causal attention among
        the new tokens only, so nothing is read from the cache). Tokens past ``last`` are
        padding: causality keeps them out of the real tokens' attention.

        K/V of a float cache are written at ``slots`` here (the padding's land in slots the
        sequence reserved but does not count yet; its next tokens overwrite them before
        anything reads them), and the attention reads them as the cache holds them. A
        quantized cache's writes depend on the prompt's true length (pages completed per
        channel, the sink and window rings), so they are left to the caller: ``pending[i]`` is
        ``(k, v)`` of layer ``i``, each ``[P, Hkv, D]`` in the model's dtype, or None for a side
        already written (:meth:`TritonRunner.write_prompt_kv` writes the first ``last + 1``
        rows). The attention among the prompt's tokens then reads these exact K/V, as vLLM's
        prefill does; decode steps read the quantized cache.

        Args:
            tokens, positions, slots: int64 ``[P]`` device tensors; last: int64 ``[1]``.
        """
        from localmoe.kernels.qk_rope_append import qk_rope

        r = self.runner
        m, c, s = r.model, r.cache, r.spec
        eps = s.norm_eps
        n = tokens.shape[0]
        x = m.embed(tokens)
        deltas: list = []
        pending: list = []
        ropes = m.layer_rope_tables(positions)
        for i in range(s.n_layers):
            L = m.layers[i]
            x, _, h = self._norm_quant(x, deltas, L["attn_norm"], eps, x, quant=False,
                                       want_float=m.dtype)
            cos2, sin2 = ropes[i][0], ropes[i][1]
            q, k, v = qk_rope(
                L["wqkv"](h), n_heads=s.n_heads, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim,
                v_head_dim=s.v_head_dim, bias=L.get("bqkv"), q_norm_w=L.get("attn_q_norm"),
                k_norm_w=L.get("attn_k_norm"), norm_full=bool(s.qk_norm_full), eps=eps,
                cos=cos2.reshape(n, -1), sin=sin2.reshape(n, -1), style=s.rope_style,
                q_dtype=m.dtype)
            kv, later = [], []
            for store, t in ((c.k_stores[i], k), (c.v_stores[i], v)):
                if "data" in store:
                    t = t.to(store["data"].dtype)
                    store["data"].index_copy_(0, slots, t)
                    later.append(None)
                else:                        # quantized: written by the caller
                    later.append(t)
                kv.append(t.to(q.dtype))     # attend over what the cache holds (as decode will)
            k, v = kv
            pending.append(None if later == [None, None] else tuple(later))
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=m.scale, enable_gqa=s.n_heads != s.n_kv_heads)
            o = L["wo"](o[0].transpose(0, 1).reshape(n, -1))
            x, _, h = self._norm_quant(x, [o], L["ffn_norm"], eps, x, quant=False,
                                       want_float=m.dtype)
            deltas = self._ffn(i, L, None, h)
        _, _, h = self._norm_quant(x, deltas, m.output_norm, eps, None, quant=False,
                                   want_float=m.dtype)
        return m.logits(h.index_select(0, last)), pending

    def _norm_route(self, i: int, L: dict, x, op):
        """``(r, hq, hf, routing)`` of MoE layer ``i``'s input in one launch
        (:func:`localmoe.kernels.router.norm_router_logits`, or ``norm_router_fused``
        without ``route_in_moe``): the residual ``x + op`` in a new buffer, its normed rows as
        a QuantAct (and floats in the model's dtype when a shared expert needs them), and the
        router's :class:`~localmoe.kernels.router.Routing` (logits the experts' first launch
        routes) or ``(weights, ids)``."""
        from localmoe.kernels.router import norm_router_fused, norm_router_logits

        m = self.runner.model
        args = (x, op, L["ffn_norm"], m.spec.norm_eps, L["router"], m.spec.top_k)
        kw = dict(residual_out=torch.empty_like(x),
                  want_float=m.dtype if "sh_gate_up" in L else None, **m.moe.route_kwargs(i))
        if self.route_in_moe:
            return norm_router_logits(*args, **kw)
        r, hq, hf, w, ids = norm_router_fused(*args, **kw)
        return r, hq, hf, (w, ids)

    def _ffn(self, i: int, L: dict, hq, hf, routed=None) -> list:
        """The FFN/MoE outputs of layer ``i`` (to be added to the residual) from its normed
        input ``hf`` (floats ``[T, D]``) and, for 1-8 tokens, ``hq`` (its QuantAct: the fused
        decode MoE); ``hq`` None: many tokens (the grouped prefill MoE). ``routed``: the
        routing ``(weights, ids)`` when it was computed with the norm, or its
        :class:`~localmoe.kernels.router.Routing` (the experts' first launch routes)."""
        from localmoe.kernels.fused_moe import fused_moe
        from localmoe.kernels.quant_gemm import moe_prefill
        from localmoe.kernels.router import Routing
        from localmoe.model.routing import shared_expert_gate

        m = self.runner.model
        if "router" not in L:
            return [m._glu(i, hf, "gate_up", "down")]
        moe = m.moe
        ex = m.experts
        if isinstance(routed, Routing):
            out = [fused_moe(hq, ex.gate_up[i], ex.down[i], None, None, slot_of=ex.slots(i),
                             activation=moe.activation, route=routed)]
        else:
            w, ids = routed if routed is not None else moe.route(i, hf)
            run, slot = ((fused_moe, ex.slots(i)) if hq is not None
                         else (moe_prefill, ex.slot_of[i]))
            out = [run(hq if hq is not None else hf, ex.gate_up[i], ex.down[i], ids, w,
                       slot_of=slot, activation=moe.activation)]
        if "sh_gate_up" in L:
            h = hf.to(m.dtype)
            sh = m._glu(i, h, "sh_gate_up", "sh_down")
            if "sh_gate" in L:
                sh = sh * shared_expert_gate(h, L["sh_gate"])
            out.append(sh)
        return out

    def _head(self, hq) -> torch.Tensor:
        """Logits ``[B, vocab]`` float32 from the final normed rows (a QuantAct)."""
        from localmoe.kernels.quant_gemv import quant_gemv

        head = self.runner.model.output
        parts = [quant_gemv(hq, p) for p in head.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)
