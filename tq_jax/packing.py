"""Bit-packing of codebook indices: an LSB-first bit stream, uint8/uint32 ops only.

Index ``i`` of a row occupies bits ``[i*bits, (i+1)*bits)`` of a little-endian bit
stream; a row of ``n`` indices packs to ``ceil(n*bits/8)`` bytes and the unused high
bits of the last byte are zero. This is the layout of ``tqai.packing`` (the TQ01
reference), for every width it supports (2, 3, 4, 6, 8), extended to 1..8.

Eight indices of ``bits`` bits always fill exactly ``bits`` bytes, so both directions
work on groups of 8: pad the row to whole groups, view it as ``(..., groups, 8)``,
and build each of the ``bits`` output bytes by OR-ing the shifted pieces of the (at
most two) indices that overlap it. The loops below run over those static positions
at trace time; XLA sees a handful of fused element-wise ops, never a loop over
elements, and never a uint64 (results do not depend on ``jax_enable_x64``).

Golden vectors (from the reference, also in tests/test_packing.py)::

    bits=2  [1, 2, 3, 0, 3]              -> [57, 3]
    bits=3  [1, 2, 3, 4, 5, 6, 7, 0, 5]  -> [209, 88, 31, 5]
    bits=4  [1, 2, 3]                    -> [33, 3]
    bits=6  [1, 63, 5, 33, 7]            -> [193, 95, 132, 7]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from typing import TYPE_CHECKING

from jax import lax

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, UInt8

__all__ = ["pack", "unpack", "packed_nbytes", "BITS_RANGE"]

BITS_RANGE = range(1, 9)
_GROUP = 8  # indices per group; a group packs into exactly `bits` bytes


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in BITS_RANGE:
        raise ValueError(
            f"`bits` must be an int in 1..8, got {bits!r}: bits sets the codebook "
            f"size 2**bits and the packed width of each index."
        )


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` indices of ``bits`` bits pack into: ``ceil(n*bits/8)``."""
    _check_bits(bits)
    n = int(n)
    if n < 0:
        raise ValueError(f"index count must be >= 0, got {n}")
    return (n * bits + 7) // 8


def _overlaps(bits: int):
    """Static (index position, byte position, shift) triples of one group.

    ``shift = i*bits - 8*j``: a positive shift moves index ``i`` left into byte
    ``j``; a negative one moves byte ``j``'s bits right onto index ``i``.
    """
    out = []
    for i in range(_GROUP):
        for j in range(bits):
            lo, hi = i * bits, (i + 1) * bits
            if lo < 8 * (j + 1) and hi > 8 * j:
                out.append((i, j, lo - 8 * j))
    return tuple(out)


def _shift(v, s: int):
    """``v << s`` for s >= 0, logical ``v >> -s`` otherwise (uint32 operands)."""
    if s >= 0:
        return lax.shift_left(v, jnp.uint32(s))
    return lax.shift_right_logical(v, jnp.uint32(-s))


@functools.partial(jax.jit, static_argnames="bits")
def pack(indices: UInt8[Array, "*batch n"], bits: int) -> UInt8[Array, "*batch nbytes"]:
    """Pack the last axis of ``indices`` into an LSB-first bit stream.

    Args:
        indices: uint8 array ``(..., n)``; each value must be below ``2**bits``
            (higher bits are masked off).
        bits: width of one index, 1..8 (static).

    Returns:
        uint8 array ``(..., ceil(n*bits/8))``.

    Examples:
        >>> import numpy as np
        >>> np.asarray(pack(np.array([1, 2, 3], np.uint8), bits=4)).tolist()
        [33, 3]
    """
    _check_bits(bits)
    indices = jnp.asarray(indices)
    if indices.ndim == 0:
        raise ValueError("pack needs at least a 1-D array of indices")
    *batch, n = indices.shape
    nbytes = (n * bits + 7) // 8
    if bits == 8:
        return indices.astype(jnp.uint8)
    groups = -(-n // _GROUP)
    pad = groups * _GROUP - n
    v = indices.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    if pad:
        v = jnp.pad(v, [(0, 0)] * len(batch) + [(0, pad)])
    v = v.reshape(*batch, groups, _GROUP)
    out = [None] * bits
    for i, j, s in _overlaps(bits):
        piece = _shift(v[..., i], s) & jnp.uint32(0xFF)
        out[j] = piece if out[j] is None else out[j] | piece
    packed = jnp.stack(out, axis=-1).astype(jnp.uint8).reshape(*batch, groups * bits)
    return packed[..., :nbytes]


@functools.partial(jax.jit, static_argnames=("bits", "n"))
def unpack(packed: UInt8[Array, "*batch nbytes"], bits: int, n: int) -> UInt8[Array, "*batch n"]:
    """Inverse of :func:`pack`: recover ``n`` indices from the last axis.

    Args:
        packed: uint8 array ``(..., nbytes)`` with ``nbytes >= ceil(n*bits/8)``
            (extra trailing bytes are ignored).
        bits: width of one index, 1..8 (static).
        n: number of indices per row (static).

    Returns:
        uint8 array ``(..., n)`` with values below ``2**bits``.

    Raises:
        ValueError: if the rows hold fewer than ``ceil(n*bits/8)`` bytes.
    """
    _check_bits(bits)
    packed = jnp.asarray(packed)
    *batch, have = packed.shape
    need = (n * bits + 7) // 8
    if have < need:
        raise ValueError(
            f"unpack: {n} indices of {bits} bits need {need} bytes per row, got {have}"
        )
    if bits == 8:
        return packed[..., :n].astype(jnp.uint8)
    groups = -(-n // _GROUP)
    v = packed[..., :need].astype(jnp.uint32)
    pad = groups * bits - need
    if pad:
        v = jnp.pad(v, [(0, 0)] * len(batch) + [(0, pad)])
    v = v.reshape(*batch, groups, bits)
    out = [None] * _GROUP
    for i, j, s in _overlaps(bits):
        piece = _shift(v[..., j], -s)
        out[i] = piece if out[i] is None else out[i] | piece
    mask = jnp.uint32((1 << bits) - 1)
    idx = (jnp.stack(out, axis=-1) & mask).astype(jnp.uint8).reshape(*batch, groups * _GROUP)
    return idx[..., :n]
