"""A plan's expert tensors as they are stored in the output file, and as floats.

Gate/up rows are copied block for block from the source (:func:`.gguf_out.take_rows`); the down
projections are re-quantized (:func:`.gguf_out.expert_qtype`). The float versions are the
dequantized stored tensors, so an in-memory model built from them computes what the file holds.
"""

from __future__ import annotations

import numpy as np
import torch

from localmoe.testing.moefy import gguf_out

__all__ = ["StoredExperts", "stored_experts"]


class StoredExperts:
    """One layer's stacked experts in their stored form.

    Attributes:
        gate, up: uint8 blocks ``[E, d_ff_expert, row_bytes]`` (types ``gate_qtype``/``up_qtype``).
        down: stored array for ``[E, d_model, d_ff_expert]`` of type ``down_qtype``.
        shared: ``(gate, up, down, gate_qtype, up_qtype, down_qtype, F_s)`` of the shared
            expert (gate/up ``[F_s, row_bytes]`` source rows, down ``[d_model, F_s]`` holding
            twice the plan's weights, see :attr:`.plan.LayerPlan.sh_gate`), or None.
    """

    shared = None

    def __init__(self, gate, up, down, gate_qtype, up_qtype, down_qtype, shape_gate, shape_down):
        self.gate, self.up, self.down = gate, up, down
        self.gate_qtype, self.up_qtype, self.down_qtype = gate_qtype, up_qtype, down_qtype
        self.shape_gate, self.shape_down = shape_gate, shape_down

    def floats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [E, F, D], up [E, F, D], down [E, D, F])`` float32, dequantized from storage."""
        g = gguf_out.dequantize(self.gate, self.gate_qtype, self.shape_gate)
        u = gguf_out.dequantize(self.up, self.up_qtype, self.shape_gate)
        d = gguf_out.dequantize(self.down, self.down_qtype, self.shape_down)
        return torch.from_numpy(g), torch.from_numpy(u), torch.from_numpy(d)

    def shared_floats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [F_s, D], up [F_s, D], down [D, F_s])`` float32 of the shared expert as
        stored (down doubled)."""
        g, u, d, gq, uq, dq, fs = self.shared
        D = self.shape_gate[2]
        return (torch.from_numpy(gguf_out.dequantize(g, gq, (fs, D))),
                torch.from_numpy(gguf_out.dequantize(u, uq, (fs, D))),
                torch.from_numpy(gguf_out.dequantize(d, dq, (D, fs))))


def _qname(qtype: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(qtype).name


def stored_experts(model_file, layer: int, lp, down_qtype: str | None = None) -> StoredExperts:
    """The stored experts of ``layer`` for layer plan ``lp`` (:class:`.plan.LayerPlan`).

    Args:
        model_file: the dense source (GGUF) the plan was built from.
        down_qtype: force the down projections' type (default: the source's, with llama.cpp's
            fallback when an expert's row does not fill a block).
    """
    p = f"blk.{layer}."
    rg = model_file.raw_tensor(p + "ffn_gate.weight")
    ru = model_file.raw_tensor(p + "ffn_up.weight")
    rd = model_file.raw_tensor(p + "ffn_down.weight")
    E, Fe = lp.groups.shape
    D = rg.shape[1]
    rows = lp.groups.reshape(-1).numpy()
    gate = gguf_out.take_rows(rg.data, rows).reshape(E, Fe, -1)
    up = gguf_out.take_rows(ru.data, rows).reshape(E, Fe, -1)
    dq = down_qtype or gguf_out.expert_qtype(_qname(rd.qtype), Fe)
    d = lp.down.numpy()                                  # [D, F]
    stacked = np.stack([d[:, lp.groups[e].numpy()] for e in range(E)])   # [E, D, Fe]
    down = gguf_out.quantize(stacked, dq)
    st = StoredExperts(gate, up, down, _qname(rg.qtype), _qname(ru.qtype), dq, (E, Fe, D), (E, D, Fe))
    sh = getattr(lp, "shared", None)
    if sh is not None and sh.numel():
        ids = sh.numpy()
        fs = len(ids)
        sdq = down_qtype or gguf_out.expert_qtype(_qname(rd.qtype), fs)
        st.shared = (gguf_out.take_rows(rg.data, ids), gguf_out.take_rows(ru.data, ids),
                     gguf_out.quantize(2.0 * d[:, ids], sdq), _qname(rg.qtype), _qname(ru.qtype),
                     sdq, fs)
    return st
