"""HF checkpoint directories (config.json + safetensors) behind the same ModelFile interface.

A directory with ``config.json`` and one or more ``*.safetensors`` files (plus
``model.safetensors.index.json`` when sharded; optionally ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) opens as :class:`HFModelFile`. Tensors are
read lazily through ``safetensors.safe_open`` (memory-mapped) and exposed under the canonical
GGUF names (``blk.{i}.attn_q.weight``, ``blk.{i}.ffn_gate_exps.weight``, ...), in the same torch
order as the GGUF loader gives: ``attn_q.weight`` ``[n_heads*head_dim, d_model]``, stacked experts
``ffn_gate_exps``/``ffn_up_exps`` ``[n_experts, d_ff_expert, d_model]``, ``ffn_down_exps``
``[n_experts, d_model, d_ff_expert]``, router ``ffn_gate_inp`` ``[n_experts, d_model]``. The
ModelSpec comes from ``config.json`` (:func:`localmoe.io.hf_spec.spec_from_hf_config`; HF Q/K
weights are unpermuted, so every HF model runs with ``rope_style = "neox"``).

Per-expert tensors (``mlp.experts.{e}.gate_proj``, Mixtral ``block_sparse_moe.experts.{e}.w1``)
and the fused transformers-5 layout (``mlp.experts.gate_up_proj [E, 2F, D]``,
``mlp.experts.down_proj [E, D, F]``) are both accepted.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.io.hf_spec import HF_ARCHS, check_model_type, spec_from_hf_config
from localmoe.io.model_file import ModelFile, TensorInfo
from localmoe.io.validate import check_tensor_shapes

__all__ = ["HFModelFile"]

_DTYPE_NAMES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}

# per-layer HF suffix -> GGUF suffix (dense parts)
_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_POST_ATTN = {  # post_attention_layernorm means "ffn_norm" except in gemma3 (4 norms per block)
    False: {"post_attention_layernorm.weight": "ffn_norm.weight"},
    True: {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
}
_EXPERT_RE = re.compile(
    r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_LAYER_RE = re.compile(r"^(?:model\.(?:language_model\.)?)?layers\.(\d+)\.(.+)$")


class HFModelFile(ModelFile):
    """An HF checkpoint directory, read lazily with ``safetensors.safe_open``.

    Raises (constructor): ``ModelLoadError`` for a missing/invalid ``config.json``, no or missing
    safetensors shards, unreadable shard headers, tensors that do not fit the config;
    ``UnsupportedModelError`` for an unsupported model_type or unknown tensors (e.g. FP8 scales).
    """

    format = "safetensors"

    def __init__(self, path):
        self.path = Path(path)
        self._handles: dict[str, Any] = {}
        try:
            self._open()
        except ModelLoadError:
            self.close()
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError, MemoryError, UnicodeError) as e:
            # safety net: a corrupt config.json or index must never surface as a traceback
            self.close()
            raise ModelLoadError(
                f"{self.path}: the model files are corrupt or inconsistent ({type(e).__name__}: "
                f"{str(e)[:200]}); download them again") from e

    def _open(self) -> None:
        cfg_path = self.path / "config.json"
        try:
            self.config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelLoadError(f"{self.path} has no config.json; pass an HF model directory or a .gguf file") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ModelLoadError(f"{cfg_path} is not valid JSON ({str(e)[:200]}); download it again") from None
        if not isinstance(self.config, dict):
            raise ModelLoadError(f"{cfg_path} does not hold a JSON object")
        if self.config.get("model_type") is not None:
            check_model_type(self.config, str(cfg_path))  # the cause, before the tensor names
        self._files = self._find_files()
        self._src: dict[str, tuple[str, str, tuple[int, ...], str]] = {}  # hf name -> (file, dtype, shape)
        self._scan()
        self._map: dict[str, tuple] = {}
        self._build_map()
        self.spec = spec_from_hf_config(self.config, set(self._map))
        check_tensor_shapes(self.spec, self, source="config.json")
        self._check_shapes()
        self.name = self.config.get("_name_or_path") or self.path.name
        self.spec.name = self.spec.name or self.name
        self.metadata = self._synth_metadata()

    # --- files -------------------------------------------------------------------------------
    def _find_files(self) -> list[Path]:
        idx = self.path / "model.safetensors.index.json"
        if idx.is_file():
            try:
                wm = json.loads(idx.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{idx} is not a valid safetensors index ({e}); download it again") from None
            files = sorted(set(wm.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise ModelLoadError(
                    f"{self.path}: {len(missing)} of {len(files)} safetensors shards named in "
                    f"model.safetensors.index.json are missing: {', '.join(missing)}; download them"
                )
            return [self.path / f for f in files]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            if list(self.path.glob("*.bin")) or list(self.path.glob("*.pth")):
                raise UnsupportedModelError(
                    f"{self.path} holds PyTorch pickle weights (.bin/.pth) only; localmoe reads safetensors "
                    f"(convert with transformers save_pretrained(safe_serialization=True))"
                )
            raise ModelLoadError(f"{self.path} has config.json but no .safetensors files")
        return files

    def _handle(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            from safetensors import safe_open

            try:
                h = safe_open(str(self.path / fname), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError / OSError
                raise ModelLoadError(
                    f"{self.path / fname}: cannot read safetensors header ({e}); the file is truncated or "
                    f"corrupt; download it again"
                ) from None
            self._handles[fname] = h
        return h

    def _scan(self) -> None:
        for f in self._files:
            h = self._handle(f.name)
            for k in h.keys():
                sl = h.get_slice(k)
                dt = sl.get_dtype()
                if dt not in _DTYPE_NAMES:
                    raise UnsupportedModelError(
                        f"tensor {k!r} in {f.name} has dtype {dt}; localmoe reads F32/F16/BF16 safetensors "
                        f"(quantized HF checkpoints are not supported; use a GGUF file)"
                    )
                self._src[k] = (f.name, dt, tuple(int(x) for x in sl.get_shape()))

    # --- names -------------------------------------------------------------------------------
    def _build_map(self) -> None:
        gemma = HF_ARCHS.get(self.config.get("model_type")) == "gemma3"
        layer_map = dict(_LAYER_MAP, **_POST_ATTN[gemma])
        experts: dict[tuple[int, str], dict[int, str]] = {}
        unmapped = []
        for k in self._src:
            if k in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight"):
                self._map["token_embd.weight"] = ("one", k)
            elif k in ("model.norm.weight", "model.language_model.norm.weight", "norm.weight"):
                self._map["output_norm.weight"] = ("one", k)
            elif k in ("lm_head.weight",):
                self._map["output.weight"] = ("one", k)
            elif k.endswith("rotary_emb.inv_freq"):
                continue
            else:
                m = _LAYER_RE.match(k)
                if not m:
                    unmapped.append(k)
                    continue
                i, rest = int(m.group(1)), m.group(2)
                if rest in layer_map:
                    self._map[f"blk.{i}.{layer_map[rest]}"] = ("one", k)
                    continue
                em = _EXPERT_RE.match(rest)
                if em:
                    experts.setdefault((i, _EXPERT_PART[em.group(2)]), {})[int(em.group(1))] = k
                    continue
                if rest == "mlp.experts.gate_up_proj":
                    self._map[f"blk.{i}.ffn_gate_exps.weight"] = ("half", k, 0)
                    self._map[f"blk.{i}.ffn_up_exps.weight"] = ("half", k, 1)
                    continue
                if rest == "mlp.experts.down_proj":
                    self._map[f"blk.{i}.ffn_down_exps.weight"] = ("one", k)
                    continue
                unmapped.append(k)
        if unmapped:
            raise UnsupportedModelError(
                f"{self.path}: {len(unmapped)} tensors have names localmoe does not know for model_type "
                f"{self.config.get('model_type')!r}, e.g. {', '.join(unmapped[:4])}"
            )
        for (i, part), d in experts.items():
            n = len(d)
            if sorted(d) != list(range(n)):
                raise ModelLoadError(f"layer {i} {part} experts are not numbered 0..{n - 1}: {sorted(d)[:8]}...")
            self._map[f"blk.{i}.ffn_{part}_exps.weight"] = ("stack", [d[e] for e in range(n)])
        if "token_embd.weight" not in self._map:
            raise ModelLoadError(f"{self.path}: no embedding tensor (model.embed_tokens.weight) in the safetensors files")

    def _shape_dtype(self, name: str) -> tuple[tuple[int, ...], str, int]:
        src = self._map[name]
        if src[0] == "one":
            _, dt, shp = self._src[src[1]]
            if name.endswith("ffn_gate_inp_shexp.weight") and len(shp) == 2 and shp[0] == 1:
                shp = (shp[1],)
            return shp, dt, math.prod(shp)
        if src[0] == "half":
            _, dt, shp = self._src[src[1]]
            shp = (shp[0], shp[1] // 2) + shp[2:]
            return shp, dt, math.prod(shp)
        parts = [self._src[k] for k in src[1]]
        shp0, dt0 = parts[0][2], parts[0][1]
        for _, dt, shp in parts:
            if shp != shp0 or dt != dt0:
                raise ModelLoadError(f"experts of {name} differ in shape/dtype ({shp0} {dt0} vs {shp} {dt})")
        shp = (len(parts),) + shp0
        return shp, dt0, math.prod(shp)

    def _check_shapes(self) -> None:
        s = self.spec
        exp = {
            "token_embd.weight": (s.vocab_size, s.d_model),
            "blk.0.attn_q.weight": (s.n_heads * s.head_dim, s.d_model),
            "blk.0.attn_k.weight": (s.n_kv_heads * s.head_dim, s.d_model),
        }
        if s.is_moe:
            L = s.leading_dense_layers
            exp[f"blk.{L}.ffn_gate_exps.weight"] = (s.n_experts, s.d_ff_expert, s.d_model)
            exp[f"blk.{L}.ffn_down_exps.weight"] = (s.n_experts, s.d_model, s.d_ff_expert)
            exp[f"blk.{L}.ffn_gate_inp.weight"] = (s.n_experts, s.d_model)
        for n, want in exp.items():
            if n not in self._map:
                raise ModelLoadError(f"{self.path}: tensor for {n} is missing from the safetensors files")
            got = self._shape_dtype(n)[0]
            if got != want:
                raise ModelLoadError(
                    f"{self.path}: {n} has shape {got} but config.json implies {want}; config and weights do not match"
                )

    # --- metadata ----------------------------------------------------------------------------
    def _synth_metadata(self) -> dict[str, Any]:
        s, a = self.spec, self.spec.arch + "."
        md: dict[str, Any] = {
            "general.architecture": s.arch,
            "general.name": self.name,
            "general.source.format": "safetensors",
            a + "block_count": s.n_layers,
            a + "embedding_length": s.d_model,
            a + "feed_forward_length": s.d_ff,
            a + "attention.head_count": s.n_heads,
            a + "attention.head_count_kv": s.n_kv_heads,
            a + "attention.key_length": s.head_dim,
            a + "attention.value_length": s.v_head_dim,
            a + "attention.layer_norm_rms_epsilon": s.norm_eps,
            a + "context_length": s.n_ctx_train,
            a + "rope.freq_base": s.rope_base,
            a + "vocab_size": s.vocab_size,
        }
        if s.is_moe:
            md.update({a + "expert_count": s.n_experts, a + "expert_used_count": s.top_k,
                       a + "expert_feed_forward_length": s.d_ff_expert,
                       a + "expert_weights_norm": s.norm_topk_prob})
            if s.d_ff_shared:
                md[a + "expert_shared_feed_forward_length"] = s.d_ff_shared
        for key, cfgk in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                          ("tokenizer.ggml.padding_token_id", "pad_token_id")):
            v = self.config.get(cfgk)
            if isinstance(v, list) and v:
                v = v[0]
            if isinstance(v, int):
                md[key] = v
        tj = self.path / "tokenizer.json"
        if tj.is_file():
            md["tokenizer.huggingface.json"] = tj.read_text(encoding="utf-8")
        tmpl = None
        jinja = self.path / "chat_template.jinja"
        tc = self.path / "tokenizer_config.json"
        if tc.is_file():
            try:
                tcfg = json.loads(tc.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{tc} is not valid JSON ({e})") from None
            t = tcfg.get("chat_template")
            if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
                for item in t:
                    if isinstance(item, dict) and item.get("name") and item.get("template"):
                        key = "tokenizer.chat_template" if item["name"] == "default" else f"tokenizer.chat_template.{item['name']}"
                        md[key] = item["template"]
            elif isinstance(t, str):
                tmpl = t
            for k in ("add_bos_token", "add_eos_token"):
                if isinstance(tcfg.get(k), bool):
                    md[f"tokenizer.ggml.{k}"] = tcfg[k]
        if jinja.is_file():
            tmpl = jinja.read_text(encoding="utf-8")
        if tmpl:
            md["tokenizer.chat_template"] = tmpl
        return md

    # --- ModelFile API -----------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """Canonical GGUF names of every tensor (experts stacked into ``*_exps``)."""
        return list(self._map)

    def has_tensor(self, name: str) -> bool:
        return name in self._map

    def tensor_info(self, name: str) -> TensorInfo:
        """Storage dtype name (F32/F16/BF16), torch-order shape and byte size of ``name``."""
        if name not in self._map:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} is not in this checkpoint")
        shp, dt, nel = self._shape_dtype(name)
        return TensorInfo(name, _DTYPE_NAMES[dt], shp, nel * (4 if dt == "F32" else 2))

    def _get(self, hf_name: str):
        fname = self._src[hf_name][0]
        return self._handle(fname).get_tensor(hf_name)

    def load_tensor(self, name: str, dtype=None, device="cpu"):
        """Tensor ``name`` as a new torch tensor of ``dtype`` (default float32) on ``device``.

        Raises ModelLoadError when the name is not in the checkpoint.
        """
        import torch

        dtype = dtype or torch.float32
        if name not in self._map:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} is not in this checkpoint")
        src = self._map[name]
        if src[0] == "one":
            t = self._get(src[1])
            if name.endswith("ffn_gate_inp_shexp.weight") and t.ndim == 2 and t.shape[0] == 1:
                t = t.reshape(-1)
        elif src[0] == "half":
            full = self._get(src[1])
            f = full.shape[1] // 2
            t = full[:, :f] if src[2] == 0 else full[:, f:]
        else:
            t = torch.stack([self._get(k) for k in src[1]])
        return t.to(device=device, dtype=dtype).contiguous()

    def close(self) -> None:
        self._handles.clear()
