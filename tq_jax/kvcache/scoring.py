"""What every attention kernel over the codes shares: planar unpacking of code rows,
the rotated query, and the final divide and un-rotation.

The codes are unpacked into planar order (lane ``i`` of every byte group side by side,
:func:`tq_jax.packing.plane_order`), with the rotated query permuted to match, so no
interleave is ever built.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import jax.numpy as jnp
import numpy as np

from tq_jax import codec as _codec
from tq_jax import packing as _packing
from tq_jax.kvcache.state import KVCache

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Int32

__all__ = ["planes", "parts", "lookup", "Query", "query", "finish"]


def planes(codes, bits: int, dim: int, parts: int) -> list:
    """uint8 rows ``(..., dim*bits/8)`` -> ``parts`` uint8 index arrays ``(..., dim/parts)``
    that together hold the ``dim`` indices in planar order (:func:`tq_jax.packing.plane_order`:
    lane 0 of every group, then lane 1, ...).

    Lane ``i`` of a group of ``G = plane_count(bits)`` indices starts at bit ``i*bits`` of
    the group's bytes (LSB first) and spans at most two bytes; it is shifted out of them
    in uint8, so the unpacking stays one element-wise pass with no interleave. Part ``p``
    is lanes ``p*G/parts ...`` side by side.
    """
    g = _packing.plane_count(bits)
    per_group = g * bits // 8
    v = codes.reshape(*codes.shape[:-1], dim // g, per_group)
    lanes = []
    for i in range(g):
        first, shift = divmod(i * bits, 8)
        x = v[..., first] >> np.uint8(shift) if shift else v[..., first]
        if shift + bits > 8:  # the lane runs into the next byte
            x = x | (v[..., first + 1] << np.uint8(8 - shift))
        lanes.append(x & np.uint8((1 << bits) - 1) if bits < 8 else x)
    k = g // parts
    return [lanes[p * k] if k == 1 else jnp.concatenate(lanes[p * k : (p + 1) * k], axis=-1) for p in range(parts)]


def parts(bits: int) -> int:
    """How many planar parts :func:`attend` keeps apart (one lookup and one dot each):
    two when a group holds two or more lanes, else one. Each part is a contiguous slice of
    the planar order, so the unpacked lanes are never concatenated into one index tensor
    (docs/kvcache.md has the measured effect)."""
    return min(_packing.plane_count(bits), 2)


def lookup(centroids, idx):
    """``centroids[idx]`` for uint8 indices below the table's length."""
    return centroids.at[idx.astype(jnp.uint32)].get(mode="promise_in_bounds")


class Query(NamedTuple):
    """What both attention kernels read: the queries rotated, scaled and in planar order."""

    parts: tuple  # key planes' query slices, float32 (B, H, G*Q, D/parts_k) each
    last: "Int32[Array, 'B GQ']"  # the last position row r of sequence b sees
    rows: int  # G*Q; row r = g*q_len + i (query head h*G + g, query i)


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
    return Query(slices, last, group * q_len)


def finish(cache: KVCache, q, acc, l):
    """Output ``[B, Q, q_heads, D]`` from the accumulator (planar value order, rotated
    domain) and the softmax sum: divide, back to natural order, un-rotate once."""
    cfg = cache.config
    batch, q_len, q_heads, dim = q.shape
    heads = acc.shape[1]
    vtab = _codec.device_tables(cfg.value_codec)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # a query that sees no token: zeros
    out = out[..., np.argsort(_packing.plane_order(dim, cfg.value_bits))]
    out = _codec.unrotate(out, vtab.rotation)  # once per query, value rotation
    out = out.reshape(batch, heads, q_heads // heads, q_len, dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, q_heads, dim).astype(q.dtype)

