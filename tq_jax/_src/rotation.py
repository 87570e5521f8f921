"""The reference's seeded Haar rotation and QJL matrix, rebuilt in numpy (no torch).

TQ01 names its rotation by a seed: the reference builds it as ::

    G = torch.randn(d, d, generator=torch.Generator("cpu").manual_seed(seed))
    Q, R = torch.linalg.qr(G)
    Q = Q @ diag(sign(diag(R)))

so a decoder must regenerate torch's CPU normal stream. :func:`torch_randn` does that:

1. **Words.** torch's CPU generator is MT19937 seeded (``init_genrand``) with the low
   32 bits of the seed read as a 64-bit two's-complement integer: ``-5`` and
   ``0xFFFFFFFB`` are the same generator, and so are ``42`` and ``2**32 + 42``.
   numpy's legacy ``RandomState`` seeding is the same ``init_genrand``; its key is
   handed to a :class:`numpy.random.MT19937` whose ``random_raw`` yields the raw
   32-bit words.
2. **n >= 16** (``normal_fill``): word ``w`` becomes ``u = (w & 0xFFFFFF) * 2**-24``
   (float32); each block of 16 is turned into normals by Box–Muller, for j in 0..7:
   ``r = sqrt(-2 log(1 - u[j]))``, ``t = 2π u[j+8]``, ``out[j] = r cos t``,
   ``out[j+8] = r sin t``. When ``n % 16 != 0`` the last 16 outputs are recomputed
   from 16 fresh words.
3. **n < 16** (``normal_distribution<double>``): each pair of outputs takes four
   words; ``u1``, ``u2`` are 53-bit doubles from ``(w0 << 32 | w1)``,
   ``r = sqrt(-2 log1p(-u2))``, ``t = 2π u1``; the outputs are ``r cos t`` and (cached
   by the generator for the next draw) ``r sin t``, in double, rounded to float32.

Step 2's float32 arithmetic depends on which kernel torch dispatches to on the CPU it
runs on (``torch.backends.cpu.get_cpu_capability()``, ``ATEN_CPU_CAPABILITY``):

* ``kernel="avx2"`` (default): torch's AVX2 kernel, run for capability ``AVX2`` **and**
  ``AVX512`` — torch 2.13.0 registers no AVX-512 ``normal_stub`` (its AVX-512 slot is
  null, so the dispatcher falls back to AVX2; docs/interop.md). It evaluates ``log``,
  ``sin`` and ``cos`` with the Cephes polynomials of ``avx_mathfun.h``, and GCC fuses
  its multiply-adds into FMAs. This module replays those float32 operations one by one,
  FMAs included (emulated exactly through float64 with round-to-odd), and matches
  ``torch==2.13.0`` under AVX2 and AVX512 bit for bit (measured: every value of ``d*d``
  for d up to 576 and several seeds; tests/test_rotation.py pins both).
* ``kernel="scalar"``: torch's portable kernel (capability ``DEFAULT``: x86 without
  AVX2+FMA, or ``ATEN_CPU_CAPABILITY=default``) calls glibc's ``logf``/``cosf``/``sinf``;
  we use correctly rounded float64 values rounded to float32, which agree with glibc in
  ~98.5 % of values and within 1 ulp (≤ 3.6e-7 absolute) otherwise.

The two flavours differ from each other by at most 1.9e-6 per entry, and the rotation by
about as much; TQ01 needs ~1e-5 for lossless interop. tq_jax's own rotation
(:func:`haar_rotation`, hence everything it writes and reads) always uses
``kernel="avx2"``, whatever the host.

The QR is done in float64 by numpy (numpy's ``linalg`` always computes in double);
torch's float32 QR (MKL ``sgeqrf``) differs from it by its own float32 rounding
error: measured max |ΔQ| <= 1.6e-6 for d <= 192 and 3.4e-6 at d = 576 (a float64 torch
QR of the same G gives our Q bit for bit). The float64 QR's last bits vary with the
BLAS kernel numpy's OpenBLAS picks for the CPU; rounded to float32 they did not
(measured: four OpenBLAS kernels, d up to 576), so the rotation is the same on every host.
"""

