"""Helpers shared by the kvcache tests: dense float64 attention (the reference), what
``tq_jax.dumps`` writes for one sequence, and ragged appends."""

import numpy as np
import pytest

import tq_jax
from tq_jax import kvcache

D = 64  # head_dim of the small caches
H = 2  # kv_heads


def dense_attention(q, k, v, sliding_window=None, scale=None):
    """Causal softmax attention, float64: q [Q, Hq, D] are the last Q positions of k/v [T, H, D].
    With ``sliding_window`` W a query at position p sees positions p-W+1..p; ``scale``
    defaults to 1/sqrt(D)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n_q, q_heads, dim = q.shape
    t, heads = k.shape[:2]
    g = q_heads // heads
    scale = 1 / np.sqrt(dim) if scale is None else scale
    s = np.einsum("qhgd,thd->hgqt", q.reshape(n_q, heads, g, dim), k) * scale
    qpos = (t - n_q + np.arange(n_q))[:, None]
    allowed = np.arange(t)[None, :] <= qpos  # [Q, T]
    if sliding_window is not None:
        allowed &= np.arange(t)[None, :] > qpos - sliding_window
    s = np.where(allowed, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    p = np.where(allowed, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
    l = p.sum(-1, keepdims=True)
    out = np.einsum("hgqt,thd->qhgd", p / np.where(l == 0, 1, l), v)  # no key visible: zeros
    return out.reshape(n_q, q_heads, dim)


def dumps_kv(k, v, cfg):
    """What tq_jax.dumps writes for one sequence's K/V [T, H, D] under the cache's settings."""
    x = np.stack([k, v])[:, None]
    if cfg.key_bits == cfg.value_bits:
        return tq_jax.dumps(x, bits=cfg.key_bits, seed=cfg.seed, rotation=cfg.rotation)
    return tq_jax.dumps(x, key_bits=cfg.key_bits, value_bits=cfg.value_bits, seed=cfg.seed, rotation=cfg.rotation)


def fill(cache, rng, first, second, n_new=16, scale=1.0):
    """Two ragged appends of n_new-token chunks; returns the cache and each sequence's K, V."""
    batch = cache.config.batch
    k = (rng.standard_normal((batch, 2 * n_new, H, D)) * scale).astype(np.float32)
    v = rng.standard_normal((batch, 2 * n_new, H, D)).astype(np.float32)
    cache = kvcache.append(cache, k[:, :n_new], v[:, :n_new], new_lengths=np.array(first))
    cache = kvcache.append(cache, k[:, n_new:], v[:, n_new:], new_lengths=np.array(second))
    ks = [np.concatenate([k[b, :first[b]], k[b, n_new : n_new + second[b]]]) for b in range(batch)]
    vs = [np.concatenate([v[b, :first[b]], v[b, n_new : n_new + second[b]]]) for b in range(batch)]
    return cache, ks, vs


def with_impls(cases, impls, quick=None, pallas_quick=True):
    """``cases`` x ``impls`` as pytest params: in the quick tier, the XLA path on the cases
    whose indices are in ``quick`` (all when None) and, with ``pallas_quick``, every impl
    on the first case; the rest are ``slow`` (a case compiles its own programs, the Pallas
    interpreter costs seconds a case; the full suite runs them all)."""
    def is_quick(i, impl):
        if impl == "xla":
            return quick is None or i in quick
        return pallas_quick and i == 0

    return [
        pytest.param(*case.values, impl, id=f"{case.id}-{impl}", marks=() if is_quick(i, impl) else pytest.mark.slow)
        for i, case in enumerate(cases) for impl in impls
    ]
