"""ModelSpec: the one description of a model's shape that every backend builds from.

Field names follow the project vocabulary (DESIGN.md): ``n_layers, d_model, n_heads,
n_kv_heads, head_dim, n_experts, top_k, d_ff, d_ff_expert, vocab_size``. GGUF metadata keys and
HF config.json names are mapped onto these once, in the loaders.
"""

from __future__ import annotations

from dataclasses import dataclass, field, asdict
from typing import Any


@dataclass
class ModelSpec:
    """Architecture hyper-parameters of a (dense or MoE) decoder-only transformer.

    Units: sizes are element counts; ``rope_base`` in radians base; ``n_ctx_train`` in tokens.
    """

    arch: str                       # GGUF general.architecture: llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe, gemma3
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int                   # key/query head size
    vocab_size: int
    d_ff: int = 0                   # dense FFN hidden size (0 if every layer is MoE)
    head_dim_v: int | None = None   # value head size if different from head_dim
    n_ctx_train: int = 2048
    norm_eps: float = 1e-5
    norm_type: str = "rms"          # rms | layer
    # rope
    rope_base: float = 10000.0
    rope_dim: int | None = None     # number of rotated dims per head (None = head_dim)
    rope_style: str = "norm"        # "norm" (interleaved pairs, GGUF llama) | "neox" (half split)
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # type, factor, original_context_length, ...
    rope_base_local: float | None = None   # gemma3: rope base of sliding-window layers
    # attention variants
    qk_norm: bool = False           # RMSNorm over each q/k head (qwen3, qwen3moe, olmoe, gemma3)
    qk_norm_full: bool = False      # olmoe: norm over the whole q/k projection instead of per head
    attn_bias: bool = False         # qwen2/qwen2moe q/k/v bias
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None   # gemma3: every Nth layer is global (N=6)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    attn_scale: float | None = None  # None -> 1/sqrt(head_dim)
    # embeddings / output
    tie_embeddings: bool = False
    embed_scale: float | None = None  # gemma3: sqrt(d_model)
    act: str = "silu"               # silu | gelu_tanh
    post_norms: bool = False        # gemma3: post-attention and post-ffw norms
    norm_weight_offset: float = 0.0 # 1.0 when the file stores (w - 1) (HF gemma); GGUF gemma stores w+1 already
    # MoE
    n_experts: int = 0
    top_k: int = 0
    d_ff_expert: int = 0
    n_shared_experts: int = 0
    d_ff_shared: int = 0
    shared_expert_gate: bool = False  # qwen2moe: sigmoid(gate_shexp . x) * shared(x)
    gating: str = "softmax"         # softmax | sigmoid
    norm_topk_prob: bool = False
    expert_weights_scale: float = 1.0
    leading_dense_layers: int = 0
    # misc
    name: str = ""

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def v_head_dim(self) -> int:
        return self.head_dim_v or self.head_dim

    def layer_is_moe(self, layer: int) -> bool:
        """True when ``layer`` (0-based) uses experts rather than a dense FFN."""
        return self.is_moe and layer >= self.leading_dense_layers

    def layer_window(self, layer: int) -> int | None:
        """Sliding-window size in tokens for ``layer``, or None for global attention."""
        if not self.sliding_window:
            return None
        if self.sliding_window_pattern:
            return None if (layer + 1) % self.sliding_window_pattern == 0 else self.sliding_window
        return self.sliding_window

    def kv_elements_per_token(self) -> int:
        """K plus V elements stored per token over all layers."""
        return self.n_layers * self.n_kv_heads * (self.head_dim + self.v_head_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
