"""The exact part of attention: dense float32 attention over each sequence's exact
tokens (its window ring and its sinks), returned as online-softmax state that
:func:`tq_jax._src.kvcache.scoring.finish` merges with the coded part.

Slot ``s`` of the window ring holds position ``p = lo + ((s - lo) mod window)`` with
``lo = length - window``: the one position of the last ``window`` congruent to ``s``.
A slot counts when ``p >= max(0, exact_from, sinks)`` (positions below ``sinks`` are
the sink buffer's; below ``exact_from`` nothing exact was stored); sink ``i`` counts
when ``exact_from <= i < length``. Together with
:func:`~tq_jax._src.kvcache.scoring.coded_mask` every token a query sees is read exactly
once.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from tq_jax._src.kvcache import scoring as _scoring
from tq_jax._src.kvcache.state import KVCache

__all__ = ["partial", "positions", "finish", "dense"]

_HI = lax.Precision.HIGHEST


def positions(cache: KVCache):
    """``(pos, valid)`` int32/bool ``[B, sinks + window]``: the position each exact slot
    holds (sinks first, then the ring) and whether attention reads it."""
    cfg = cache.config
    length, start = cache.lengths[:, None], cache.exact_from[:, None]
    sink = jnp.arange(cfg.sinks, dtype=jnp.int32)[None, :]
    sink_valid = (sink >= start) & (sink < length)
    slot = jnp.arange(cfg.window, dtype=jnp.int32)[None, :]
    lo = length - cfg.window
    ring = lo + jnp.mod(slot - lo, cfg.window) if cfg.window else slot
    ring_valid = (ring >= jnp.maximum(start, cfg.sinks)) & (ring >= 0)
    batch = length.shape[0]
    sink, ring = jnp.broadcast_to(sink, (batch, cfg.sinks)), jnp.broadcast_to(ring, (batch, cfg.window))
    ring_valid = jnp.broadcast_to(ring_valid, (batch, cfg.window))
    return jnp.concatenate([sink, ring], axis=1), jnp.concatenate([sink_valid, ring_valid], axis=1)


def dense(q, k, v, pos, valid, last, sliding_window=None):
    """``(m, l, acc)`` ``[B, H, R(, D)]``: a float32 softmax of ``q`` ``[B, Q, q_heads, D]``
    over exact tokens ``k``/``v`` ``[B, T, H, D]`` (any float dtype), rows as in
    :class:`~tq_jax._src.kvcache.scoring.Query` (row ``g*Q + i``: query head ``h*G + g``,
    query ``i``). Token ``t`` counts for row ``r`` iff ``valid[b, t]`` and ``pos[b, t] <=
    last[b, r]``, and, with a ``sliding_window`` ``W``, ``pos[b, t] > last[b, r] - W``; ``acc`` is in natural
    order, and ``v`` of a slot that does not count is never read (it may hold anything)."""
    batch, q_len, q_heads, dim = q.shape
    heads = k.shape[2]
    group = q_heads // heads
    qn = q.astype(jnp.float32).reshape(batch, q_len, heads, group, dim) * np.float32(1.0 / math.sqrt(dim))
    qn = qn.transpose(0, 2, 3, 1, 4).reshape(batch, heads, group * q_len, dim)
    s = jnp.einsum("bhrd,bthd->bhrt", qn, k.astype(jnp.float32), precision=_HI)
    mask = valid[:, None, :] & (pos[:, None, :] <= last[:, :, None])  # [B, R, T]
    if sliding_window:
        mask &= pos[:, None, :] > last[:, :, None] - sliding_window
    mask = mask[:, None]  # [B, 1, R, T]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None]), 0.0)
    v = jnp.where(valid[:, :, None, None], v.astype(jnp.float32), 0.0)  # slots never written may hold anything
    return m, jnp.sum(p, axis=-1), jnp.einsum("bhrt,bthd->bhrd", p, v, precision=_HI)


def partial(cache: KVCache, q, query: _scoring.Query):
    """``(m, l, acc)`` ``[B, H, R(, D)]`` of a softmax over the exact tokens each row
    sees, ``acc`` in natural order; rows as in :class:`~tq_jax._src.kvcache.scoring.Query`."""
    k = jnp.concatenate([cache.k_sinks, cache.k_window], axis=1)  # [B, T, H, D]
    v = jnp.concatenate([cache.v_sinks, cache.v_window], axis=1)
    pos, valid = positions(cache)
    return dense(q, k, v, pos, valid, query.last, query.sliding_window)


def finish(cache: KVCache, q, query: _scoring.Query, m, l, acc):
    """Attention's output from the coded part's ``(m, l, acc)`` (any kernel's), merged
    with this module's exact part when the cache holds exact tokens."""
    exact = partial(cache, q, query) if cache.config.exact else None
    return _scoring.finish(cache, q, acc, l, m, exact)
