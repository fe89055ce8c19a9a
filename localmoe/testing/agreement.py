"""Teacher-forced agreement of the quantized triton runner with the torch reference on real text.

Both runners read the same GGUF file; the text's tokens are fed one at a time after a short
prompt (the prompt runs the prefill GEMM, every later token the decode step: GEMVs, fused MoE,
decode attention), and each position's logits are compared: top-1 agreement (the fraction of
positions whose argmax is the same) and the max / mean |delta log-softmax| (nats) over the
vocabulary. The bar of the GPU fast path is top-1 >= 99% over 256 tokens
(``tests/backends/test_triton_quant.py``, ``benchmarks/teacher_forced.py``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DEFAULT_TEXT", "teacher_forced"]

#: mixed prose, code and question/answer text (repeated: 256 tokens need about 3 copies)
DEFAULT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a screw press adapted from "
    "wine making. Within fifty years presses operated in more than two hundred cities "
    "across Europe, and the price of books fell sharply. Literacy spread, scholars could "
    "compare identical copies of a text, and new ideas travelled faster than ever before. "
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nQuestion: What is the capital of France?\nAnswer: The capital of "
    "France is Paris, a city on the Seine known for its museums and its cafes. ") * 3


def teacher_forced(model_file, n_tokens: int = 256, text: str | None = None, *,
                   device: str = "cuda", dtype: torch.dtype | None = None,
                   ref_dtype: torch.dtype | None = None, prompt: int = 16,
                   candidate: str = "triton", **triton_options: Any) -> dict:
    """Compare :class:`~localmoe.backends.triton.runner.TritonRunner` (``triton_options``, e.g.
    ``act_precision="int16"``; ``dtype`` None: the runner's own choice, the family's
    ``gpu_dtype``) with the torch runner (``ref_dtype``, default the triton runner's dtype,
    dequantized weights) over the first ``n_tokens`` tokens of ``text`` (default
    :data:`DEFAULT_TEXT`), ``prompt`` of them as one prefill. ``candidate="torch"`` compares
    the torch runner in ``dtype`` instead (e.g. float16 against a float32 reference: the floor
    that rounding alone sets on a model, which a random-weight model with near-tied logits
    puts far below 99%).

    Returns:
        ``{"tokens", "dtype", "ref_dtype", "top1", "max_dlogsm", "mean_dlogsm", "disagree",
        "nonfinite"}``: ``top1`` in [0, 1] over positions where both runners' logits are
        finite (0 where none is); the log-softmax deltas in nats (max over positions and
        vocabulary; mean over positions of the reference's top token); ``disagree`` the
        positions whose argmax differs or whose logits are not finite; ``nonfinite`` how many
        positions have a NaN/inf logit in either runner (must be 0 for a useful comparison).
    Raises:
        ValueError: text shorter than ``prompt + 1`` tokens; an unknown ``candidate``; torch
            runner options with ``candidate="torch"``.
    """
    from localmoe.backends.torch_backend import TorchRunner
    from localmoe.backends.triton.runner import TritonRunner
    from localmoe.text.tokenizer import Tokenizer

    ids = Tokenizer.from_model(model_file).encode(text or DEFAULT_TEXT)[:n_tokens]
    if len(ids) <= prompt:
        raise ValueError(f"teacher_forced: {len(ids)} tokens of text, need more than {prompt}")
    if candidate == "triton":
        b = TritonRunner(model_file, n_ctx=len(ids) + 8, device=device, dtype=dtype,
                         **triton_options)
    elif candidate == "torch" and not triton_options:
        b = TorchRunner(model_file, n_ctx=len(ids) + 8, device=device, dtype=dtype,
                        packed_weights=False)
    else:
        raise ValueError(f"teacher_forced: candidate must be 'triton' or 'torch' (which takes no "
                         f"triton options), got {candidate!r} with {sorted(triton_options)}")
    a = TorchRunner(model_file, n_ctx=len(ids) + 8, device=device, dtype=ref_dtype or b.dtype,
                    packed_weights=False)
    try:
        sa, sb = a.new_sequence(), b.new_sequence()
        la = [a.forward([(sa, ids[:prompt])], all_logits=True)[0].float()]
        lb = [b.forward([(sb, ids[:prompt])], all_logits=True)[0].float()]
        for t in ids[prompt:]:
            la.append(a.forward([(sa, [t])])[0][None].float())
            lb.append(b.forward([(sb, [t])])[0][None].float())
    finally:
        a.close()
        b.close()
    la, lb = torch.cat(la), torch.cat(lb)
    finite = torch.isfinite(la).all(-1) & torch.isfinite(lb).all(-1)
    same = (la.argmax(-1) == lb.argmax(-1)) & finite
    dl = (la.log_softmax(-1) - lb.log_softmax(-1)).abs()[finite]
    top = la[finite].argmax(-1, keepdim=True)
    return {"tokens": len(ids), "dtype": str(b.dtype).replace("torch.", ""),
            "ref_dtype": str(a.dtype).replace("torch.", ""),
            "top1": same.float().mean().item(),
            "max_dlogsm": dl.max().item() if dl.numel() else float("nan"),
            "mean_dlogsm": dl.gather(-1, top).mean().item() if dl.numel() else float("nan"),
            "disagree": (~same).nonzero().flatten().tolist(),
            "nonfinite": int((~finite).sum())}
