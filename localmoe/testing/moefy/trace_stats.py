"""Statistics of routing traces (:mod:`.trace`) for the expert-offload work.

All functions take one prompt's arrays (``ids [T, L, k]``, ``ahead [T, L, A, E]``) and the
number of prompt tokens; *decode* tokens are ``n_prompt .. T-1`` (one token per step, the
regime an expert cache serves).

* :func:`reuse`: per layer, the mean fraction of a decode token's experts that the previous
  token also used (``|S_t & S_{t-1}| / k``; chance is ``k / E``).
* :func:`cache_hits`: per layer, the hit rate of an expert cache of ``slots`` experts under LRU
  or LFU: the prompt's tokens (in order) warm the cache, then every expert a decode token needs
  is a hit if cached; misses are inserted, evicting the least recently used (LRU) or least
  frequently used, ties to least recent (LFU) expert not needed by the current token.
* :func:`prediction`: per layer ``l`` and lookahead ``d``, how well layer ``l+d``'s router on
  layer ``l``'s hidden state predicts layer ``l+d``'s experts: top-1 accuracy (predicted
  argmax = actual first choice) and top-k recall (``|pred top-k & actual| / k``), over all
  tokens.
"""

from __future__ import annotations

import numpy as np

__all__ = ["reuse", "cache_hits", "prediction", "summarize"]


def reuse(ids: np.ndarray, n_prompt: int) -> np.ndarray:
    """``[L]`` mean consecutive-token expert reuse over decode tokens (NaN if fewer than 2)."""
    T, L, k = ids.shape
    start = max(n_prompt, 1)
    if T - start < 1:
        return np.full(L, np.nan)
    out = np.zeros(L)
    for l in range(L):
        tot = 0.0
        for t in range(start, T):
            tot += len(set(ids[t, l].tolist()) & set(ids[t - 1, l].tolist())) / k
        out[l] = tot / (T - start)
    return out


def _simulate(seq: list[list[int]], n_warm: int, slots: int, policy: str) -> float:
    cache: dict[int, int] = {}        # expert -> last use time
    freq: dict[int, int] = {}
    hits = reqs = 0
    for t, need in enumerate(seq):
        if t >= n_warm:
            hits += sum(1 for e in need if e in cache)
            reqs += len(need)
        for e in need:
            freq[e] = freq.get(e, 0) + 1
        for e in need:
            if e in cache:
                cache[e] = t
                continue
            if len(cache) >= slots:
                cands = [c for c in cache if c not in need] or list(cache)
                if policy == "lru":
                    victim = min(cands, key=lambda c: cache[c])
                else:
                    victim = min(cands, key=lambda c: (freq[c], cache[c]))
                del cache[victim]
            cache[e] = t
    return hits / reqs if reqs else float("nan")


def cache_hits(ids: np.ndarray, n_prompt: int, slots: int, policy: str = "lru") -> np.ndarray:
    """``[L]`` hit rate of a ``slots``-expert cache per layer (``policy`` ``lru`` | ``lfu``)."""
    if policy not in ("lru", "lfu"):
        raise ValueError(f"policy must be 'lru' or 'lfu', got {policy!r}")
    T, L, k = ids.shape
    return np.array([_simulate([ids[t, l].tolist() for t in range(T)], n_prompt, slots, policy)
                     for l in range(L)])


def prediction(ids: np.ndarray, ahead: np.ndarray) -> dict:
    """``{"top1": [L, A], "recall": [L, A]}`` (NaN where ``l+d`` is past the last layer)."""
    T, L, k = ids.shape
    A = ahead.shape[2]
    top1 = np.full((L, A), np.nan)
    rec = np.full((L, A), np.nan)
    for l in range(L):
        for d in range(1, A + 1):
            if l + d >= L:
                continue
            lg = ahead[:, l, d - 1].astype(np.float32)                  # [T, E]
            order = np.argsort(-lg, axis=1, kind="stable")
            actual = ids[:, l + d]                                       # [T, k]
            top1[l, d - 1] = float(np.mean(order[:, 0] == actual[:, 0]))
            pk = order[:, :k]
            rec[l, d - 1] = float(np.mean([len(set(pk[t].tolist()) & set(actual[t].tolist())) / k
                                           for t in range(T)]))
    return {"top1": top1, "recall": rec}


def summarize(traces, n_experts: int, top_k: int, multiples=(1, 2, 4)) -> dict:
    """Per-layer statistics pooled over traces (token-weighted means).

    Returns:
        ``{"reuse": [L], "chance_reuse": k/E, "lru": {m: [L]}, "lfu": {m: [L]},
        "pred_top1": [L, A], "pred_recall": [L, A], "decode_tokens": n}`` with cache sizes
        ``m * top_k`` slots (capped at ``n_experts``).
    """
    def pool(vals, weights):
        v = np.array(vals, dtype=np.float64)
        w = np.array(weights, dtype=np.float64)[:, None] if v.ndim > 1 else np.array(weights, dtype=np.float64)
        w = np.broadcast_to(w.reshape(w.shape[0], *([1] * (v.ndim - 1))), v.shape)
        ok = ~np.isnan(v)
        return np.where(ok.any(0), (np.where(ok, v, 0) * w).sum(0) / np.maximum((w * ok).sum(0), 1e-12), np.nan)

    dec = [len(t.tokens) - t.n_prompt for t in traces]
    allt = [len(t.tokens) for t in traces]
    out = {"reuse": pool([reuse(t.ids, t.n_prompt) for t in traces], dec),
           "chance_reuse": top_k / n_experts, "decode_tokens": int(sum(dec)), "lru": {}, "lfu": {}}
    for m in multiples:
        slots = min(m * top_k, n_experts)
        for pol in ("lru", "lfu"):
            out[pol][m] = pool([cache_hits(t.ids, t.n_prompt, slots, pol) for t in traces], dec)
    preds = [prediction(t.ids, t.ahead) for t in traces]
    out["pred_top1"] = pool([p["top1"] for p in preds], allt)
    out["pred_recall"] = pool([p["recall"] for p in preds], allt)
    return out
