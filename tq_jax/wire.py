"""TQ01 wire format: header layout, exact sizes, and the one strict parser.

Version 1 is byte-compatible with the reference plugin (``lmcache-turbo-quant-serde``
0.1.0). All integers little-endian::

    magic     4s    b"TQ01"
    version   u8    1
    bits      u8    2, 3, 4, 6 or 8 (the widths the reference reads)
    use_qjl   u8    1 when a QJL residual section follows
    qjl_m     u16   sketch size m (the reference writes 64 when use_qjl = 0)
    seed      i32   rotation seed
    ndim      u8
    shape     ndim × i64     the last entry is head_dim
    dtype_len u8
    dtype     ASCII          "bfloat16" | "float16" | "float32"
    idx_len   i64,  indices  ceil(prod(shape) * bits / 8) bytes, LSB-first stream
    nrm_len   i64,  norms    float16 × prod(shape[:-1])
    [use_qjl: sk_len i64, sketch int8 × prod(shape[:-1]) × m,
              rn_len i64, residual norms float16 × prod(shape[:-1])]

There is no padding, checksum or trailer: a blob is exactly that long.

:func:`parse` reads untrusted bytes in a fixed order — length of the fixed prefix,
magic, version, fields against named limits, element counts in Python ints, every
declared section length against the one the header implies *and* against the bytes
actually present, then "the sections cover the blob exactly" — and returns zero-copy
numpy views. It never allocates from a size the header claims. Every failure is a
subclass of :class:`WireError` (itself a ``ValueError``), one per cause.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import numpy as np

__all__ = [
    "MAGIC",
    "VERSION_1",
    "READ_BITS_V1",
    "MAX_NDIM",
    "MAX_DIM",
    "MAX_ELEMENTS",
    "MAX_QJL_SKETCH",
    "Header",
    "Parsed",
    "WireError",
    "TruncatedError",
    "BadMagicError",
    "UnsupportedVersionError",
    "BadFieldError",
    "LimitError",
    "SectionLengthError",
    "TrailingBytesError",
    "header_bytes",
    "header_nbytes",
    "serialized_size",
    "section_sizes",
    "parse",
    "peek_header",
]

MAGIC = b"TQ01"
VERSION_1 = 1
READ_BITS_V1 = (2, 3, 4, 6, 8)  # the widths the reference (tqai.packing) accepts
DTYPES = ("bfloat16", "float16", "float32")

_PREFIX = struct.Struct("<4sBBBHi")  # magic version bits use_qjl qjl_m seed: 13 bytes
_I64 = struct.Struct("<q")

# Named limits: a header that exceeds one is refused before anything is sliced.
MAX_NDIM = 16  # KV layouts use 2..6 axes
MAX_DIM = 1 << 16  # head_dim
MAX_ELEMENTS = 1 << 40  # total coordinates in one blob (1 TiB of indices at 8 bits)
MAX_QJL_SKETCH = 1 << 12


class WireError(ValueError):
    """A blob is not valid TQ01. Subclasses name the cause."""


class TruncatedError(WireError):
    """The blob ends before a field or section it declares."""


class BadMagicError(WireError):
    """The blob does not start with b"TQ01"."""


class UnsupportedVersionError(WireError):
    """The version byte names a format this reader does not know."""


class BadFieldError(WireError):
    """A header field holds a value the format does not allow (bits, shape, dtype, ...)."""


class LimitError(WireError):
    """A header field exceeds one of this module's named limits (MAX_*)."""


class SectionLengthError(WireError):
    """A declared section length disagrees with the length the header implies."""


class TrailingBytesError(WireError):
    """Bytes remain after the last section."""


class Header(NamedTuple):
    """The self-describing part of a TQ01 blob.

    Attributes:
        bits: bits per coordinate.
        seed: rotation seed (int32 range).
        shape: the quantized tensor's shape; ``shape[-1]`` is head_dim.
        dtype: original dtype name: "bfloat16", "float16" or "float32".
        use_qjl: whether a QJL residual section follows (read-only support).
        qjl_sketch_size: QJL sketch size m (64 when unused, as the reference writes).
        version: format version.
    """

    bits: int
    seed: int
    shape: tuple
    dtype: str
    use_qjl: bool = False
    qjl_sketch_size: int = 64
    version: int = VERSION_1

    @property
    def dim(self) -> int:
        return self.shape[-1]

    @property
    def num_vectors(self) -> int:
        return math.prod(self.shape[:-1])


