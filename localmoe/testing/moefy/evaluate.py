"""Measuring a moefied model: perplexity, greedy answers, logits against llama.cpp.

* :func:`perplexity`: next-token perplexity of a Transformer over token sequences (cache-free
  full passes; logits in slices so a 262k vocabulary fits in memory).
* :func:`greedy`: greedy continuation (a prefill, then one token per step over a plain K/V
  list).
* :func:`prompt_tokens`: a chat prompt through the model's chat template, or a plain
  ``Question/Answer`` prompt for base models without one.
* :func:`llamacpp_logits` / :func:`logit_agreement`: llama.cpp's logits for the same tokens and
  the agreement measures of docs/PARITY_LLAMACPP.md (top-1 agreement, max and mean
  ``|d log_softmax|`` in nats).
"""

from __future__ import annotations

import math

import torch

__all__ = ["perplexity", "greedy", "prompt_tokens", "llamacpp_logits", "logit_agreement",
           "CHAT_PROMPTS"]

#: short prompts for the greedy-answer table (chat, code, prose)
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Name three colours of the rainbow.",
    "Explain in one sentence what a CPU does.",
)


def _attn(model):
    from localmoe.model.ops import attention

    def attn(layer, q, k, v):
        return attention(q, k, v, q_start=0, scale=model.scale, window=model.layer_window(layer),
                         softcap=model.spec.attn_logit_softcap)
    return attn


@torch.no_grad()
def perplexity(model, chunks: list[torch.Tensor], slice_rows: int = 128) -> tuple[float, int]:
    """``(perplexity, predicted tokens)`` of ``model`` over ``chunks`` (each ``[n]`` int64,
    positions from 0; the first token of each chunk is context only)."""
    nll, n = 0.0, 0
    for c in chunks:
        h = model.forward_hidden(c, torch.arange(c.shape[0]), _attn(model))
        for s in range(0, c.shape[0] - 1, slice_rows):
            e = min(s + slice_rows, c.shape[0] - 1)
            lg = model.logits(h[s:e])
            nll += torch.nn.functional.cross_entropy(lg.float(), c[s + 1:e + 1], reduction="sum").item()
        n += c.shape[0] - 1
    return math.exp(nll / max(n, 1)), n


@torch.no_grad()
def greedy(model, tokens: list[int], max_new: int, stop_ids: set[int]) -> list[int]:
    """Greedy continuation of ``tokens`` (at most ``max_new`` tokens; stops after a stop id):
    one prefill, then one token per step over a plain per-layer K/V list (float, unpaged)."""
    from localmoe.model.ops import attention

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    start = 0

    def attn(layer, q, k, v):
        if layer in kv:
            k, v = torch.cat([kv[layer][0], k]), torch.cat([kv[layer][1], v])
        kv[layer] = (k, v)
        return attention(q, k, v, q_start=start, scale=model.scale,
                         window=model.layer_window(layer), softcap=model.spec.attn_logit_softcap)

    step = torch.tensor(list(tokens), dtype=torch.int64)
    out: list[int] = []
    while len(out) < max_new:
        h = model.forward_hidden(step, torch.arange(start, start + step.shape[0]), attn)
        start += step.shape[0]
        nxt = int(model.logits(h[-1:]).argmax(-1))
        out.append(nxt)
        if nxt in stop_ids:
            break
        step = torch.tensor([nxt], dtype=torch.int64)
    return out


def prompt_tokens(model_file, tokenizer, question: str) -> list[int]:
    """Token ids of ``question`` as a user turn (chat template), or as
    ``"Question: ...\\nAnswer:"`` when the model has no template."""
    from localmoe.text.chat_template import ChatTemplate

    tpl = ChatTemplate.from_model(model_file, tokenizer)
    if tpl is not None:
        return tpl.encode(tokenizer, [{"role": "user", "content": question}])
    return tokenizer.encode(f"Question: {question}\nAnswer:", add_special=True)


def llamacpp_logits(path, tokens: list[int], n_threads: int = 1):
    """llama.cpp's logits ``[len(tokens), vocab]`` (numpy float32) for ``tokens`` evaluated as one
    prompt (CPU, flash attention off, as docs/PARITY_LLAMACPP.md)."""
    import numpy as np

    from localmoe.backends.llamacpp_backend import raw_llama

    m = raw_llama(model_path=str(path), n_ctx=max(64, len(tokens) + 8), n_batch=512,
                  logits_all=True, verbose=False, n_threads=n_threads, seed=0)
    try:
        m.eval(list(tokens))
        return np.array(m.scores[:len(tokens)], dtype=np.float32)
    finally:
        m.close()


def logit_agreement(a, b) -> dict:
    """Top-1 agreement and max/mean ``|d log_softmax|`` (nats) between two ``[N, vocab]`` logit
    arrays."""
    la = torch.log_softmax(torch.as_tensor(a).float(), -1)
    lb = torch.log_softmax(torch.as_tensor(b).float(), -1)
    d = (la - lb).abs()
    return {"top1": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
            "max_abs": float(d.max()), "mean_abs": float(d.mean()), "n": int(la.shape[0])}
