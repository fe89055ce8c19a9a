"""One shared decoder-only transformer (dense and MoE) built from a :class:`ModelSpec`.

Every family runs through the same block (:meth:`Transformer.block`); ``models/<family>.py``
only declares what differs (a :class:`~localmoe.models.family.Family` subclass). What the block
computes with comes through hooks a backend supplies:

* attention: a callback per forward call (``attn(layer, q, k, v) -> out``,
  :data:`~localmoe.model.ops.AttnFn`), so a runner routes it through its paged KV cache;
* MoE: :attr:`Transformer.moe` (:data:`~localmoe.model.moe.MoEFn`, default the reference
  :class:`~localmoe.model.moe.ReferenceMoE`: router + routed experts);
* numerics: :attr:`Transformer.ops`, an op set giving ``norm``, ``act``, ``linear`` (matmul of a
  named weight), the RoPE angles and the MoE roundings -- :class:`~localmoe.model.ops.TorchOps`
  (the reference) or :class:`~localmoe.model.ggml_numerics.GgmlOps` (llama.cpp parity).

Formulas and their sources are in :mod:`localmoe.model.ops` (norm, RoPE, attention,
activations), :mod:`localmoe.model.moe` and :mod:`localmoe.model.routing`. The FFN is the gated
linear unit ``down(act(gate x) * up x)`` (Shazeer 2020); MoE layers add optional shared experts
with a sigmoid gate (Qwen2-MoE).

Tensor names are the canonical GGUF names (INTERFACES.md); shapes are torch order.
"""

from __future__ import annotations

import math

import torch

from localmoe.cpu.qmatmul import PackedLinear, PackedWeight
from localmoe.errors import ModelLoadError
from localmoe.model.experts import ExpertProvider, ResidentExpertProvider
from localmoe.models.family import get_family
from localmoe.model.moe import MoEFn, ReferenceMoE
from localmoe.model.ops import (AttnFn, TorchOps, apply_rope_swapped, attention,
                                rope_inv_freq, rope_signed_sin, rope_tables)
from localmoe.model.routing import shared_expert_gate
from localmoe.io.spec import ModelSpec

_NORM_SUFFIXES = ("_norm.weight",)
#: per-layer matmul weights, stored transposed ``[in, out]`` in :attr:`Transformer.layers`
_LINEAR_KEYS = ("wqkv", "wo", "gate_up", "down", "sh_gate_up", "sh_down", "router")
#: matmul weights of a block announced to the op set (``ops.bind``): key -> the GGUF tensors
#: stacked into it, in order
_FUSED = (("wqkv", ("attn_q", "attn_k", "attn_v")), ("wo", ("attn_output",)),
          ("gate_up", ("ffn_gate", "ffn_up")), ("down", ("ffn_down",)),
          ("sh_gate_up", ("ffn_gate_shexp", "ffn_up_shexp")), ("sh_down", ("ffn_down_shexp",)))
#: per-layer source tensors freed once fused/transposed
_CONSUMED = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_gate_shexp", "ffn_up_shexp",
             "attn_output", "ffn_down", "ffn_down_shexp", "ffn_gate_inp")
