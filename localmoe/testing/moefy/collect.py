"""Dense-model activations for moefication: the FFN input of every layer on calibration text.

The dense model runs as the project's reference :class:`~localmoe.model.transformer.Transformer`
(float weights, exact numerics). Its ``ffn`` method is wrapped on the instance so every layer's
FFN input (after the pre-FFN norm) is recorded; the model itself is not changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DenseFFN", "load_dense", "token_chunks", "collect_ffn_inputs", "dense_ffn", "LayerStreams"]


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


class LayerStreams:
    """Calibration sequences walked through the model one layer at a time, twice: the dense
    model's residual stream and the moefied model's (layers before the current one already
    replaced), so each layer is fitted on the inputs it will see and can be asked to bring the
    stream back to the dense one (sequential calibration, as GPTQ does for quantization).

    The RoPE tables and the first block's input of every sequence are taken from one cheap
    ``forward_hidden`` pass whose blocks are replaced by the identity; the blocks then run
    through ``model.block`` with the model's own tables, attention and FFN hooks.

    Args:
        model: the dense Transformer (its ``ffn`` is wrapped on the instance while a step runs).
        chunks: token sequences (``[n]`` int64 each).
        v_stats: optional dict filled like :func:`collect_ffn_inputs`' (dense stream).
    """

    def __init__(self, model, chunks: list[torch.Tensor], v_stats: dict | None = None):
        self.model = model
        self.v_stats = v_stats
        self.ropes: list[dict] = []
        start: list[torch.Tensor] = []
        for c in chunks:
            ropes: dict = {}

            def capture(layer, x, rope, attn, ropes=ropes):
                if layer == 0:
                    start.append(x)
                ropes[layer] = rope
                return x

            model.block = capture
            try:
                with torch.no_grad():
                    model.forward_hidden(c, torch.arange(c.shape[0]), self._attn)
            finally:
                del model.block
            self.ropes.append(ropes)
        self.dense = start
        self.moe = [x.clone() for x in start]

    def _attn(self, layer, q, k, v):
        from localmoe.model.ops import attention

        if self.v_stats is not None:
            m = float(v.float().pow(2).mean(-1).max())
            self.v_stats[layer] = max(self.v_stats.get(layer, 0.0), m)
        m = self.model
        return attention(q, k, v, q_start=0, scale=m.scale, window=m.layer_window(layer),
                         softcap=m.spec.attn_logit_softcap)

    @torch.no_grad()
    def _run(self, layer: int, streams: list[torch.Tensor], ffn) -> list[torch.Tensor]:
        m = self.model
        if ffn is not None:
            m.ffn = ffn
        try:
            return [m.block(layer, x, self.ropes[i][layer], self._attn)
                    for i, x in enumerate(streams)]
        finally:
            if ffn is not None:
                del m.ffn

    def dense_step(self, layer: int) -> None:
        """Advance the dense stream through block ``layer`` (the dense FFN)."""
        self.dense = self._run(layer, self.dense, None)

    def moe_inputs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``layer`` on the moefied stream up to its FFN: ``(x [N, d_model], a [N,
        d_model])``, the FFN input (after its norm) and the residual the FFN output is added to
        (all sequences concatenated)."""
        xs: list[torch.Tensor] = []
        zero = lambda l, x: (xs.append(x.clone()), torch.zeros_like(x))[1]  # noqa: E731
        a = self._run(layer, self.moe, zero)
        return torch.cat(xs), torch.cat(a)

    def moe_step(self, layer: int, ffn) -> None:
        """Advance the moefied stream through block ``layer`` with ``ffn(x) -> [n, d_model]`` as
        its FFN (the block applies any post-FFN norm itself)."""
        self.moe = self._run(layer, self.moe, lambda l, x: ffn(x))

    def dense_residual(self) -> torch.Tensor:
        """The dense stream after the last :meth:`dense_step`, concatenated ``[N, d_model]``."""
        return torch.cat(self.dense)
