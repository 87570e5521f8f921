"""Helpers shared by the kvcache tests: what ``tq_jax.dumps`` writes for one sequence and
what ``tq_jax.loads`` decodes from it (the inputs of :mod:`tq_jax._src.kvcache.reference`),
and ragged appends."""

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax import kvcache
from tq_jax._src.kvcache import reference

D = 64  # head_dim of the small caches
H = 2  # kv_heads


def dumps_kv(k, v, cfg):
    """What tq_jax.dumps writes for one sequence's K/V [T, H, D] under the cache's settings."""
    x = np.stack([k, v])[:, None]
    kw = dict(seed=cfg.seed, rotation=cfg.rotation, norm_correction=cfg.norm_correction, trellis=cfg.trellis)
    if cfg.key_bits == cfg.value_bits:
        return tq_jax.dumps(x, bits=cfg.key_bits, **kw)
    return tq_jax.dumps(x, key_bits=cfg.key_bits, value_bits=cfg.value_bits, **kw)


def decoded_kv(k, v, cfg):
    """The K/V ``[2, T, H, D]`` (float64) that ``tq_jax.loads`` decodes from :func:`dumps_kv`'s blob."""
    return np.asarray(tq_jax.loads(dumps_kv(k, v, cfg), dtype=jnp.float32), np.float64)[:, 0]


def attend_reference(k, v, cfg, q, exact_from=0):
    """:func:`tq_jax._src.kvcache.reference.attend` for one sequence of a cache configured by
    ``cfg`` holding ``k, v [T, H, D]``, its codes decoded through ``dumps``/``loads``."""
    return reference.attend(q, np.stack([k, v]), decoded_kv(k, v, cfg), window=cfg.window, sinks=cfg.sinks,
                            exact_from=exact_from)


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