_OPTIONAL_NORMS = ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm")
_MAX_TRANSPOSED_OUTPUT_BYTES = 256 << 20
#: GGUF tensors that may be kept packed (``packed`` in :meth:`Transformer.from_model_file`)
_PACKABLE_SUFFIXES = tuple(f"{n}.weight" for n in (
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
    "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "token_embd")) + ("output.weight",)


def _linear(t):
    """A packed matmul weight becomes a (one-part) PackedLinear; a float tensor or a backend's
    linear object (see :meth:`Transformer.__init__`) stays."""
    return PackedLinear([t]) if isinstance(t, PackedWeight) else t


def _fuse(*ts):
    """Fused projection ``[sum N, K]``: packed if every part is, a backend's linear object
    (its ``fuse_linear``) if every part is one, else float."""
    if all(isinstance(t, PackedWeight) for t in ts):
        return PackedLinear(ts)
    fuse = getattr(type(ts[0]), "fuse_linear", None)
    if fuse is not None and all(type(t) is type(ts[0]) for t in ts):
        return fuse(ts)
    ts = [t.dequantize() if isinstance(t, PackedWeight) else t for t in ts]
    return torch.cat(ts, 0).contiguous()


def _packed_unavailable(model_file, device, dtype: torch.dtype, numerics: str) -> str | None:
    """Why GGUF matmul weights cannot stay packed for this load, or None."""
    if model_file.format != "gguf" or not hasattr(model_file, "raw_tensor"):
        return "the model is not a GGUF file"
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "packed weights run on the CPU in float32 only"
    if numerics != "exact":
        return "numerics='ggml' computes on float weights"
    from localmoe.cpu.qmatmul import kernel_status

    return kernel_status()


class Transformer:
    """A decoder-only transformer: embeddings, ``n_layers`` shared blocks, final norm, lm head.

    Args:
        spec: the configured spec (see :meth:`localmoe.models.family.Family.configure`).
        weights: GGUF-named float tensors on one device (norm offsets already applied), or
            for matmul weights on the CPU a :class:`localmoe.cpu.qmatmul.PackedWeight` (kept
            packed, see ``packed`` in :meth:`from_model_file`), or a backend's *linear object*
            (not a tensor: called ``w(x [N, K]) -> [N, out]``, fused by its class's
            ``fuse_linear(parts)``, gathered by ``w.rows(ids)`` when it is the embedding, with
            ``shape``, ``nbytes``, ``dtype`` and ``device``; e.g. the triton backend's
            ``QuantLinear``, kept quantized on the GPU); the constructor fuses q/k/v and
            gate/up into single matrices and *consumes* the dict (fused sources are popped from
            it so their memory is freed as it goes).
        experts: provider of routed expert weights (None for dense models).
        ops: the op set (default :class:`~localmoe.model.ops.TorchOps` of ``spec.act``, with
            the packed CPU norm when the embedding or lm head is packed).

    Attributes:
        ops: the op set (see the module docstring); ``numerics`` is its name.
        moe: the MoE hook, ``moe(layer, x [N, d_model]) -> [N, d_model]`` (routed experts).

    Raises:
        ModelLoadError: a required tensor is missing, or MoE layers without ``experts``.
        UnsupportedModelError: unknown FFN activation.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor],
                 experts: ExpertProvider | None = None, ops: TorchOps | None = None):
        self.spec = spec
        self.experts = experts
        head = (weights.get("token_embd.weight"), weights.get("output.weight"))
        #: True when the embedding or lm head is kept packed (CPU kernel of localmoe.cpu.qmatmul)
        self.packed = any(isinstance(t, PackedWeight) for t in head)
        self.ops = ops if ops is not None else TorchOps(spec.act, packed=self.packed)
        #: "exact" (float matmuls) or "ggml" (activations rounded like llama.cpp's CPU backend)
        self.numerics = self.ops.name
        self.moe: MoEFn = ReferenceMoE(self)
        self._load_head(weights)
        self.layers: list[dict[str, torch.Tensor]] = [
            self._load_layer(i, weights) for i in range(spec.n_layers)]
        if any("router" in L for L in self.layers) and experts is None:
            raise ModelLoadError("the model has MoE layers but no expert provider was given")
        self.device = self.output_norm.device
        self.dtype = self.output_norm.dtype
        self.scale = spec.attn_scale if spec.attn_scale else 1.0 / math.sqrt(spec.head_dim)
        self._rope: dict[tuple, tuple[torch.Tensor, float]] = {}

    def _need(self, w: dict, name: str) -> torch.Tensor:
        if name not in w:
            raise ModelLoadError(f"tensor {name!r} is missing from the model file; the file "
                                 f"does not match architecture {self.spec.arch!r}")
        return w[name]

    def _load_head(self, w: dict) -> None:
        """Embedding, lm head (transposed unless that duplicates a large tied embedding) and
        the final norm."""
        te = self._need(w, "token_embd.weight")
        out_w = w.get("output.weight", te)
        tied = out_w is te
        self.tok_embd = _linear(te)
        self.output = self.tok_embd if tied else _linear(out_w)
        if not isinstance(self.output, torch.Tensor):
            self.output_t = None
        else:
            nb = self.output.numel() * self.output.element_size()
            self.output_t = (self.output.t().contiguous()
                             if not tied or nb <= _MAX_TRANSPOSED_OUTPUT_BYTES else None)
            if not tied and self.output_t is not None:
                self.output = None
        self.output_norm = self._need(w, "output_norm.weight")
        self.ops.bind(-1, "output",
                      ("output.weight" if "output.weight" in w else "token_embd.weight",), w)

    def _load_layer(self, i: int, w: dict) -> dict[str, torch.Tensor]:
        """Block ``i``'s weights from the GGUF-named dict ``w`` (fused, transposed; the consumed
        source tensors are popped from ``w``)."""
        p = f"blk.{i}."
        for key, parts in _FUSED:
            names = tuple(f"{p}{n}.weight" for n in parts)
            if names[0] in w:
                self.ops.bind(i, key, names, w)
        L: dict[str, torch.Tensor] = {"attn_norm": self._need(w, p + "attn_norm.weight")}
        q, k, v = (self._need(w, f"{p}attn_{n}.weight") for n in "qkv")
        L["wqkv"] = _fuse(q, k, v)
        self._q_out, self._k_out = q.shape[0], k.shape[0]
        del q, k, v
        if self.spec.attn_bias:
            L["bqkv"] = torch.cat([self._need(w, f"{p}attn_{n}.bias") for n in "qkv"], 0)
        L["wo"] = _linear(self._need(w, p + "attn_output.weight"))
        for opt in _OPTIONAL_NORMS:
            if p + opt + ".weight" in w:
                L[opt] = w[p + opt + ".weight"]
        L["ffn_norm"] = self._need(w, p + "ffn_norm.weight")
        if p + "ffn_gate_inp.weight" in w:
            self._load_moe_layer(p, w, L)
        else:
            L["gate_up"] = _fuse(self._need(w, p + "ffn_gate.weight"),
                                 self._need(w, p + "ffn_up.weight"))
            L["down"] = _linear(self._need(w, p + "ffn_down.weight"))
        for n in _CONSUMED:
            w.pop(p + n + ".weight", None)
        # matmul weights are kept transposed, [in, out] contiguous: x @ W_t reads memory
        # ~1.5x faster than x @ W.t() on the CPU (GEMV is bandwidth bound)
        for key in _LINEAR_KEYS:
            if key in L and isinstance(L[key], torch.Tensor):
                L[key] = L[key].t().contiguous()
        return L

    def _load_moe_layer(self, p: str, w: dict, L: dict) -> None:
        """Router (and selection bias) plus the optional shared expert of a MoE block."""
        L["router"] = w[p + "ffn_gate_inp.weight"]
        if p + "exp_probs_b.bias" in w:
            L["exp_bias"] = w[p + "exp_probs_b.bias"]
        if p + "ffn_up_shexp.weight" in w:
            L["sh_gate_up"] = _fuse(self._need(w, p + "ffn_gate_shexp.weight"),
                                    self._need(w, p + "ffn_up_shexp.weight"))
            L["sh_down"] = _linear(self._need(w, p + "ffn_down_shexp.weight"))
            if p + "ffn_gate_inp_shexp.weight" in w:
                L["sh_gate"] = w[p + "ffn_gate_inp_shexp.weight"]

    # ---- construction from a file ----
    @classmethod
    def from_model_file(cls, model_file, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32,
                        experts: ExpertProvider | None = None,
                        spec: ModelSpec | None = None, numerics: str = "exact",
                        packed: bool | None = None) -> "Transformer":
        """Load a model from a :class:`localmoe.io.model_file.ModelFile` (dequantizing every tensor,
        or keeping GGUF block-quantized matmul weights packed, see ``packed``).

        Args:
            model_file: an open ModelFile (``.spec``, ``.format``, ``.tensor_names()``,
                ``.load_tensor(name, dtype, device)``).
            device, dtype: where and in which float type weights live.
            experts: a custom provider (e.g. offloading); default resident.
            spec: an already configured spec (default: configure ``model_file.spec``).
            numerics: ``"exact"`` (float32 matmuls on the dequantized weights: the reference) or
                ``"ggml"`` (GGUF only: additionally round each quantized matmul's input
                activations to the weight type's ggml ``vec_dot_type`` as llama.cpp's CPU
                backend does -- for tight parity checks against llama.cpp).
            packed: keep the GGUF block-quantized matmul weights (q/k/v/o, FFN, shared experts,
                embedding/lm head; types Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K) packed in memory
                and multiply them with the exact CPU kernel of :mod:`localmoe.cpu.qmatmul` (same
                function as the float32 path up to float32 summation order; ~4-6x fewer bytes
                read per decoded token). ``None`` (default): on when the model is GGUF, the
                device is the CPU, ``dtype`` float32, ``numerics="exact"`` and the kernel builds;
                ``False``: always dequantize to float; ``True``: require it.

        Raises:
            UnsupportedModelError: unknown architecture; ModelLoadError: missing tensors.
            ValueError: unknown ``numerics``; ``packed=True`` where it cannot apply (not GGUF,
                not CPU float32, ``numerics="ggml"``) or the kernel cannot be built (reason
                given).
        """
        if numerics not in ("exact", "ggml"):
            raise ValueError(f"numerics must be 'exact' or 'ggml', got {numerics!r}")
        use_packed = False
        if packed is not False:
            why = _packed_unavailable(model_file, device, dtype, numerics)
            use_packed = why is None
            if packed and why:
                raise ValueError(f"packed weights requested but unavailable: {why}")
        names = set(model_file.tensor_names())
        if spec is None:
            spec = get_family(model_file.spec.arch).configure(model_file.spec, model_file.format,
                                                              names)
        off = float(spec.norm_weight_offset or 0.0)

        def load(name: str) -> torch.Tensor:
            t = model_file.load_tensor(name, dtype=torch.float32, device="cpu")
            if off and name.endswith(_NORM_SUFFIXES):
                t = t + off
            return t.to(device=device, dtype=dtype)

        def load_linear(name: str):
            if use_packed and name.endswith(_PACKABLE_SUFFIXES):
                from localmoe.cpu.qmatmul import PACKABLE_QTYPES, pack_gguf

                raw = model_file.raw_tensor(name)
                if raw.qtype in PACKABLE_QTYPES and len(raw.shape) == 2:
                    return pack_gguf(raw.data, raw.qtype, raw.shape)
            return load(name)

        weights = {n: load_linear(n) for n in sorted(names) if "_exps." not in n}
        if experts is None and spec.is_moe:
            moe_layers = [i for i in range(spec.n_layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
            experts = ResidentExpertProvider.from_loader(moe_layers, load)
        ops = None
        if numerics == "ggml" and model_file.format == "gguf":
            from localmoe.model.ggml_numerics import GgmlOps

            ops = GgmlOps.from_model_file(model_file, names, device, spec.act)
        return cls(spec, weights, experts, ops)

    # ---- pieces ----
    def rope_for_layer(self, layer: int) -> tuple[float, dict]:
        """(rope base, scaling dict) of ``layer``: sliding-window layers of families with a local
        base (Gemma 3) use ``rope_base_local`` without scaling."""
        s = self.spec
        if s.rope_base_local and s.layer_window(layer):
            return float(s.rope_base_local), {}
        return float(s.rope_base), dict(s.rope_scaling or {})

    def _inv_freq(self, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
        key = (base, tuple(sorted((k, str(v)) for k, v in scaling.items())))
        if key not in self._rope:
            rd = self.spec.rope_dim or self.spec.head_dim
            inv, ms = rope_inv_freq(rd, base, scaling, self.spec.n_ctx_train)
            self._rope[key] = (inv.to(self.device), ms)
        return self._rope[key]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64 token ids -> ``[N, d_model]`` (times ``embed_scale`` if set)."""
        if not isinstance(self.tok_embd, torch.Tensor):
            x = self.tok_embd.rows(tokens)
        else:
            x = self.tok_embd.index_select(0, tokens)
        if self.spec.embed_scale:
            x = x * self.spec.embed_scale
        return x

    def _glu(self, layer: int, x: torch.Tensor, gate_up: str, down: str) -> torch.Tensor:
        """``down(act(gate x) * up x)`` with the fused ``gate_up`` weight of ``layer``."""
        L, ops = self.layers[layer], self.ops
        g, u = ops.linear(x, L[gate_up], layer, gate_up).chunk(2, dim=-1)
        return ops.linear(ops.act(g) * u, L[down], layer, down)

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Dense or MoE FFN of ``layer`` on ``[N, d_model]`` (input already normed): the MoE
        hook's routed mixture plus the shared expert, if any."""
        L = self.layers[layer]
        if "router" not in L:
            return self._glu(layer, x, "gate_up", "down")
        out = self.moe(layer, x)
        if "sh_gate_up" in L:
            sh = self._glu(layer, x, "sh_gate_up", "sh_down")
            if "sh_gate" in L:
                sh = sh * shared_expert_gate(x, L["sh_gate"])
            out = out + sh
        return out

    def block(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, ...],
              attn: AttnFn) -> torch.Tensor:
        """One transformer block on ``x [N, d_model]``; ``rope`` = full-width (cos, sin) tables
        ``[N, 1, R]`` (:func:`rope_tables`) for this layer's base, optionally followed by the
        signed sin table of :func:`rope_signed_sin` (enables the fewer-op CPU float32 path);
        ``attn(layer, q[N,H,D], k[N,Hkv,D], v[N,Hkv,Dv]) -> [N,H,Dv]``."""
        s = self.spec
        L = self.layers[layer]
        N = x.shape[0]
        eps = s.norm_eps
        h = self.ops.norm(x, L["attn_norm"], eps)
        qkv = self.ops.linear(h, L["wqkv"], layer, "wqkv")
        if "bqkv" in L:
            qkv = qkv + L["bqkv"]
        cos2, sin2 = rope[0], rope[1]
        if (len(rope) > 2 and not s.qk_norm and qkv.dtype == torch.float32
                and cos2.shape[-1] == s.head_dim):
            # q and k are adjacent columns of qkv: rotate them as one [N, H + Hkv, D] tensor
            qk = qkv[:, :self._q_out + self._k_out].unflatten(-1, (-1, s.head_dim))
            qk = apply_rope_swapped(qk, cos2, rope[2], s.rope_style)
            q, k = qk[:, :s.n_heads], qk[:, s.n_heads:]
            v = qkv[:, self._q_out + self._k_out:].unflatten(-1, (s.n_kv_heads, s.v_head_dim))
            o = attn(layer, q, k, v).reshape(N, -1)
            return self._block_tail(layer, x, o)
        q, k, v = qkv.split([self._q_out, self._k_out, qkv.shape[1] - self._q_out - self._k_out], -1)
        if s.qk_norm and s.qk_norm_full:
            q = self.ops.norm(q, L["attn_q_norm"], eps)
            k = self.ops.norm(k, L["attn_k_norm"], eps)
        q = q.reshape(N, s.n_heads, s.head_dim)
        k = k.reshape(N, s.n_kv_heads, s.head_dim)
        v = v.reshape(N, s.n_kv_heads, s.v_head_dim)
        if s.qk_norm and not s.qk_norm_full:
            q = self.ops.norm(q, L["attn_q_norm"], eps)
            k = self.ops.norm(k, L["attn_k_norm"], eps)
        if len(rope) > 2 and q.dtype == torch.float32 and cos2.shape[-1] == s.head_dim:
            q = apply_rope_swapped(q, cos2, rope[2], s.rope_style)
            k = apply_rope_swapped(k, cos2, rope[2], s.rope_style)
        else:
            q = self.ops.rope(q, cos2, sin2, s.rope_style)
            k = self.ops.rope(k, cos2, sin2, s.rope_style)
        o = attn(layer, q, k, v).reshape(N, -1)
        return self._block_tail(layer, x, o)

    def _block_tail(self, layer: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Rest of :meth:`block` after attention: output projection, residuals, FFN."""
        s = self.spec
        L = self.layers[layer]
        eps = s.norm_eps
        if o.dtype != x.dtype:
            o = o.to(x.dtype)
        o = self.ops.linear(o, L["wo"], layer, "wo")
        if "post_attention_norm" in L:
            o = self.ops.norm(o, L["post_attention_norm"], eps)
        x = x + o
        f = self.ffn(layer, self.ops.norm(x, L["ffn_norm"], eps))
        if "post_ffw_norm" in L:
            f = self.ops.norm(f, L["post_ffw_norm"], eps)
        return x + f

    def forward_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttnFn
                       ) -> torch.Tensor:
        """Run all blocks; returns the final-normed hidden states ``[N, d_model]``.

        Args:
            tokens: ``[N]`` int64 ids (all sequences of a batch concatenated).
            positions: ``[N]`` int64 absolute positions of those tokens.
            attn: attention callback (sees each layer's q/k/v after RoPE).
        """
        x = self.embed(tokens)
        for i, rope in enumerate(self.layer_rope_tables(positions)):
            x = self.block(i, x, rope, attn)
        return self.ops.norm(x, self.output_norm, self.spec.norm_eps)

    def layer_rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, the RoPE tables of ``positions [N]`` (:func:`rope_tables`: cos and sin
        ``[N, 1, R]`` float32, plus on the CPU the signed sin of :func:`rope_signed_sin`),
        computed once per distinct RoPE base and shared by the layers that use it."""
        tables: dict[tuple, tuple[torch.Tensor, ...]] = {}
        out = []
        for i in range(self.spec.n_layers):
            base, scaling = self.rope_for_layer(i)
            inv, ms = self._inv_freq(base, scaling)
            key = (base, id(inv))
            if key not in tables:
                tables[key] = rope_tables(
                    *self.ops.rope_cos_sin(positions, inv, ms, base, scaling), self.spec.rope_style)
                if self.device.type == "cpu":   # CUDA keeps the original op sequence
                    tables[key] += (rope_signed_sin(tables[key][1], self.spec.rope_style),)
            out.append(tables[key])
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d_model]`` -> ``[N, vocab_size]`` float32 (final soft-cap applied if set)."""
        if self.output_t is not None:   # (an untied float head keeps only its transpose)
            out = self.ops.linear(hidden, self.output_t, -1, "output").float()
        elif not isinstance(self.output, torch.Tensor):
            out = self.output(hidden).float()
        else:
            out = self.ops.linear(hidden, self.output.t(), -1, "output").float()
        cap = self.spec.final_logit_softcap
        if cap:
            out = cap * torch.tanh(out / cap)
        return out

    def layer_window(self, layer: int) -> int | None:
        """Sliding window (tokens) of ``layer`` or None."""
        return self.spec.layer_window(layer)

    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cache-free forward of one sequence at positions ``0..N-1``: ``[N]`` -> logits
        ``[N, vocab]`` float32 (the test oracle for cached/batched paths)."""
        pos = torch.arange(tokens.shape[0], device=tokens.device)

        def attn(layer, q, k, v):
            return attention(q, k, v, q_start=0, scale=self.scale,
                             window=self.layer_window(layer), softcap=self.spec.attn_logit_softcap)

        return self.logits(self.forward_hidden(tokens, pos, attn))
