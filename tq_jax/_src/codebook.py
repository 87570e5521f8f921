"""Lloyd–Max scalar codebooks for the rotated coordinates of a unit vector.

After a Haar rotation every coordinate of a unit vector in R^d follows (close to)
N(0, 1/d). TurboQuant quantizes each coordinate with the Lloyd–Max quantizer of that
Gaussian: ``2**bits`` centroids (reconstruction levels) and ``2**bits - 1`` decision
boundaries, each boundary the midpoint of its two neighbouring centroids.

The solver is the reference's (``tqai.codebook.lloyd_max.solve_lloyd_max``, which
``tqai.codebook.solvers.solve_codebook(solver="lloyd_max")`` calls and which produced
the tables ``tqai`` ships), step for step, with its numerical integrals replaced by
the Gaussian's closed forms. Writing ``s = 1/sqrt(d)``, ``α = a/s``, ``β = b/s`` and
``φ``, ``Φ`` for the standard normal pdf and cdf, a cell ``(a, b)`` has

* probability   ``P = Φ(β) - Φ(α)``
* first moment  ``M1 = s (φ(α) - φ(β))``, so ``E[X | a < X < b] = M1 / P``
* second moment ``M2 = s² (P + α φ(α) - β φ(β))``

and the distortion of centroid ``c`` on it is ``M2 - 2 c M1 + c² P``. Tail cell
probabilities are differences of ``erfc`` values (never ``1 - erf``) so that they keep
full relative precision far from the origin.

Iteration (as the reference does it): boundaries start uniformly spaced over
``[-4s, 4s]``; each round sets every centroid to its cell's conditional mean, then
every boundary to the midpoint of its neighbours, then computes the distortion; it
stops after 200 rounds or once the distortion changes by less than ``1e-12``. At 4, 6
and 8 bits that budget runs out before convergence, so the tables are *not* the fully
converged optimum — but they are what the reference encodes with, and reproducing
them exactly is what keeps our bytes interchangeable with its bytes.

Everything is numpy float64 (``math.erfc`` per boundary; no scipy, no quadrature);
results are returned as float32, like the reference's tables.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import NamedTuple

import numpy as np

from tq_jax._src import _lru

__all__ = ["Codebook", "lloyd_max", "expected_mse", "BITS_RANGE", "MIN_DIM", "CACHES", "cache_stats", "clear_caches"]

BITS_RANGE = range(1, 9)
MIN_DIM = 2

# The reference solver's schedule (tqai.codebook.lloyd_max.solve_lloyd_max defaults).
_MAX_ITER = 200
_TOL = 1e-12
_INIT_SPAN = 4.0  # initial boundaries are uniform over [-4 sigma, 4 sigma]
_TINY_CELL = 1e-30  # the reference falls back to the cell midpoint below this mass

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

_BITS_ERROR = (
    "`bits` must be an int in 1..8, got {!r}: bits sets the codebook size 2**bits "
    "(and the packed width of each index). Pass an integer between 1 and 8."
)
_DIM_ERROR = (
    "`dim` must be an int >= 2, got {!r}: dim is the head dimension d, and each "
    "rotated coordinate is modelled as N(0, 1/d). Pass the vectors' last-axis length."
)


class Codebook(NamedTuple):
    """A scalar quantizer: sorted centroids and the midpoints between them.

    Attributes:
        centroids: float32 ``(2**bits,)``, strictly increasing, read-only.
        boundaries: float32 ``(2**bits - 1,)``, ``boundaries[k]`` is the midpoint of
            ``centroids[k]`` and ``centroids[k + 1]``; read-only.
    """

    centroids: np.ndarray  # float32 (2**bits,)
    boundaries: np.ndarray  # float32 (2**bits - 1,)


def _check_dim(dim: object) -> int:
    if isinstance(dim, bool) or not isinstance(dim, Integral) or int(dim) < MIN_DIM:
        raise ValueError(_DIM_ERROR.format(dim))
    return int(dim)


def _check_bits(bits: object) -> int:
    if isinstance(bits, bool) or not isinstance(bits, Integral) or int(bits) not in BITS_RANGE:
        raise ValueError(_BITS_ERROR.format(bits))
    return int(bits)


def _erfc(x: np.ndarray) -> np.ndarray:
    """Element-wise ``math.erfc`` (correctly handles ±inf); float64."""
    return np.fromiter((math.erfc(v) for v in x.tolist()), dtype=np.float64, count=x.size)


def _cell_stats(edges: np.ndarray, sigma: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mass and first two moments of N(0, sigma²) on each cell ``(edges[k], edges[k+1])``.

    Args:
        edges: float64 ``(n + 1,)``, non-decreasing, ``edges[0] = -inf``,
            ``edges[-1] = +inf``.
        sigma: standard deviation.

    Returns:
        ``(P, M1, M2)``, each float64 ``(n,)``: ``P = Pr[cell]``, ``M1 = E[X; cell]``,
        ``M2 = E[X²; cell]``.
    """
    z = edges / sigma  # standardized edges, ±inf at the ends
    upper = 0.5 * _erfc(z * _SQRT_HALF)  # Pr[Z > z]  (accurate for z >> 0)
    lower = 0.5 * _erfc(-z * _SQRT_HALF)  # Pr[Z < z]  (accurate for z << 0)
    with np.errstate(invalid="ignore", over="ignore"):
        pdf = _INV_SQRT_2PI * np.exp(-0.5 * z * z)  # 0 at ±inf
        zpdf = np.where(np.isfinite(z), z * pdf, 0.0)  # z φ(z) -> 0 at ±inf
    a_up, b_up = upper[:-1], upper[1:]
    a_lo, b_lo = lower[:-1], lower[1:]
    za, zb = z[:-1], z[1:]
    # Pick the difference that does not cancel: both edges right of 0 -> upper-tail
    # masses, both left of 0 -> lower-tail masses, straddling 0 -> 1 minus two tails.
    mass = np.where(
        za >= 0.0,
        a_up - b_up,
        np.where(zb <= 0.0, b_lo - a_lo, 1.0 - b_up - a_lo),
    )
    m1 = sigma * (pdf[:-1] - pdf[1:])
    m2 = sigma * sigma * (mass + zpdf[:-1] - zpdf[1:])
    return mass, m1, m2


