"""Decode attention over a :mod:`tq_jax.kvcache` cache as one Pallas kernel.

The kernel walks each sequence's pages once, as TPU paged attention does: the grid is
``(batch, units)`` (a unit is a page, or a block of ``block_tokens`` inside a large
page), the lengths and page table are scalar-prefetched (``PrefetchScalarGridSpec``), and
the code/norm blocks' index maps read the page table, so a step's pool rows arrive
already addressed. A step past the sequence's length maps to its last unit again (no new
copy) and computes nothing. In the step, the uint8 codes are unpacked by shifts into
planar index planes and looked up in the codebook by a select tree on the index bits
(``2**bits - 1`` selects, no gather: element-wise on every backend), then scored per plane
against the planar query slices; the online-softmax state (running max, sum and the
rotated-domain accumulator) lives in the output blocks, which stay resident across a
sequence's units. The rotation of the queries and the final divide/un-rotation are XLA
ops around the call (once per query), shared with the XLA path.

Status: verified in ``interpret=True`` mode on CPU against the same dense references as
the XLA path (``tests/test_kvcache.py``); never compiled for or timed on an accelerator,
which is why :func:`tq_jax.kvcache.attend` keeps ``impl="xla"`` as its default everywhere.
A TPU build may need the block shapes padded to its (8, 128) tiling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tq_jax import codec as _codec
from tq_jax.kvcache import scoring as _scoring
from tq_jax.kvcache.state import CacheConfig, KVCache

_HI = lax.Precision.HIGHEST


def _select_lookup(idx, centroids: np.ndarray, bits: int):
    """``centroids[idx]`` by a binary select tree on the bits of ``idx`` (uint8):
    level ``b`` picks between pairs by bit ``b``; the table is compile-time constants."""
    vals = [np.float32(c) for c in centroids]
    for b in range(bits):
        on = (idx & np.uint8(1 << b)) != 0
        vals = [jnp.where(on, vals[2 * i + 1], vals[2 * i]) for i in range(len(vals) // 2)]
    return vals[0]


def _kernel(
    lengths_ref, hi_ref, sink_lo_ref, table_ref, *refs, cfg: CacheConfig, unit: int, q_len: int, nk: int, nv: int,
    kc, vc, dim: int, sliding: int | None = None
):
    """One unit of one sequence. Refs (after the two scalar-prefetch ones): the ``nk``
    planar query slices ``[H, R, D/nk]``, codes ``[unit, H, rk]``, norms ``[unit, H]``
    (K, then V), then the outputs m, l ``[H, R]`` and ``nv`` accumulators ``[H, R, D/nv]``."""
    q_refs, (kc_ref, kn_ref, vc_ref, vn_ref, m_ref, l_ref), acc_refs = refs[:nk], refs[nk : nk + 6], refs[nk + 6 :]
    b, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        for a in acc_refs:
            a[...] = jnp.zeros(a.shape, jnp.float32)

    length, hi, sink_lo = lengths_ref[b], hi_ref[b], sink_lo_ref[b]
    t0 = j * unit

    def coded(tok):  # scoring.coded_mask without the causal part
        keep = tok < hi
        if cfg.sinks:
            keep &= (tok < sink_lo) | (tok >= cfg.sinks)
        return keep

    @pl.when(t0 < hi)
    def _step():
        rows = m_ref.shape[1]
        tok = t0 + lax.broadcasted_iota(jnp.int32, (rows, unit), 1)
        last = length - q_len + lax.broadcasted_iota(jnp.int32, (rows, unit), 0) % q_len
        mask = ((tok <= last) & coded(tok))[None]  # [1, R, unit]
        if sliding:  # a sliding window: nothing at or below last - W
            mask &= (tok > last - sliding)[None]
        present = coded(t0 + lax.broadcasted_iota(jnp.int32, (unit, 1), 0))  # [unit, 1]
        kn = jnp.where(present, kn_ref[...].astype(jnp.float32), 0.0).T  # [H, unit]
        vn = jnp.where(present, vn_ref[...].astype(jnp.float32), 0.0).T
        kidx = _scoring.planes(kc_ref[...], cfg.key_bits, dim, nk)  # [unit, H, D/nk] each
        s = sum(
            jnp.einsum("hrd,thd->hrt", qr[...], _select_lookup(ip, kc, cfg.key_bits), precision=_HI)
            for qr, ip in zip(q_refs, kidx)
        )
        s = jnp.where(mask, s * kn[:, None, :], -jnp.inf)
        m = m_ref[...]
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1)
        m_ref[...] = m_new
        pv = p * vn[:, None, :]
        for a, ip in zip(acc_refs, _scoring.planes(vc_ref[...], cfg.value_bits, dim, nv)):
            cv = _select_lookup(ip, vc, cfg.value_bits)
            a[...] = alpha[..., None] * a[...] + jnp.einsum("hrt,thd->hrd", pv, cv, precision=_HI)


def partial(cache: KVCache, query: _scoring.Query, *, interpret: bool):
    """The coded part of :func:`tq_jax.kvcache.attend` in one Pallas kernel:
    ``(m, l, acc)`` as :func:`tq_jax.kvcache.xla.partial` returns them (traceable;
    shapes checked by the caller)."""
    cfg = cache.config
    batch, dim = cache.lengths.shape[0], cfg.head_dim
    heads = cache.k_codes.shape[2]
    rows, nk, nv = query.rows, len(query.parts), _scoring.parts(cfg.value_bits)
    ps = cfg.page_tokens
    unit = min(ps, cfg.block_tokens)
    per_page = ps // unit
    n_units = cfg.num_pages * per_page
    pps = cache.page_table.shape[1]
    units = pps * per_page  # grid steps per sequence

    def block(hi, table, b, j):
        """Pool unit of step ``j`` of sequence ``b``; steps past the coded tokens repeat the last."""
        j = jnp.minimum(j, jnp.maximum((hi[b] + unit - 1) // unit - 1, 0))
        page = jnp.maximum(table[b, j // per_page], 0)
        return page * per_page + j % per_page

    pool = lambda a: a.reshape(n_units, unit, *a.shape[2:])  # noqa: E731
    kc, vc = _codec.tables(cfg.key_codec).centroids, _codec.tables(cfg.value_codec).centroids
    rk, rv = cache.k_codes.shape[3], cache.v_codes.shape[3]
    per_seq = lambda *shape: pl.BlockSpec((None, *shape), lambda b, j, n, h, s, t: (b,) + (0,) * len(shape))  # noqa: E731
    in_specs = [per_seq(heads, rows, dim // nk) for _ in range(nk)] + [
        pl.BlockSpec((None, unit, heads, rk), lambda b, j, n, h, s, t: (block(h, t, b, j), 0, 0, 0)),
        pl.BlockSpec((None, unit, heads), lambda b, j, n, h, s, t: (block(h, t, b, j), 0, 0)),
        pl.BlockSpec((None, unit, heads, rv), lambda b, j, n, h, s, t: (block(h, t, b, j), 0, 0, 0)),
        pl.BlockSpec((None, unit, heads), lambda b, j, n, h, s, t: (block(h, t, b, j), 0, 0)),
    ]
    out_specs = [per_seq(heads, rows), per_seq(heads, rows)] + [per_seq(heads, rows, dim // nv) for _ in range(nv)]
    out_shape = [jax.ShapeDtypeStruct((batch, heads, rows), jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct((batch, heads, rows, dim // nv), jnp.float32)
    ] * nv
    kernel = functools.partial(_kernel, cfg=cfg, unit=unit, q_len=query.q_len, nk=nk, nv=nv, kc=kc, vc=vc, dim=dim,
                               sliding=query.sliding_window)
    m, l, *acc = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(batch, units), in_specs=in_specs, out_specs=out_specs
        ),
        out_shape=out_shape,
        interpret=interpret,
    )(
        cache.lengths,
        query.hi,
        query.sink_lo,
        cache.page_table,
        *query.parts,
        pool(cache.k_codes),
        pool(cache.k_norms),
        pool(cache.v_codes),
        pool(cache.v_norms),
    )
    return m, l, jnp.concatenate(acc, axis=-1)
