"""What every attention kernel over the codes shares: planar unpacking of code rows,
the rotated query, and the final divide and un-rotation.

The codes are unpacked into planar order (lane ``i`` of every byte group side by side,
:func:`tq_jax._src.packing.plane_order`), with the rotated query permuted to match, so no
interleave is ever built.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import jax.numpy as jnp
import numpy as np

from tq_jax._src import codec as _codec
from tq_jax._src import packing as _packing
from tq_jax._src import trellis as _trellis
from tq_jax._src.kvcache.state import KVCache

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Int32

__all__ = ["planes", "levels", "parts", "lanes_tile", "lookup", "centroid_norms", "Query", "query", "coded_end", "coded_mask", "finish"]


def planes(codes, bits: int, dim: int, parts: int) -> list:
    """Code rows ``(..., dim*bits/8)`` (uint8, or int32 widened from it) -> ``parts`` index
    arrays ``(..., dim/parts)`` of that dtype that together hold the ``dim`` indices in
    planar order (:func:`tq_jax._src.packing.plane_order`: lane 0 of every group, then lane 1, ...).

    Lane ``i`` of a group of ``G = plane_count(bits)`` indices starts at bit ``i*bits`` of
    the group's bytes (LSB first) and spans at most two bytes; it is shifted out of them
    in the rows' dtype, so the unpacking stays one element-wise pass with no interleave. Part ``p``
    is lanes ``p*G/parts ...`` side by side.
    """
    return _split(_lanes(codes, bits, dim), parts)


def _lanes(codes, bits: int, dim: int) -> list:
    """The ``G = plane_count(bits)`` lanes of code rows, each ``(..., dim/G)``."""
    g = _packing.plane_count(bits)
    per_group = g * bits // 8
    if per_group == 1:  # a group is one byte: no reshape (a TPU kernel would pay a relayout for it)
        byte = lambda j: codes  # noqa: E731
    else:
        v = codes.reshape(*codes.shape[:-1], dim // g, per_group)
        byte = lambda j: v[..., j]  # noqa: E731
    lanes = []
    for i in range(g):
        first, shift = divmod(i * bits, 8)
        x = byte(first) >> np.uint8(shift) if shift else byte(first)
        if shift + bits > 8:  # the lane runs into the next byte
            x = x | (byte(first + 1) << np.uint8(8 - shift))
        lanes.append(x & np.uint8((1 << bits) - 1) if bits < 8 else x)
    return lanes


def _split(lanes: list, parts: int) -> list:
    """Lanes side by side in ``parts`` contiguous slices of the planar order."""
    k = len(lanes) // parts
    return [lanes[p * k] if k == 1 else jnp.concatenate(lanes[p * k : (p + 1) * k], axis=-1) for p in range(parts)]


def levels(codes, config: _codec.CodecConfig, parts: int) -> list:
    """The float32 levels code rows ``(..., row)`` stand for, in planar order, as ``parts``
    arrays (:func:`planes`' split): ``centroids[idx]``, or with ``config.trellis`` each
    coordinate's trellis level, read in the state its three previous coordinates' branch
    bits give (:mod:`tq_jax._src.trellis`). In planar order coordinate ``j*G + i`` is lane
    ``i`` of group ``j``, so coordinate ``t - k`` is a lane to the left, or lane
    ``(i - k) mod G`` of an earlier group: a shift along the groups, never an interleave."""
    bits, dim = config.bits, config.dim
    if not config.trellis:
        table = _codec.device_tables(config).centroids
        return [lookup(table, ip) for ip in planes(codes, bits, dim, parts)]
    lanes = _lanes(codes, bits, dim)
    g, n = len(lanes), dim // len(lanes)
    branch = [(lane & 1).astype(jnp.int32) for lane in lanes]

    def before(i: int, k: int):  # the branch bits of coordinates t - k, for the t of lane i
        back = -((i - k) // g)  # groups to the left
        b = branch[(i - k) % g]
        if back:
            b = jnp.pad(b, [(0, 0)] * (b.ndim - 1) + [(back, 0)])[..., :n]
        return b

    table = jnp.asarray(_trellis.decode_table(dim, bits))
    out = []
    for i, lane in enumerate(lanes):
        state = before(i, 1) | (before(i, 2) << 1) | (before(i, 3) << 2)
        out.append(lookup(table, (state << bits) | lane.astype(jnp.int32)))
    return _split(out, parts)


def parts(bits: int) -> int:
    """How many planar parts :func:`attend` keeps apart (one lookup and one dot each):
    two when a group holds two or more lanes, else one. Each part is a contiguous slice of
    the planar order, so the unpacked lanes are never concatenated into one index tensor
    (docs/kvcache.md has the measured effect)."""
    return min(_packing.plane_count(bits), 2)


def lanes_tile(cfg) -> bool:
    """Whether each lane of the planar order (``head_dim / plane_count(bits)`` indices)
    is a power of two for both widths: what Triton's tiles need
    (:mod:`tq_jax._src.kvcache.pallas_gpu`)."""
    widths = [cfg.head_dim // _packing.plane_count(b) for b in (cfg.key_bits, cfg.value_bits)]
    return all(w & (w - 1) == 0 for w in widths)


def lookup(centroids, idx):
    """``centroids[idx]`` for integer indices below the table's length."""
    return centroids.at[idx.astype(jnp.uint32)].get(mode="promise_in_bounds")


def centroid_norms(codes, config: _codec.CodecConfig):
    """float32 ``|c|`` of each stored centroid vector (code rows ``(..., row)``): the
    rotation keeps lengths, so it is the root of the summed squared centroids of the
    row's indices (no rotation, no ``(..., dim)`` float tensor beyond one plane)."""
    n = parts(config.bits)
    if config.trellis:
        return jnp.sqrt(sum(jnp.sum(jnp.square(c), axis=-1) for c in levels(codes, config, n)))
    squares = jnp.square(jnp.asarray(_codec.device_tables(config).centroids, jnp.float32))
    total = sum(jnp.sum(lookup(squares, ip), axis=-1) for ip in planes(codes, config.bits, config.dim, n))
    return jnp.sqrt(total)


class Query(NamedTuple):
    """What every attention kernel reads: the queries rotated, scaled and in planar
    order, and which tokens each row may score from codes.

    Token ``t`` of sequence ``b`` is read from codes by row ``r`` iff ``t <= last[b, r]``
    (causal), ``t < hi[b]`` (older than the exact window), ``t < sink_lo[b] or
    t >= sinks`` (not an exact sink) and, with a ``sliding_window`` ``W``, ``t > last[b, r]
    - W``; the rest of what a row sees is exact
    (:mod:`tq_jax._src.kvcache.exact`).
    """

    parts: tuple  # key planes' query slices, float32 (B, H, G*Q, D/parts_k) each
    last: "Int32[Array, 'B GQ']"  # the last position row r of sequence b sees
    rows: int  # G*Q; row r = g*q_len + i (query head h*G + g, query i)
    hi: "Int32[Array, ' B']"  # tokens at and after it are exact (the window)
    sink_lo: "Int32[Array, ' B']"  # sinks from here up to config.sinks are exact
    sinks: int  # config.sinks
    q_len: int  # queries per sequence
    sliding_window: int | None = None  # a row sees no position at or below last - sliding_window


def coded_end(cache: KVCache):
    """int32 ``[B]``: where each sequence's exact window starts; tokens before it (and
    not exact sinks) are read from codes."""
    cfg = cache.config
    if not cfg.window:
        return cache.lengths
    return jnp.clip(jnp.maximum(cache.lengths - cfg.window, cache.exact_from), 0, cache.lengths)


def query(cache: KVCache, q) -> Query:
    cfg = cache.config
    batch, q_len, q_heads, dim = q.shape
    heads = cache.k_codes.shape[2]  # local heads under shard_map
    group = q_heads // heads
    ktab = _codec.device_tables(cfg.key_codec)
    qf = q.astype(jnp.float32).reshape(batch, q_len, heads, group, dim)
    qr = _codec.rotate(qf, ktab.rotation) * np.float32(1.0 / math.sqrt(dim))  # q' = R q / sqrt(d)
    qr = qr[..., _packing.plane_order(dim, cfg.key_bits)]  # planar, like the unpacked codes
    qr = qr.transpose(0, 2, 3, 1, 4).reshape(batch, heads, group * q_len, dim)
    n = parts(cfg.key_bits)
    slices = tuple(qr[..., p * dim // n : (p + 1) * dim // n] for p in range(n))
    pos = jnp.tile(jnp.arange(q_len, dtype=jnp.int32), group)
    last = cache.lengths[:, None] - q_len + pos[None, :]
    sink_lo = cache.exact_from if cfg.sinks else cache.lengths
    return Query(slices, last, group * q_len, coded_end(cache), sink_lo, cfg.sinks, q_len)


def coded_mask(query: Query, tok, b=None):
    """Whether row ``r`` scores token ``tok`` from codes. ``tok`` broadcasts against
    ``[B, R, T]`` (or, with ``b`` a sequence index, ``[R, T]``)."""
    sel = (lambda a: a[b]) if b is not None else (lambda a: a)
    last, hi, lo = sel(query.last), sel(query.hi), sel(query.sink_lo)
    rows = (lambda a: a[:, :, None]) if b is None else (lambda a: a[:, None])
    if b is None:
        hi, lo = hi[:, None, None], lo[:, None, None]
    mask = (tok <= rows(last)) & (tok < hi)
    if query.sinks:
        mask &= (tok < lo) | (tok >= query.sinks)
    if query.sliding_window:
        mask &= tok > rows(last) - query.sliding_window
    return mask


def finish(cache: KVCache, q, acc, l, m=None, exact=None):
    """Output ``[B, Q, q_heads, D]`` from the coded part's accumulator (planar value
    order, rotated domain), softmax sum and running max: back to natural order,
    un-rotated once, merged with the exact part's ``(m, l, acc)`` (natural order) when
    given, and divided by the total sum. A query that sees no token gives zeros."""
    cfg = cache.config
    batch, q_len, q_heads, dim = q.shape
    heads = acc.shape[1]
    vtab = _codec.device_tables(cfg.value_codec)
    out = acc[..., np.argsort(_packing.plane_order(dim, cfg.value_bits))]
    out = _codec.unrotate(out, vtab.rotation)  # once per query, value rotation
    if exact is not None:
        m2, l2, acc2 = exact
        top = jnp.maximum(m, m2)
        top = jnp.where(top == -jnp.inf, 0.0, top)  # neither part has a token yet
        a1, a2 = jnp.exp(m - top), jnp.exp(m2 - top)
        out = a1[..., None] * out + a2[..., None] * acc2
        l = a1 * l + a2 * l2
    out = out / jnp.where(l == 0, 1.0, l)[..., None]
    out = out.reshape(batch, heads, q_heads // heads, q_len, dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, q_heads, dim).astype(q.dtype)