class Parsed(NamedTuple):
    """A parsed blob: header plus zero-copy views of its sections."""

    header: Header
    indices: np.ndarray  # uint8 (idx_len,)
    norms: np.ndarray  # float16 (num_vectors,)
    sketch: np.ndarray | None  # int8 (num_vectors, m)
    residual_norms: np.ndarray | None  # float16 (num_vectors,)


def _seed32(seed: int) -> int:
    """The signed int32 the header stores; torch seeds by the low 32 bits too."""
    s = int(seed) & 0xFFFFFFFF
    return s - (1 << 32) if s >= (1 << 31) else s


def header_nbytes(ndim: int, dtype: str) -> int:
    return _PREFIX.size + 1 + 8 * ndim + 1 + len(dtype)


def section_sizes(shape, bits: int, use_qjl: bool = False, qjl_sketch_size: int = 64):
    """Byte lengths of (indices, norms, sketch, residual_norms) for ``shape``."""
    n_el = math.prod(int(s) for s in shape)
    n_vec = math.prod(int(s) for s in shape[:-1])
    idx = (n_el * bits + 7) // 8
    nrm = 2 * n_vec
    sk = n_vec * qjl_sketch_size if use_qjl else 0
    rn = 2 * n_vec if use_qjl else 0
    return idx, nrm, sk, rn


def serialized_size(shape, dtype: str, bits: int, *, use_qjl: bool = False, qjl_sketch_size: int = 64) -> int:
    """Exact TQ01 v1 blob length for a tensor of ``shape`` and ``dtype`` at ``bits``.

    Computed from the layout alone (no data), so an LMCache ``estimate_serialized_size``
    built on it is exact.
    """
    dtype = _dtype_name(dtype)
    idx, nrm, sk, rn = section_sizes(shape, bits, use_qjl, qjl_sketch_size)
    n = header_nbytes(len(shape), dtype) + 8 + idx + 8 + nrm
    if use_qjl:
        n += 8 + sk + 8 + rn
    return n


def _dtype_name(dtype) -> str:
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    name = name.replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(
            f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}: TQ01 records the "
            f"original float dtype so decode can restore it."
        )
    return name


def header_bytes(header: Header) -> bytes:
    """The header of ``header`` up to (not including) the indices length field."""
    dtype = _dtype_name(header.dtype).encode("ascii")
    shape = tuple(int(s) for s in header.shape)
    return b"".join(
        (
            _PREFIX.pack(
                MAGIC,
                header.version,
                header.bits,
                int(bool(header.use_qjl)),
                header.qjl_sketch_size,
                _seed32(header.seed),
            ),
            struct.pack(f"<B{len(shape)}q", len(shape), *shape),
            struct.pack("<B", len(dtype)),
            dtype,
        )
    )


class _Reader:
    """Bounds-checked cursor over a blob: every read checks the bytes exist first."""

    __slots__ = ("buf", "off")

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.off = 0

    def need(self, n: int, what: str) -> None:
        left = len(self.buf) - self.off
        if n > left:
            raise TruncatedError(
                f"TQ01 blob truncated: {what} needs {n} bytes at offset {self.off}, "
                f"but only {left} remain (blob is {len(self.buf)} bytes). The blob was cut "
                f"short in storage or transit; re-fetch or re-encode it."
            )

    def unpack(self, st: struct.Struct, what: str):
        self.need(st.size, what)
        vals = st.unpack_from(self.buf, self.off)
        self.off += st.size
        return vals

    def take(self, n: int, what: str) -> memoryview:
        self.need(n, what)
        view = self.buf[self.off : self.off + n]
        self.off += n
        return view


