"""Decode attention over the codes in XLA ops: a ``fori_loop`` of online-softmax steps,
one block of ``block_tokens`` tokens each (flash-decoding).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tq_jax._src.kvcache import scoring as _scoring
from tq_jax._src.kvcache.state import KVCache

__all__ = ["partial"]

_HI = lax.Precision.HIGHEST


def partial(cache: KVCache, query: _scoring.Query):
    """The coded part of attention: ``(m, l, acc)`` of an online softmax over the tokens
    :func:`tq_jax._src.kvcache.scoring.coded_mask` selects, ``acc`` in the rotated domain and
    planar value order, ``[B, H, R(, D)]``."""
    cfg = cache.config
    batch, dim = cache.lengths.shape[0], cfg.head_dim  # local batch under shard_map
    heads = cache.k_codes.shape[2]
    nv = _scoring.parts(cfg.value_bits)
    hi = query.hi

    ps, blk = cfg.page_tokens, cfg.block_tokens
    unit = min(ps, blk)  # pool rows gathered at once: a page, or a block inside one
    per_block, per_page = blk // unit, ps // unit
    n_units = cfg.num_pages * per_page
    kpool = cache.k_codes.reshape(n_units, unit, heads, -1)
    vpool = cache.v_codes.reshape(n_units, unit, heads, -1)
    knorm = cache.k_norms.reshape(n_units, unit, heads)
    vnorm = cache.v_norms.reshape(n_units, unit, heads)
    table = cache.page_table
    pps = table.shape[1]
    max_blocks = -(-pps * ps // blk)
    n_blocks = jnp.minimum((jnp.max(hi) + blk - 1) // blk, max_blocks)
    scores = (((3,), (3,)), ((0, 1), (0, 1)))  # [B,H,R,d] x [B,H,T,d] -> [B,H,R,T]
    values = (((3,), (2,)), ((0, 1), (0, 1)))  # [B,H,R,T] x [B,H,T,d] -> [B,H,R,d]

    def gather(pool, uidx, j):
        """The block's rows, head-major: [B, H, T, ...]. The uint8 codes are transposed,
        never the float32 centroids they select (1/4 to 1/32 of the bytes moved; docs/
        kvcache.md has the measured effect). Unpaged, sequence b owns page b (init's
        table never changes), so the block is one slice of the pool."""
        if cfg.paged:
            g = pool[uidx]  # [B, per_block, unit, H, ...]
        else:
            g = pool.reshape(batch, per_page, *pool.shape[1:])
            g = lax.dynamic_slice_in_dim(g, j * per_block, per_block, axis=1)
        return jnp.swapaxes(g.reshape(batch, blk, *g.shape[3:]), 1, 2)

    def body(j, carry):
        m, l, acc = carry
        t0 = j * blk
        starts = t0 + jnp.arange(per_block, dtype=jnp.int32) * unit
        page = table[:, jnp.clip(starts // ps, 0, pps - 1)]  # [B, per_block]
        uidx = jnp.maximum(page, 0) * per_page + (starts % ps)[None, :] // unit
        tok = t0 + jnp.arange(blk, dtype=jnp.int32)
        present = tok[None, :] < hi[:, None]  # [B, T]: coded tokens (norms of the rest read as 0)
        if query.sinks:
            present &= (tok[None, :] < query.sink_lo[:, None]) | (tok[None, :] >= query.sinks)
        present = present[:, None, :]  # [B, 1, T]
        kn = jnp.where(present, gather(knorm, uidx, j).astype(jnp.float32), 0.0)  # [B, H, T]
        vn = jnp.where(present, gather(vnorm, uidx, j).astype(jnp.float32), 0.0)
        keys = _scoring.levels(gather(kpool, uidx, j), cfg.key_codec, len(query.parts))
        # q'.c per plane, then the norm: a [T] multiply, not a [T, D] one
        s = sum(lax.dot_general(qp, c, scores, precision=_HI) for qp, c in zip(query.parts, keys))
        s = s * kn[:, :, None, :]
        mask = _scoring.coded_mask(query, tok[None, None, :])[:, None]  # [B, 1, R, T]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no token seen yet
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1)
        pv = p * vn[:, :, None, :]
        vals = _scoring.levels(gather(vpool, uidx, j), cfg.value_codec, nv)
        acc = tuple(alpha[..., None] * a + lax.dot_general(pv, c, values, precision=_HI) for a, c in zip(acc, vals))
        return m_new, l, acc

    # The carry starts from the query (zeros_like keeps its sharding type: under shard_map
    # a fresh constant would be replicated while the loop's outputs vary by device).
    q0 = query.parts[0]
    zeros = jnp.broadcast_to(jnp.zeros_like(q0[..., :1]), q0.shape[:-1] + (dim // nv,))
    init_carry = (zeros[..., 0] - jnp.inf, zeros[..., 0], (zeros,) * nv)
    m, l, acc = lax.fori_loop(0, n_blocks, body, init_carry)
    return m, l, jnp.concatenate(acc, axis=-1)