from __future__ import annotations

import math
from numbers import Integral

import numpy as np

from tq_jax._src import _lru

__all__ = [
    "torch_randn",
    "haar_rotation",
    "hadamard",
    "Structured",
    "structured_rotation",
    "qjl_matrix",
    "KERNELS",
    "ROTATIONS",
    "QJL_SEED_OFFSET",
    "SIGN_SEED_XOR",
    "CACHES",
    "cache_stats",
    "clear_caches",
]

KERNELS = ("avx2", "scalar")
# The rotations a TQ01 blob can name: "haar" (haar_rotation, the reference's; version 1)
# and "hadamard" (structured_rotation; version 2). tq_jax._src.wire maps them to header codes.
ROTATIONS = ("haar", "hadamard")
QJL_SEED_OFFSET = 999999  # the QJL matrix's seed is seed + this: tqai.quantizer.PolarQuantizer._build_jl_matrix
SIGN_SEED_XOR = 0x5A5A5A5A  # the structured rotation's sign stream: MT19937(seed32 ^ this)
_SEED_MASK = 0xFFFFFFFF
_BLOCK = 16  # torch's normal_fill works on blocks of 16 uniforms
# The tables are built from a header's (dim, seed) alone, so their caches are bounded
# by entries and by bytes: a Haar rotation at MAX_DENSE_DIM is 4 MiB of float32.
_CACHE_SIZE = 64
_CACHE_BYTES = 64 << 20

_F = np.float32
_DIM_ERROR = (
    "`dim` must be an int >= 2, got {!r}: dim is the head dimension, the rotation is "
    "dim x dim. Pass the vectors' last-axis length."
)
_SEED_ERROR = (
    "`seed` must be an int, got {!r}: it names the rotation (torch.manual_seed semantics, "
    "low 32 bits of the two's-complement value). Pass the seed stored in the blob."
)
_QJL_SEED_ERROR = (
    f"QJL seed {{seed}} + {QJL_SEED_OFFSET} = {{total}} is negative, and numpy's default_rng (which the "
    f"reference uses for the QJL matrix) refuses negative seeds, so no reference blob "
    f"can carry it. Use a seed >= -{QJL_SEED_OFFSET}."
)


# ----------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------


_INT_REASONS = {
    "n": "n is the number of normal samples to draw. Pass a non-negative int.",
    "sketch_size": (
        "sketch_size is m, the number of 1-bit QJL projections (the reference writes "
        "64). Pass a positive int."
    ),
}


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or int(value) < minimum:
        if name == "dim":
            raise ValueError(_DIM_ERROR.format(value))
        raise ValueError(
            f"`{name}` must be an int >= {minimum}, got {value!r}: {_INT_REASONS[name]}"
        )
    return int(value)


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise ValueError(_SEED_ERROR.format(seed))
    return int(seed)


def _check_kernel(kernel: object) -> str:
    if kernel not in KERNELS:
        raise ValueError(
            f"`kernel` must be one of {KERNELS}, got {kernel!r}: it selects which of "
            "torch's CPU randn kernels to replay ('avx2' for torch running with CPU "
            "capability AVX2 or AVX512, 'scalar' for DEFAULT)."
        )
    return kernel


# ----------------------------------------------------------------------------------
# MT19937 words
# ----------------------------------------------------------------------------------


def _mt19937_words(seed32: int, count: int) -> np.ndarray:
    """The first ``count`` raw 32-bit outputs of MT19937 ``init_genrand(seed32)``."""
    key = np.random.RandomState(seed32).get_state()[1]  # legacy (init_genrand) seeding
    bitgen = np.random.MT19937()
    bitgen.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}
    return bitgen.random_raw(count).astype(np.uint32)


# ----------------------------------------------------------------------------------
# float32 helpers for the AVX2 kernel
# ----------------------------------------------------------------------------------


