"""The TurboQuant codec: norm → rotation → Lloyd–Max indices → packed rows, and back.

Encode, per vector ``x`` of length ``d`` (computed in float32, as the reference does):

1. ``n = ||x||₂`` and ``u = x / (n + 1e-10)``;
2. ``y = u @ Q.T`` with the seeded Haar rotation ``Q`` (:mod:`tq_jax.rotation`);
3. ``idx_j`` = the number of Lloyd–Max decision boundaries strictly below ``y_j``
   (:mod:`tq_jax.codebook`) — the nearest centroid, found by comparing against the
   boundaries, never by building a ``(…, d, 2**bits)`` distance tensor;
4. indices are bit-packed per vector (:mod:`tq_jax.packing`).

Decode: ``x̂ = (c[idx] @ Q) · n``, cast to the requested dtype.

Everything here is a pure function of arrays and a small frozen :class:`CodecConfig`,
so :func:`encode` and :func:`decode` can be called inside a user's own ``jit``,
``vmap`` or sharded computation. The wire format (:mod:`tq_jax.wire`) drives the same
private kernels block by block.

References:
    Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal
    Distortion Rate", arXiv:2504.19874 (2025).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax import codebook as _codebook
from tq_jax import packing as _packing
from tq_jax import rotation as _rotation

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float, Float32, UInt8

__all__ = ["CodecConfig", "Encoded", "encode", "decode", "FLOAT_DTYPES"]

NORM_EPS = 1e-10  # the reference's guard in u = x / (n + eps)
FLOAT_DTYPES = ("bfloat16", "float16", "float32")

# Widths up to this many bits quantize by summing comparisons against every
# boundary (2**bits - 1 fused compares); wider codebooks use a uniform grid over
# the boundary range that narrows each coordinate to one candidate boundary.
_COMPARE_ALL_MAX_BITS = 4
_GRID_CELLS_PER_LEVEL = 4


@dataclasses.dataclass(frozen=True)
class CodecConfig:
    """What a codec needs besides the data: head dimension, bit width, rotation seed.

    Attributes:
        dim: vector length (head_dim), >= 2.
        bits: bits per coordinate, 1..8 (the codebook has ``2**bits`` levels).
        seed: rotation seed; like torch's generator only its low 32 bits matter.
    """

    dim: int
    bits: int
    seed: int = 42

    def __post_init__(self):
        if not isinstance(self.dim, (int, np.integer)) or isinstance(self.dim, bool) or self.dim < 2:
            raise ValueError(
                f"`dim` must be an int >= 2, got {self.dim!r}: it is the length of each "
                f"vector (head_dim), the last axis of the input."
            )
        if not isinstance(self.bits, (int, np.integer)) or isinstance(self.bits, bool) or not 1 <= self.bits <= 8:
            raise ValueError(
                f"`bits` must be an int in 1..8, got {self.bits!r}: bits sets the "
                f"codebook size 2**bits."
            )
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise ValueError(f"`seed` must be an int, got {self.seed!r}.")
        object.__setattr__(self, "dim", int(self.dim))
        object.__setattr__(self, "bits", int(self.bits))
        object.__setattr__(self, "seed", int(self.seed))

    @property
    def row_nbytes(self) -> int:
        """Bytes of one packed vector: ``ceil(dim * bits / 8)``."""
        return _packing.packed_nbytes(self.dim, self.bits)


class Encoded(NamedTuple):
    """A batch of encoded vectors (a pytree: usable across ``jit``/``vmap``).

    Attributes:
        packed: uint8 ``(*batch, ceil(dim*bits/8))``, each row an LSB-first bit stream.
            When ``dim*bits % 8 == 0`` the rows concatenated are the TQ01 index section.
        norms: float32 ``(*batch,)`` L2 norms. The v1 wire format stores them as
            float16; :func:`decode` accepts either.
    """

    packed: "UInt8[Array, '*batch row_nbytes']"
    norms: "Float32[Array, '*batch']"


class _Tables(NamedTuple):
    """Host (numpy) arrays a codec closes over; built once per config."""

    rotation: np.ndarray  # float32 (dim, dim)
    centroids: np.ndarray  # float32 (2**bits,)
    boundaries: np.ndarray  # float32 (2**bits - 1,)
    grid: tuple | None  # (lo, inv_width, start int32 (M,), bound float32 (M,)) for bits > 4


def _search_grid(boundaries: np.ndarray):
    """A uniform grid over ``[b_0, b_last]`` where each cell meets at most one boundary.

    For cell ``t`` (widened by half a cell on each side, which absorbs float32
    rounding of the cell computation) ``start[t]`` counts the boundaries below it and
    ``bound[t]`` is the single boundary inside it (``+inf`` when there is none), so
    ``idx = start[t] + (y > bound[t])`` equals the exact count of boundaries below
    ``y``. The cell count doubles until that single-boundary property holds.
    """
    b = boundaries.astype(np.float64)
    lo, hi = float(b[0]), float(b[-1])
    cells = _GRID_CELLS_PER_LEVEL * (len(b) + 1)
    while True:
        width = (hi - lo) / cells
        left = lo + np.arange(cells) * width
        start = np.searchsorted(b, left - width / 2, side="left")
        end = np.searchsorted(b, left + 1.5 * width, side="right")
        if (end - start).max() <= 1:
            break
        cells *= 2
    padded = np.append(boundaries.astype(np.float32), np.float32(np.inf))
    return (
        np.float32(lo),
        np.float32(1.0 / width),
        start.astype(np.int32),
        padded[start],
    )


@functools.lru_cache(maxsize=64)
def _tables(dim: int, bits: int, seed: int) -> _Tables:
    cb = _codebook.lloyd_max(dim, bits)
    grid = _search_grid(cb.boundaries) if bits > _COMPARE_ALL_MAX_BITS else None
    return _Tables(_rotation.haar_rotation(dim, seed), cb.centroids, cb.boundaries, grid)


def tables(config: CodecConfig) -> _Tables:
    """The rotation and codebook arrays of ``config`` (cached, read-only numpy)."""
    return _tables(config.dim, config.bits, config.seed)


_device_cache: dict = {}
_device_lock = threading.Lock()


def device_tables(config: CodecConfig, device=None):
    """``tables(config)`` as committed device arrays, transferred once per device."""
    key = (config.dim, config.bits, config.seed, device)
    hit = _device_cache.get(key)
    if hit is None:
        t = tables(config)
        put = functools.partial(jax.device_put, device=device)
        grid = None
        if t.grid is not None:
            grid = tuple(put(np.asarray(a)) for a in t.grid)
        hit = (put(t.rotation), put(t.centroids), put(t.boundaries), grid)
        with _device_lock:
            _device_cache.setdefault(key, hit)
            hit = _device_cache[key]
    return hit


# --------------------------------------------------------------------------- kernels


def _quantize(y, boundaries, grid):
    """Index of the nearest centroid = number of boundaries strictly below ``y``."""
    if grid is None:
        idx = jnp.zeros(y.shape, jnp.uint8)
        for k in range(boundaries.shape[0]):
            idx = idx + (y > boundaries[k]).astype(jnp.uint8)
        return idx
    lo, inv_width, start, bound = grid
    cells = start.shape[0]
    # Non-finite coordinates (from a non-finite vector) take cell 0; their norm
    # carries the non-finiteness through decode.
    pos = jnp.where(jnp.isfinite(y), (y - lo) * inv_width, 0.0)
    t = jnp.clip(pos, 0, cells - 1).astype(jnp.int32)
    s = jnp.take(start, t, mode="clip")
    b = jnp.take(bound, t, mode="clip")
    return (s + (y > b).astype(jnp.int32)).astype(jnp.uint8)


def _norms_and_rotate(x, rotation):
    xf = x.astype(jnp.float32)
    norms = jnp.sqrt(jnp.sum(xf * xf, axis=-1))
    u = xf / (norms + NORM_EPS)[..., None]
    y = jnp.matmul(u, rotation.T, precision=jax.lax.Precision.HIGHEST)
    return y, norms


def encode_indices(x, rotation, boundaries, grid):
    """Unpacked uint8 indices ``(..., d)`` and float32 norms ``(...)`` of ``x``."""
    y, norms = _norms_and_rotate(x, rotation)
    return _quantize(y, boundaries, grid), norms


def decode_indices(indices, norms, rotation, centroids, dtype, qjl=None):
    """Reconstruct ``(..., d)`` vectors of ``dtype`` from uint8 indices and norms.

    ``qjl`` is ``(sketch int8 (..., m), residual_norms (...), matrix (m, d))`` for
    blobs written with the QJL residual (TQ01 read compatibility only).
    """
    y_hat = jnp.take(centroids, indices.astype(jnp.int32), mode="clip")
    if qjl is not None:
        sketch, residual_norms, matrix = qjl
        m = matrix.shape[0]
        corr = jnp.matmul(sketch.astype(jnp.float32), matrix, precision=jax.lax.Precision.HIGHEST)
        scale = residual_norms.astype(jnp.float32) * np.float32(math.sqrt(math.pi / (2 * m)))
        y_hat = y_hat + corr * scale[..., None]
    x_hat = jnp.matmul(y_hat, rotation, precision=jax.lax.Precision.HIGHEST)
    return (x_hat * norms.astype(jnp.float32)[..., None]).astype(dtype)


@functools.partial(jax.jit, static_argnames="bits")
def _encode(x, rotation, boundaries, grid, *, bits):
    idx, norms = encode_indices(x, rotation, boundaries, grid)
    return Encoded(_packing.pack(idx, bits), norms)


@functools.partial(jax.jit, static_argnames=("bits", "dtype"))
def _decode(packed, norms, rotation, centroids, *, bits, dtype):
    idx = _packing.unpack(packed, bits, rotation.shape[0])
    return decode_indices(idx, norms, rotation, centroids, dtype)


# --------------------------------------------------------------------------- public


def _check_input(x, config: CodecConfig):
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if x.ndim < 1 or x.shape[-1] != config.dim:
        raise ValueError(
            f"input's last axis must be dim={config.dim} (one vector per row), got "
            f"shape {tuple(x.shape)}: reshape so that head_dim is the last axis."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"input dtype must be floating (bfloat16, float16 or float32), got {x.dtype}."
        )
    return x


def encode(x: "Float[Array, '*batch dim']", config: CodecConfig) -> Encoded:
    """Quantize vectors along the last axis.

    Args:
        x: floating array ``(*batch, dim)`` (bfloat16, float16 or float32).
        config: the codec's :class:`CodecConfig`.

    Returns:
        :class:`Encoded` with ``packed`` uint8 ``(*batch, config.row_nbytes)`` and
        ``norms`` float32 ``(*batch,)``.

    Raises:
        ValueError: if the last axis is not ``config.dim`` or ``x`` is not floating.

    Examples:
        >>> import jax.numpy as jnp
        >>> cfg = CodecConfig(dim=64, bits=4)
        >>> enc = encode(jnp.ones((3, 64)), cfg)
        >>> enc.packed.shape, enc.norms.shape
        ((3, 32), (3,))
    """
    x = _check_input(x, config)
    rot, _, bnd, grid = _as_arrays(config)
    return _encode(x, rot, bnd, grid, bits=config.bits)


def decode(encoded: Encoded, config: CodecConfig, dtype=jnp.float32) -> "Float[Array, '*batch dim']":
    """Reconstruct vectors from :func:`encode`'s output.

    Args:
        encoded: :class:`Encoded` (``norms`` may be float16 or float32).
        config: the :class:`CodecConfig` used to encode.
        dtype: output dtype (any float dtype).

    Returns:
        array ``(*batch, dim)`` of ``dtype``.
    """
    packed, norms = encoded
    packed = jnp.asarray(packed)
    if packed.shape[-1] != config.row_nbytes or packed.shape[:-1] != jnp.shape(norms):
        raise ValueError(
            f"encoded rows must be (*batch, {config.row_nbytes}) with norms (*batch,) for "
            f"dim={config.dim}, bits={config.bits}; got packed {tuple(packed.shape)} and "
            f"norms {tuple(jnp.shape(norms))}."
        )
    rot, cen, _, _ = _as_arrays(config)
    return _decode(packed, norms, rot, cen, bits=config.bits, dtype=jnp.dtype(dtype))


def _as_arrays(config: CodecConfig):
    t = tables(config)
    grid = None if t.grid is None else tuple(jnp.asarray(a) for a in t.grid)
    return jnp.asarray(t.rotation), jnp.asarray(t.centroids), jnp.asarray(t.boundaries), grid