def _distortion(centroids: np.ndarray, inner: np.ndarray, sigma: float) -> float:
    """E[(X - c(X))²] for X ~ N(0, sigma²), ``c(X)`` the centroid of X's cell."""
    edges = np.concatenate(([-np.inf], inner, [np.inf]))
    mass, m1, m2 = _cell_stats(edges, sigma)
    return float(np.sum(m2 - 2.0 * centroids * m1 + centroids * centroids * mass))


def _solve(dim: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference's Lloyd–Max iteration in closed form; float64 results."""
    n_levels = 1 << bits
    sigma = 1.0 / math.sqrt(dim)
    lo, hi = -_INIT_SPAN * sigma, _INIT_SPAN * sigma
    inner = np.linspace(lo, hi, n_levels + 1)[1:-1].copy()
    centroids = np.zeros(n_levels, dtype=np.float64)
    prev = float("inf")
    for _ in range(_MAX_ITER):
        edges = np.concatenate(([-np.inf], inner, [np.inf]))
        mass, m1, _ = _cell_stats(edges, sigma)
        with np.errstate(invalid="ignore", divide="ignore"):
            centroids = np.where(mass < _TINY_CELL, 0.5 * (edges[:-1] + edges[1:]), m1 / mass)
        inner = 0.5 * (centroids[:-1] + centroids[1:])
        distortion = _distortion(centroids, inner, sigma)
        if abs(prev - distortion) < _TOL:
            break
        prev = distortion
    return centroids, inner


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# Bounded: decoders look tables up by the head_dim and bits a blob's header names. A
# codebook is at most 2 KiB (8 bits), so the entry count is the binding bound.
_CODEBOOK_CACHE = _lru.LRU("Lloyd-Max codebook", 1024, 4 << 20)
_MSE_CACHE = _lru.LRU("Lloyd-Max expected MSE", 1024)
# The module's caches by name: each has .stats() and .clear() (tq_jax._src._lru.LRU).
CACHES = {"lloyd_max": _CODEBOOK_CACHE, "expected_mse": _MSE_CACHE}


def cache_stats() -> dict:
    """``{name: tq_jax._src._lru.Stats}`` of the codebook caches (entries, bytes, hits...)."""
    return {name: c.stats() for name, c in CACHES.items()}


def clear_caches() -> None:
    """Empty the codebook caches (tables are re-solved, identically, on demand)."""
    for c in CACHES.values():
        c.clear()


def _lloyd_max(dim: int, bits: int) -> Codebook:
    return _CODEBOOK_CACHE.get_or_create((dim, bits), lambda: _build_lloyd_max(dim, bits))


def _build_lloyd_max(dim: int, bits: int) -> Codebook:
    centroids, inner = _solve(dim, bits)
    return Codebook(
        centroids=_readonly(centroids.astype(np.float32)),
        boundaries=_readonly(inner.astype(np.float32)),
    )


def lloyd_max(dim: int, bits: int) -> Codebook:
    """The reference's Lloyd–Max codebook for N(0, 1/dim) at ``bits`` bits.

    Reproduces ``tqai``'s shipped tables (d in {64, 96, 128, 256} × bits in
    {2, 3, 4, 6, 8}) and its scipy solver for every other ``dim``, to float32
    precision; see the module docstring for the iteration. Results are cached; the
    returned arrays are shared and read-only.

    Args:
        dim: head dimension d >= 2 (coordinate variance 1/d).
        bits: bits per coordinate, 1..8; the codebook has ``2**bits`` entries.

    Returns:
        A :class:`Codebook` with float32 ``centroids`` ``(2**bits,)`` (ascending) and
        float32 ``boundaries`` ``(2**bits - 1,)`` (the midpoints between them).

    Raises:
        ValueError: ``dim`` is not an int >= 2, or ``bits`` is not an int in 1..8.

    Examples:
        >>> cb = lloyd_max(128, 2)
        >>> cb.centroids.shape, cb.boundaries.shape, cb.centroids.dtype
        ((4,), (3,), dtype('float32'))
        >>> bool(abs(lloyd_max(128, 1).centroids[1] - (2 / (3.141592653589793 * 128)) ** 0.5) < 1e-6)
        True

    References:
        A. Zandieh, M. Daliri, M. Hadian, V. Mirrokni. "TurboQuant: Online Vector
        Quantization with Near-optimal Distortion Rate", arXiv:2504.19874 (2025).
        S. P. Lloyd, "Least squares quantization in PCM", IEEE Trans. Inf. Theory
        28(2), 1982. J. Max, "Quantizing for minimum distortion", IRE Trans. Inf.
        Theory 6(1), 1960.
    """
    return _lloyd_max(_check_dim(dim), _check_bits(bits))


def _expected_mse(dim: int, bits: int) -> float:
    return _MSE_CACHE.get_or_create((dim, bits), lambda: _build_expected_mse(dim, bits))


def _build_expected_mse(dim: int, bits: int) -> float:
    cb = _lloyd_max(dim, bits)
    return float(
        _distortion(cb.centroids.astype(np.float64), cb.boundaries.astype(np.float64), 1.0 / math.sqrt(dim))
    )


def expected_mse(dim: int, bits: int) -> float:
    """Per-coordinate MSE of :func:`lloyd_max` ``(dim, bits)`` on N(0, 1/dim).

    ``E[(X - q(X))²]`` for ``X ~ N(0, 1/dim)``, with ``q`` the returned float32
    codebook (each value goes to the centroid of the cell its boundaries put it in),
    in closed form. For a unit vector, ``dim * expected_mse(dim, bits)`` is the
    theoretical squared reconstruction error after rotation (≈ 0.1175 at 2 bits,
    ≈ 0.0345 at 3 bits, ≈ 0.0095 at 4 bits).

    Args:
        dim: head dimension d >= 2.
        bits: bits per coordinate, 1..8.

    Returns:
        The distortion as a Python float.

    Raises:
        ValueError: as :func:`lloyd_max`.

    Examples:
        >>> round(128 * expected_mse(128, 2), 4)
        0.1175

    References:
        TurboQuant, arXiv:2504.19874 (distortion of the per-coordinate quantizer).
    """
    return _expected_mse(_check_dim(dim), _check_bits(bits))