def _fma32(a, b, c) -> np.ndarray:
    """Single-rounding float32 ``a*b + c``, exactly as a hardware FMA.

    ``a*b`` of two float32 is exact in float64; the float64 sum is made round-to-odd
    (from its TwoSum error), after which rounding to float32 is correctly rounded.
    """
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c64 = np.asarray(c, np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    even = (s.view(np.uint64) & np.uint64(1)) == 0
    fix = (err != 0) & even
    if np.any(fix):
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(_F)


def _log256_ps(x: np.ndarray) -> np.ndarray:
    """``log256_ps`` of torch's ``avx_mathfun.h`` (Cephes logf), FMA-contracted."""
    x = np.maximum(x, np.array(0x00800000, np.int32).view(_F))  # flush denormals
    bits = x.view(np.int32)
    e = ((bits >> 23) - 0x7F).astype(_F) + _F(1)
    x = ((bits & np.int32(~0x7F800000)) | np.array(0.5, _F).view(np.int32)).view(_F)
    mask = x < _F(0.707106781186547524)
    tmp = np.where(mask, x, _F(0))
    x = x - _F(1)
    e = e - np.where(mask, _F(1), _F(0))
    x = x + tmp
    z = x * x
    y = np.full_like(x, _F(7.0376836292e-2))
    for p in (
        -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
        -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1,
    ):
        y = _fma32(y, x, _F(p))
    y = y * x
    y = _fma32(y, z, e * _F(-2.12194440e-4))
    y = _fma32(z, _F(-0.5), y)
    x = x + y
    return _fma32(e, _F(0.693359375), x)


def _sincos256_ps(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``sincos256_ps`` of torch's ``avx_mathfun.h`` (Cephes sinf/cosf), FMA-contracted."""
    sign_sin = x.view(np.uint32) & np.uint32(0x80000000)
    x = np.abs(x)
    j = (x * _F(1.27323954473516)).astype(np.int32)  # cvttps: truncate
    j = (j + 1) & ~1
    y = j.astype(_F)
    swap_sin = ((j & 4) << 29).astype(np.uint32)
    poly = (j & 2) == 0
    x = _fma32(y, _F(-0.78515625), x)
    x = _fma32(y, _F(-2.4187564849853515625e-4), x)
    x = _fma32(y, _F(-3.77489497744594108e-8), x)
    sign_cos = ((~(j - 2) & 4) << 29).astype(np.uint32)
    sign_sin = sign_sin ^ swap_sin
    z = x * x
    yc = _fma32(_F(2.443315711809948e-005), z, _F(-1.388731625493765e-003))
    yc = _fma32(yc, z, _F(4.166664568298827e-002))
    yc = yc * z
    yc = _fma32(yc, z, -(z * _F(0.5)))
    yc = yc + _F(1)
    ys = _fma32(_F(-1.9515295891e-4), z, _F(8.3321608736e-3))
    ys = _fma32(ys, z, _F(-1.6666654611e-1))
    ys = ys * z
    ys = _fma32(ys, x, x)
    s = np.where(poly, ys, yc)
    c = np.where(poly, yc, ys)
    return (s.view(np.uint32) ^ sign_sin).view(_F), (c.view(np.uint32) ^ sign_cos).view(_F)


# ----------------------------------------------------------------------------------
# Box–Muller kernels
# ----------------------------------------------------------------------------------


def _box_muller_avx2(u: np.ndarray) -> np.ndarray:
    """torch's ``NormalFill16<float>`` AVX2 specialisation on rows of 16 uniforms."""
    radius = np.sqrt(_F(-2) * _log256_ps(_F(1) - u[:, :8]))
    s, c = _sincos256_ps(_F(2.0 * math.pi) * u[:, 8:])
    # _mm256_fmadd_ps(n, std=1, mean=0) is n, except that -0 becomes +0.
    return np.concatenate([radius * c + _F(0), radius * s + _F(0)], axis=1)


def _box_muller_scalar(u: np.ndarray) -> np.ndarray:
    """torch's portable ``NormalFill16`` (float32 ``std::log``/``cos``/``sin``)."""
    f64 = np.float64
    log_u1 = np.log((_F(1) - u[:, :8]).astype(f64)).astype(_F)
    radius = np.sqrt(_F(-2) * log_u1)
    theta = (2.0 * math.pi * u[:, 8:].astype(f64)).astype(_F)
    c = np.cos(theta.astype(f64)).astype(_F)
    s = np.sin(theta.astype(f64)).astype(_F)
    return np.concatenate([radius * c + _F(0), radius * s + _F(0)], axis=1)


def _uniform24(words: np.ndarray) -> np.ndarray:
    return (words & np.uint32(0xFFFFFF)).astype(_F) * _F(2.0**-24)


def _randn_fill(n: int, seed32: int, kernel: str) -> np.ndarray:
    box = _box_muller_avx2 if kernel == "avx2" else _box_muller_scalar
    tail = n % _BLOCK
    words = _mt19937_words(seed32, n + (_BLOCK if tail else 0))
    full = n - tail
    out = np.empty(n, dtype=_F)
    with np.errstate(all="ignore"):
        out[:full] = box(_uniform24(words[:full]).reshape(-1, _BLOCK)).reshape(-1)
        if tail:
            out[n - _BLOCK :] = box(_uniform24(words[n:]).reshape(1, _BLOCK)).reshape(-1)
    return out


def _randn_small(n: int, seed32: int) -> np.ndarray:
    words = [int(w) for w in _mt19937_words(seed32, 4 * ((n + 1) // 2))]
    mask53, scale = (1 << 53) - 1, 2.0**-53
    out = []
    for k in range(0, len(words), 4):
        u1 = ((words[k] << 32 | words[k + 1]) & mask53) * scale
        u2 = ((words[k + 2] << 32 | words[k + 3]) & mask53) * scale
        r = math.sqrt(-2.0 * math.log1p(-u2))
        theta = 2.0 * math.pi * u1
        out += [r * math.cos(theta), r * math.sin(theta)]
    return np.asarray(out[:n], dtype=np.float64).astype(_F)


def torch_randn(n: int, seed: int, *, kernel: str = "avx2") -> np.ndarray:
    """torch's CPU ``torch.randn(n, generator=Generator().manual_seed(seed))``, in numpy.

    Args:
        n: number of samples, >= 0.
        seed: any Python int; only its low 32 bits (two's complement) matter, as for
            ``torch.Generator.manual_seed`` (which itself accepts
            ``[-2**63, 2**64)`` and raises outside).
        kernel: ``"avx2"`` replays torch's x86 AVX2 kernel (capability AVX2 or
            AVX512) bit for bit; ``"scalar"`` approximates its portable kernel
            (capability DEFAULT) to 1 ulp.
            Ignored for ``n < 16`` (one double-precision path everywhere).

    Returns:
        float32 ``(n,)``.

    Raises:
        ValueError: ``n`` is not an int >= 0, ``seed`` is not an int, or ``kernel`` is
            unknown.

    Examples:
        >>> torch_randn(20, 0).shape
        (20,)
        >>> bool((torch_randn(32, -5) == torch_randn(32, 0xFFFFFFFB)).all())
        True
    """
    n = _check_int(n, "n", 0)
    seed32 = _check_seed(seed) & _SEED_MASK
    kernel = _check_kernel(kernel)
    if n < _BLOCK:
        return _randn_small(n, seed32)
    return _randn_fill(n, seed32, kernel)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_HAAR_CACHE = _lru.LRU("Haar rotation", _CACHE_SIZE, _CACHE_BYTES)
_QJL_CACHE = _lru.LRU("QJL matrix", _CACHE_SIZE, _CACHE_BYTES)
_STRUCTURED_CACHE = _lru.LRU("structured rotation", _CACHE_SIZE, _CACHE_BYTES)
# The module's table caches by name: each has .stats() and .clear() (tq_jax._src._lru.LRU).
CACHES = {"haar": _HAAR_CACHE, "qjl": _QJL_CACHE, "structured": _STRUCTURED_CACHE}


def cache_stats() -> dict:
    """``{name: tq_jax._src._lru.Stats}`` of the rotation and QJL caches (entries, bytes, hits...)."""
    return {name: c.stats() for name, c in CACHES.items()}


def clear_caches() -> None:
    """Empty the rotation and QJL caches (tables are rebuilt, identically, on demand)."""
    for c in CACHES.values():
        c.clear()


def _haar_rotation(dim: int, seed32: int) -> np.ndarray:
    return _HAAR_CACHE.get_or_create((dim, seed32), lambda: _build_haar_rotation(dim, seed32))


def _build_haar_rotation(dim: int, seed32: int) -> np.ndarray:
    # kernel="avx2" unconditionally: the rotation tq_jax writes must not depend on the host
    g = torch_randn(dim * dim, seed32, kernel="avx2").reshape(dim, dim).astype(np.float64)
    q, r = np.linalg.qr(g)
    # sign(diag(R)) column fix; a zero pivot (probability 0) keeps its column as is
    # where torch.sign would zero it.
    q = q * np.where(np.diagonal(r) < 0.0, -1.0, 1.0)
    return _readonly(np.ascontiguousarray(q, dtype=_F))


def haar_rotation(dim: int, seed: int) -> np.ndarray:
    """The reference's ``dim x dim`` rotation for ``seed`` (TQ01 "Rotation").

    ``Q`` of the QR of :func:`torch_randn` ``(dim*dim, seed)`` viewed as ``(dim, dim)``,
    columns multiplied by ``sign(diag(R))`` so that the factorisation is unique and
    ``Q`` is Haar-distributed. Encoding is ``y = u @ Q.T``, decoding ``x = y @ Q``.

    Args:
        dim: head dimension, int >= 2.
        seed: any Python int; reduced to its low 32 bits (two's complement), as torch
            does, so ``-5`` and ``0xFFFFFFFB`` name the same rotation.

    Returns:
        float32 ``(dim, dim)`` orthogonal matrix, cached and read-only (shared between
        calls; copy it before modifying).

    Raises:
        ValueError: ``dim`` is not an int >= 2, or ``seed`` is not an int.

    Examples:
        >>> q = haar_rotation(64, 42)
        >>> q.shape, q.dtype
        ((64, 64), dtype('float32'))
        >>> bool(abs(q @ q.T - __import__("numpy").eye(64)).max() < 1e-5)
        True

    References:
        TurboQuant, arXiv:2504.19874 (random rotation before scalar quantization).
        F. Mezzadri, "How to generate random matrices from the classical compact
        groups", Notices of the AMS 54(5), 2007 (QR with the sign fix is Haar).
    """
    dim = _check_int(dim, "dim", 2)
    return _haar_rotation(dim, _check_seed(seed) & _SEED_MASK)


def _qjl_matrix(dim: int, sketch_size: int, seed: int) -> np.ndarray:
    return _QJL_CACHE.get_or_create((dim, sketch_size, seed), lambda: _build_qjl_matrix(dim, sketch_size, seed))


def _build_qjl_matrix(dim: int, sketch_size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + QJL_SEED_OFFSET)
    g = rng.standard_normal((sketch_size, dim)).astype(_F)
    g /= _F(math.sqrt(sketch_size))
    return _readonly(g)


def qjl_matrix(dim: int, sketch_size: int, seed: int) -> np.ndarray:
    """The reference's QJL projection ``G`` (TQ01 "QJL residual").

    ``default_rng(seed + QJL_SEED_OFFSET).standard_normal((m, dim))`` in float32 (the
    offset is 999999), divided by ``sqrt(m)``: entries N(0, 1/m), exactly ``tqai``'s
    ``PolarQuantizer._build_jl_matrix``.

    Args:
        dim: head dimension, int >= 2.
        sketch_size: m, the number of 1-bit projections, int >= 1.
        seed: the rotation seed of the blob (not reduced: numpy uses all its bits).

    Returns:
        float32 ``(sketch_size, dim)``, cached and read-only.

    Raises:
        ValueError: bad ``dim``/``sketch_size``/``seed``, or ``seed + QJL_SEED_OFFSET < 0``
            (numpy cannot seed with a negative number).

    Examples:
        >>> qjl_matrix(64, 32, 42).shape
        (32, 64)

    References:
        A. Zandieh, M. Daliri, I. Han, "QJL: 1-Bit Quantized JL Transform for KV Cache
        Quantization with Zero Overhead", arXiv:2406.03482 (2024).
    """
    dim = _check_int(dim, "dim", 2)
    sketch_size = _check_int(sketch_size, "sketch_size", 1)
    seed = _check_seed(seed)
    if seed + QJL_SEED_OFFSET < 0:
        raise ValueError(_QJL_SEED_ERROR.format(seed=seed, total=seed + QJL_SEED_OFFSET))
    return _qjl_matrix(dim, sketch_size, seed)


def hadamard(n: int) -> np.ndarray:
    """Sylvester's orthonormal Hadamard matrix of order ``n`` (a power of two), float64.

    ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2)``; so ``H_ab = H_a ⊗ H_b``.
    """
    n = _check_int(n, "n", 1)
    if n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]]) / math.sqrt(2.0)
    return h


class Structured(tuple):
    """The fast rotation's data: ``(signs (d,), odd (m, m))``, float32, read-only.

    ``R = (odd ⊗ H_p) · diag(signs)`` with ``d = m · p``, ``m`` the odd part of ``d`` and
    ``p = 2**k``: encode ``y = R u``, decode ``u = Rᵀ y``.
    """

    __slots__ = ()

    def __new__(cls, signs, odd):
        return super().__new__(cls, (signs, odd))

    @property
    def signs(self) -> np.ndarray:
        return self[0]

    @property
    def odd(self) -> np.ndarray:
        return self[1]

    def dense(self) -> np.ndarray:
        """The explicit ``(d, d)`` float64 matrix ``R`` (for tests and documentation)."""
        m = self.odd.shape[0]
        p = self.signs.shape[0] // m
        return np.kron(self.odd.astype(np.float64), hadamard(p)) * self.signs.astype(np.float64)[None, :]


def _structured_rotation(dim: int, seed32: int) -> Structured:
    return _STRUCTURED_CACHE.get_or_create((dim, seed32), lambda: _build_structured_rotation(dim, seed32))


def _build_structured_rotation(dim: int, seed32: int) -> Structured:
    m = dim
    while m % 2 == 0:
        m //= 2
    words = _mt19937_words(seed32 ^ SIGN_SEED_XOR, dim)
    signs = np.where(words & np.uint32(0x80000000), _F(-1.0), _F(1.0)).astype(_F)
    odd = np.ones((1, 1), _F) if m == 1 else np.array(_haar_rotation(m, seed32))
    return Structured(_readonly(signs), _readonly(odd))


def structured_rotation(dim: int, seed: int) -> Structured:
    """The TQ01 v2 fast rotation for ``dim`` and ``seed``: a randomized Hadamard transform.

    ``R = (Q_m ⊗ H_p) · diag(s)`` where ``d = m · p`` with ``p`` the largest power of two
    dividing ``d``; ``H_p`` is Sylvester's orthonormal Hadamard matrix, ``Q_m`` is
    :func:`haar_rotation` ``(m, seed)`` (``[[1]]`` when ``m = 1``), and
    ``s_j = -1`` if bit 31 of word ``j`` of MT19937 seeded with
    ``(seed & 0xFFFFFFFF) ^ 0x5A5A5A5A`` is set, else ``+1``. For power-of-two ``d``
    this is the classic randomized Hadamard ``H·D``; otherwise the odd factor
    (3 for d = 96 or 192, 5 for 80, 7 for 112, 9 for 576) is a small dense Haar
    rotation. Applying it costs ``O(d (log p + m))`` instead of ``O(d²)``.

    ``R`` is orthogonal (a Kronecker product of orthogonal factors times a sign
    diagonal), so it keeps every vector's length, and the Hadamard factor spreads each
    input channel evenly over ``p`` coordinates. Its quality against Haar is measured
    by benchmarks/studies/quality_study.py (benchmarks/studies/quality.md).

    Returns:
        :class:`Structured` ``(signs, odd)``, cached and read-only.

    References:
        N. Ailon, B. Chazelle, "The Fast Johnson–Lindenstrauss Transform", STOC 2006.
        S. Ashkboos et al., "QuaRot", arXiv:2404.00456 (2024).
    """
    dim = _check_int(dim, "dim", 2)
    return _structured_rotation(dim, _check_seed(seed) & _SEED_MASK)