def _read_header(r: _Reader) -> Header:
    magic, version, bits, use_qjl, qjl_m, seed = r.unpack(_PREFIX, "the 13-byte fixed prefix")
    if magic != MAGIC:
        raise BadMagicError(
            f"not a TQ01 blob: starts with {bytes(magic)!r}, expected {MAGIC!r}. Check that the "
            f"bytes came from a TQ01 writer (tq_jax or lmcache-turbo-quant-serde)."
        )
    if version != VERSION_1:
        raise UnsupportedVersionError(
            f"TQ01 version {version} is not supported by this reader (it reads version "
            f"{VERSION_1}); upgrade tq-jax to read blobs written by a newer version."
        )
    if bits not in READ_BITS_V1:
        raise BadFieldError(
            f"TQ01 v1 bits must be one of {READ_BITS_V1}, got {bits}: the header is corrupt."
        )
    if use_qjl not in (0, 1):
        raise BadFieldError(f"TQ01 use_qjl flag must be 0 or 1, got {use_qjl}: the header is corrupt.")
    if use_qjl and not 1 <= qjl_m <= MAX_QJL_SKETCH:
        raise LimitError(
            f"TQ01 QJL sketch size {qjl_m} is outside 1..{MAX_QJL_SKETCH} (MAX_QJL_SKETCH)."
        )
    (ndim,) = r.unpack(struct.Struct("<B"), "ndim")
    if not 1 <= ndim <= MAX_NDIM:
        raise LimitError(f"TQ01 ndim {ndim} is outside 1..{MAX_NDIM} (MAX_NDIM): the header is corrupt.")
    shape = r.unpack(struct.Struct(f"<{ndim}q"), f"the {ndim}-entry shape")
    if any(s < 0 for s in shape):
        raise BadFieldError(f"TQ01 shape {shape} has a negative entry: the header is corrupt.")
    if not 2 <= shape[-1] <= MAX_DIM:
        raise LimitError(
            f"TQ01 head_dim (last shape entry) {shape[-1]} is outside 2..{MAX_DIM} (MAX_DIM)."
        )
    # Python ints: the product cannot wrap, and it is checked before any use.
    n_el = 1
    for s in shape:
        n_el *= s
        if n_el > MAX_ELEMENTS:
            raise LimitError(
                f"TQ01 shape {shape} holds more than MAX_ELEMENTS={MAX_ELEMENTS} coordinates: "
                f"refusing it before allocating anything."
            )
    (dlen,) = r.unpack(struct.Struct("<B"), "dtype_len")
    raw = bytes(r.take(dlen, "the dtype name"))
    try:
        dtype = raw.decode("ascii")
    except UnicodeDecodeError:
        dtype = None
    if dtype not in DTYPES:
        raise BadFieldError(
            f"TQ01 dtype {raw!r} is not one of {DTYPES}: the header is corrupt or from an "
            f"unsupported writer."
        )
    return Header(bits, seed, tuple(shape), dtype, bool(use_qjl), qjl_m, version)


def _section(r: _Reader, expected: int, what: str) -> memoryview:
    (declared,) = r.unpack(_I64, f"the {what} length")
    if declared != expected:
        raise SectionLengthError(
            f"TQ01 {what} section declares {declared} bytes but the header's shape and bits "
            f"imply {expected}: the blob is corrupt or was written by an incompatible writer."
        )
    return r.take(expected, f"the {what} section")


def _as_memoryview(blob) -> memoryview:
    if isinstance(blob, np.ndarray):
        if blob.dtype != np.uint8 or blob.ndim != 1:
            raise TypeError(
                f"a TQ01 blob array must be 1-D uint8, got {blob.dtype} with shape {blob.shape}"
            )
        blob = np.ascontiguousarray(blob)
    try:
        mv = memoryview(blob)
    except TypeError:
        raise TypeError(
            f"a TQ01 blob must be bytes, bytearray, memoryview or a 1-D uint8 array, got "
            f"{type(blob).__name__}"
        ) from None
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def peek_header(blob) -> Header:
    """Parse only the header (for ``inspect``-style tools and size checks)."""
    return _read_header(_Reader(_as_memoryview(blob)))


def parse(blob) -> Parsed:
    """Validate a TQ01 blob and return its header and zero-copy section views.

    Args:
        blob: bytes-like object or 1-D uint8 numpy array.

    Returns:
        :class:`Parsed`.

    Raises:
        WireError: one subclass per cause; nothing else escapes for bytes input.
        TypeError: if ``blob`` is not bytes-like at all.
    """
    r = _Reader(_as_memoryview(blob))
    h = _read_header(r)
    idx_n, nrm_n, sk_n, rn_n = section_sizes(h.shape, h.bits, h.use_qjl, h.qjl_sketch_size)
    idx = _section(r, idx_n, "indices")
    nrm = _section(r, nrm_n, "norms")
    sk = rn = None
    if h.use_qjl:
        sk = _section(r, sk_n, "QJL sketch")
        rn = _section(r, rn_n, "QJL residual norms")
    if r.off != len(r.buf):
        raise TrailingBytesError(
            f"TQ01 blob has {len(r.buf) - r.off} bytes after its last section (expected "
            f"{r.off} bytes in all): the blob is corrupt or two blobs were concatenated."
        )
    n_vec = h.num_vectors
    return Parsed(
        h,
        np.frombuffer(idx, np.uint8),
        np.frombuffer(nrm, np.float16),
        None if sk is None else np.frombuffer(sk, np.int8).reshape(n_vec, h.qjl_sketch_size),
        None if rn is None else np.frombuffer(rn, np.float16),
    )
