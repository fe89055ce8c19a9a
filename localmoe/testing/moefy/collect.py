"""Dense-model activations for moefication: the FFN input of every layer on calibration text.

The dense model runs as the project's reference :class:`~localmoe.model.transformer.Transformer`
(float weights, exact numerics). Its ``ffn`` method is wrapped on the instance so every layer's
FFN input (after the pre-FFN norm) is recorded; the model itself is not changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DenseFFN", "load_dense", "token_chunks", "collect_ffn_inputs", "dense_ffn"]


@dataclass
class DenseFFN:
    """One layer's dense FFN in float32 (torch order).

    gate, up: ``[d_ff, d_model]``; down: ``[d_model, d_ff]``.
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def load_dense(model_file):
    """The dense reference Transformer (float32 on the CPU, not packed) and its tokenizer."""
    from localmoe.model.transformer import Transformer
    from localmoe.text.tokenizer import Tokenizer

    model = Transformer.from_model_file(model_file, packed=False)
    return model, Tokenizer.from_model(model_file)


def dense_ffn(model, layer: int) -> DenseFFN:
    """Layer ``layer``'s dense FFN weights out of a loaded Transformer (its fused, transposed
    ``gate_up [d_model, 2 d_ff]`` and ``down [d_ff, d_model]``)."""
    L = model.layers[layer]
    g, u = L["gate_up"].t().chunk(2, dim=0)
    return DenseFFN(g.contiguous(), u.contiguous(), L["down"].t().contiguous())


def token_chunks(tokenizer, text: str, n_tokens: int, seq_len: int, add_bos: bool
                 ) -> list[torch.Tensor]:
    """Split ``text`` into sequences of ``seq_len`` tokens (each starting with BOS when the
    model adds one), ``n_tokens`` in all (fewer if the text is shorter).

    Returns:
        list of ``[<= seq_len]`` int64 tensors.
    """
    ids = tokenizer.encode(text, add_special=False)
    bos = getattr(tokenizer, "bos_id", None)
    body = seq_len - 1 if (add_bos and bos is not None) else seq_len
    out, pos, total = [], 0, 0
    while pos < len(ids) and total < n_tokens:
        take = min(body, n_tokens - total - (seq_len - body), len(ids) - pos)
        if take <= 0:
            break
        seq = ([bos] if seq_len != body else []) + ids[pos:pos + take]
        out.append(torch.tensor(seq, dtype=torch.int64))
        pos += take
        total += len(seq)
    return out


@torch.no_grad()
def collect_ffn_inputs(model, chunks: list[torch.Tensor], layers: list[int] | None = None,
                       v_stats: dict | None = None) -> dict[int, torch.Tensor]:
    """Run the dense model over ``chunks`` (cache-free, positions from 0 per chunk) and return
    each layer's FFN input.

    Args:
        v_stats: if given, filled with ``{layer: max over tokens and heads of mean(v^2)}`` (the
            attention values' mean square per head; the gemma4 writer sizes its V-norm
            neutralization with it).

    Returns:
        ``{layer: [N, d_model] float32}`` with ``N = sum(len(c))``.
    """
    from localmoe.model.ops import attention

    layers = list(range(model.spec.n_layers)) if layers is None else list(layers)
    want = set(layers)
    rec: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    orig = model.ffn

    def ffn(layer, x):
        if layer in want:
            rec[layer].append(x.detach().clone())
        return orig(layer, x)

    def attn(layer, q, k, v):
        if v_stats is not None:
            m = float(v.float().pow(2).mean(-1).max())
            v_stats[layer] = max(v_stats.get(layer, 0.0), m)
        return attention(q, k, v, q_start=0, scale=model.scale, window=model.layer_window(layer),
                         softcap=model.spec.attn_logit_softcap)

    model.ffn = ffn
    try:
        for c in chunks:
            model.forward_hidden(c, torch.arange(c.shape[0]), attn)
    finally:
        del model.ffn
    return {l: torch.cat(v) for l, v in rec.items()}
