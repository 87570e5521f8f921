"""Log-coded norms (TQ01 v2 ``norm_bits``): one ``norm_bits``-bit code per vector.

Instead of one float per vector, each norm becomes a code on a log-uniform grid
spanning its group's range. At head_dim 64 a float16 norm costs 16/64 = 0.25 bit per
element, a 6-bit code 6/64 ≈ 0.094 (the effect on model quality:
benchmarks/results/quality_lm.md, presets turbo-3.5 and turbo-2.5). Host-side numpy:
there is one norm per vector, so this is d times less work than the indices. The
codes are an LSB-first bit stream (the byte order of :mod:`tq_jax._src.packing`), packed
here with numpy's ``packbits`` because they are host data of at most 8 bits.

Below :mod:`tq_jax._src.codec` and beside :mod:`tq_jax._src.wire` (which parses the code section
into :class:`tq_jax._src.wire.NormCodes`); used by the blob writer and reader and by kvcache.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NORM_CODE_BITS", "encode_log_norms", "decode_log_norms"]

NORM_CODE_BITS = range(2, 9)  # codes 1..2**b - 1 span [lo, hi]; code 0 is an exact zero norm


def _check_norm_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in NORM_CODE_BITS:
        raise ValueError(
            f"`norm_bits` must be an int in 2..8, got {bits!r}: norms become codes on a log-uniform "
            f"grid of 2**norm_bits - 1 levels (code 0 is an exact zero norm)."
        )
    return int(bits)


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """LSB-first bit stream of ``codes`` (n,) at ``bits`` each: ceil(n * bits / 8) bytes."""
    planes = (codes[:, None].astype(np.uint16) >> np.arange(bits, dtype=np.uint16)) & 1
    return np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little")


def _unpack_codes(stream: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`_pack_codes`: eight codes fill ``bits`` whole bytes, read as one
    little-endian uint64 per group of eight (uint16 codes, (n,))."""
    groups = -(-n // 8)
    flat = np.zeros(groups * bits, np.uint8)
    body = np.asarray(stream, np.uint8).reshape(-1)[: (n * bits + 7) // 8]
    flat[: body.size] = body
    words = np.zeros((groups, 8), np.uint8)
    words[:, :bits] = flat.reshape(groups, bits)
    shifts = np.arange(0, 8 * bits, bits, dtype=np.uint64)
    codes = (words.view("<u8") >> shifts) & np.uint64((1 << bits) - 1)
    return codes.astype(np.uint16).reshape(-1)[:n]


def encode_log_norms(norms: np.ndarray, groups: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float32 norms to ``bits``-bit log-uniform codes, one grid per group.

    ``norms`` (n,) splits into ``groups`` equal consecutive runs (a layer's vectors in a
    KV segment). Per group: ``lo``/``hi`` = float32 ln of its smallest positive and
    largest norm (0, 0 when none is positive), ``step = (hi - lo) / (2**bits - 2)``;
    code 0 is a zero norm, code ``c >= 1`` stands for ``exp(lo + (c - 1) * step)``:
    ``c = 1 + round((ln n - lo) / step)``, the nearest level in log space.

    Returns:
        ``(ranges float32 (groups, 2) of (lo, hi), codes uint8 (ceil(n*bits/8),))``.

    Raises:
        ValueError: a norm is not finite (the input held inf or NaN), or ``n`` does
            not split into ``groups``.
    """
    bits = _check_norm_bits(bits)
    n = np.asarray(norms, np.float32).reshape(-1)
    if groups <= 0 or n.size % groups:
        if n.size or groups < 0:
            raise ValueError(f"{n.size} norms do not split into {groups} equal groups")
        return np.zeros((max(groups, 0), 2), np.float32), np.zeros(0, np.uint8)
    if not np.isfinite(n).all():
        raise ValueError(
            f"{int((~np.isfinite(n)).sum())} vectors have a non-finite L2 norm (the input holds inf or NaN): "
            f"log-coded norms (norm_bits) cannot represent them. Clean the input or use float norms (norm_bits=0)."
        )
    g = n.reshape(groups, -1).astype(np.float64)
    pos = g > 0
    ln = np.log(np.where(pos, g, 1.0))
    lo = np.where(pos, ln, np.inf).min(1, initial=np.inf)
    hi = np.where(pos, ln, -np.inf).max(1, initial=-np.inf)
    empty = ~np.isfinite(lo)
    lo, hi = np.where(empty, 0.0, lo), np.where(empty, 0.0, hi)
    ranges = np.stack([lo, hi], 1).astype(np.float32)
    lo64, hi64 = ranges[:, :1].astype(np.float64), ranges[:, 1:].astype(np.float64)
    step = (hi64 - lo64) / (2**bits - 2)
    t = np.divide(ln - lo64, step, out=np.zeros_like(ln), where=step > 0)
    codes = np.where(pos, 1 + np.clip(np.rint(t), 0, 2**bits - 2), 0).astype(np.uint16)
    return ranges, _pack_codes(codes.reshape(-1), bits)


def decode_log_norms(ranges: np.ndarray, codes: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The float32 norms (n,) that :func:`encode_log_norms`' ``(ranges, codes)`` stand for."""
    ranges = np.asarray(ranges, np.float32).reshape(-1, 2)
    groups = ranges.shape[0]
    if n == 0 or groups == 0:
        return np.zeros(n, np.float32)
    c = _unpack_codes(codes, bits, n).reshape(groups, -1)
    # One level table per group, looked up by code: the same float32 arithmetic per
    # level as per vector, done 2**bits times per group instead of once per vector.
    levels = np.arange(2**bits, dtype=np.float32)
    lo, hi = ranges[:, :1], ranges[:, 1:]
    step = (hi - lo) / np.float32(2**bits - 2)
    with np.errstate(over="ignore", under="ignore"):
        table = np.exp(lo + (levels - 1) * step)
    table[:, 0] = 0
    flat = c + (np.arange(groups, dtype=np.int32) << bits)[:, None]  # row g's codes index table[g]
    return np.take(table.reshape(-1), flat).reshape(-1)  # float32 throughout: no cast
