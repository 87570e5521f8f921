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

Version 2 (same magic; the reference refuses it with its version error) adds per-K/V
bits, raw edge layers, the structured rotation, float32 norms, norm correction and a
CRC32 — see docs/TQ01-v2.md for the layout. A writer emits version 1 whenever the
configuration (and, with ``norm_dtype="auto"``, the data) fits it.

:func:`parse` reads untrusted bytes in a fixed order — length of the fixed prefix,
magic, version, fields against named limits, element counts in Python ints, every
declared section length against the one the header implies *and* against the bytes
actually present, then "the sections cover the blob exactly" — and returns zero-copy
numpy views. It never allocates from a size the header claims. Every failure is a
subclass of :class:`WireError` (itself a ``ValueError``), one per cause.

:func:`layout` gives a writer, in one call, what a header decides (its canonical form,
its bytes read back by the parser's checks, the blob's length); :attr:`Parsed.layout` is
the same as read. :func:`pieces` is the parser's mirror: from a :class:`Header` (or its
:class:`Layout`) and the :class:`Sections` (the
same per-segment lists :class:`Parsed` holds) it returns the blob as zero-copy byte
pieces — header, every length-prefixed section, the CRC32 trailer — after reading the
header back through the parser's own checks and checking every section's length
against the one :func:`parse` expects, so anything it writes parses.
:func:`write_into` copies the pieces into a preallocated buffer.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import NamedTuple

import numpy as np

from tq_jax._src import frames
from tq_jax._src.rotation import QJL_SEED_OFFSET, ROTATIONS

__all__ = [
    "MAGIC",
    "VERSION_1",
    "READ_BITS_V1",
    "MAX_NDIM",
    "MAX_DIM",
    "MAX_DENSE_DIM",
    "MAX_ELEMENTS",
    "MAX_QJL_SKETCH",
    "Header",
    "Parsed",
    "WireError",
    "TruncatedError",
    "NormOverflowError",
    "NORM_OVERFLOW",
    "BadMagicError",
    "UnsupportedVersionError",
    "BadFieldError",
    "LimitError",
    "SectionLengthError",
    "TrailingBytesError",
    "KeyTrailerError",
    "ChecksumError",
    "VERSION_2",
    "NormCodes",
    "NORM_BITS",
    "TRELLIS_BITS",
    "DTYPES",
    "ITEMSIZE",
    "NORM_DTYPES",
    "ROTATION_CODES",
    "seed32",
    "dtype_name",
    "dtype_itemsize",
    "Layout",
    "layout",
    "Sections",
    "pieces",
    "write_into",
    "header_bytes",
    "header_nbytes",
    "blob_nbytes",
    "section_sizes",
    "parse",
    "peek_header",
]

MAGIC = b"TQ01"
VERSION_1 = 1
VERSION_2 = 2
VERSIONS = (VERSION_1, VERSION_2)
READ_BITS_V1 = (2, 3, 4, 6, 8)  # the widths the reference (tqai.packing) accepts
DTYPES = ("bfloat16", "float16", "float32")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
ITEMSIZE = _ITEMSIZE  # bytes per element of each recorded dtype
NORM_DTYPES = ("float16", "float32")

_PREFIX = struct.Struct("<4sBBBHi")  # magic version bits use_qjl qjl_m seed: 13 bytes
# v2: magic version flags rotation key_bits value_bits skip_first skip_last seed: 17 bytes
_PREFIX2 = struct.Struct("<4sBBBBBHHi")
_U32 = struct.Struct("<I")

FLAG_CHECKSUM = 0x01  # a CRC32 (zlib) of every preceding byte ends the blob
FLAG_NORM_CORRECTION = 0x02  # decoders rescale centroid vectors to unit length
FLAG_NORMS_F32 = 0x04  # norms are float32 (else float16)
FLAG_KV = 0x08  # axis 0 holds groups (K, V) and axis 1 layers: per-group bits, raw layers
FLAG_NORM_CODES = 0x10  # a u8 norm_bits follows the fixed prefix; norms are log-uniform codes
FLAG_TRELLIS = 0x20  # indices are trellis codes (tq_jax._src.trellis), bits in TRELLIS_BITS
_FLAGS_KNOWN = FLAG_CHECKSUM | FLAG_NORM_CORRECTION | FLAG_NORMS_F32 | FLAG_KV | FLAG_NORM_CODES | FLAG_TRELLIS
NORM_BITS = range(2, 9)  # widths of log-coded norms
TRELLIS_BITS = range(2, 8)  # widths of trellis codes (tq_jax._src.trellis.BITS): the doubled codebook has bits + 1
# A log-coded norm group's range (lo, hi) is float32 ln(norm): exp(hi) must stay finite.
MAX_LOG_NORM = 88.0
ROTATION_CODES = {"haar": 0, "hadamard": 1}  # the v2 header's rotation byte (a format fact)
if set(ROTATION_CODES) != set(ROTATIONS):  # tq_jax._src.rotation owns the names: they cannot drift
    raise ImportError(f"wire.ROTATION_CODES {ROTATION_CODES} must name exactly rotation.ROTATIONS {ROTATIONS}")
_ROTATION_NAMES = {v: k for k, v in ROTATION_CODES.items()}
MAX_SKIP_LAYERS = 0xFFFF
_I64 = struct.Struct("<q")

# Named limits: a header that exceeds one is refused before anything is sliced.
MAX_NDIM = 16  # KV layouts use 2..6 axes
MAX_DIM = 1 << 16  # head_dim
MAX_ELEMENTS = 1 << 40  # total coordinates in one blob (1 TiB of indices at 8 bits)
MAX_QJL_SKETCH = 1 << 12
# The decoder builds a dense float32 table from the header alone: the Haar rotation
# (head_dim² entries; for "hadamard" only its odd factor m²) and the QJL matrix (m·d).
# Built in float64 with a QR, a rotation costs ~64·d² bytes and O(d³) time, so a
# 20-byte header naming d = 65536 would ask for ~270 GB. Every such table is held to
# MAX_DENSE_DIM² entries: 4 MiB of float32 cached (in byte-bounded caches, tq_jax._src._lru),
# 64·MAX_DENSE_DIM² bytes (64 MiB) of float64 while a Haar one is built.
MAX_DENSE_DIM = 1 << 10


class WireError(ValueError):
    """A blob is not valid TQ01. Subclasses name the cause."""


class TruncatedError(WireError):
    """The blob ends before a field or section it declares."""


class NormOverflowError(ValueError):
    """A vector's norm does not fit the float16 norms of TQ01 version 1 (a writer's
    error: the format cannot hold the value, so no blob is written)."""


NORM_OVERFLOW = (
    "{count} of {total} vectors have an L2 norm that float16 cannot hold (largest: "
    "{largest:.6g}; float16 tops out at 65504). TQ01 version 1 stores norms as float16, "
    "so these vectors would silently decode as inf. Scale the tensor down before encoding, "
    "or use the wider-norm format (TQ01 version 2, float32 norms) once your readers support it."
)


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


class KeyTrailerError(TrailingBytesError):
    """The bytes are a key-bound L2 value: a blob followed by the bridge's key trailer."""


KEY_BOUND_VALUE = (
    "these {n:,} bytes are a key-bound L2 value, not a bare TQ01 blob: a {blob:,}-byte blob followed by "
    "the {trailer}-byte key trailer (b'TQK1' + BLAKE2b-128 of the LMCache ObjectKey) that the bridge's "
    "checksum presets write. Decode the blob alone (the first {blob:,} bytes); the key binding can only "
    "be checked with the ObjectKey (tq_jax.bridge._src.serde.check_key_trailer)."
)


def _refuse_key_trailer(mv: memoryview) -> None:
    """Raises :class:`KeyTrailerError` when ``mv`` is one blob + a key trailer (cheap: the
    header is read only when the trailer's magic sits where a key-bound value has it)."""
    n, t = len(mv), frames.KEY_TRAILER_BYTES
    if n < t + len(MAGIC) or bytes(mv[n - t : n - t + len(frames.KEY_TRAILER_MAGIC)]) != frames.KEY_TRAILER_MAGIC:
        return
    try:
        blob = blob_nbytes(_read_header(_Reader(mv), verify=False))
    except WireError:
        return  # not a blob at all: the parser's own error follows
    if frames.ends_with_key_trailer(mv, blob):
        raise KeyTrailerError(KEY_BOUND_VALUE.format(n=n, blob=blob, trailer=t))


class ChecksumError(WireError):
    """The CRC32 of a version-2 blob does not match its bytes."""


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
        value_bits: v2 with ``kv_layout``: bits of group 1 (V); ``bits`` is group 0 (K).
        kv_layout: v2: axis 0 holds groups (K, V), axis 1 layers.
        skip_first: v2: leading layers (axis 1) stored raw.
        skip_last: v2: trailing layers stored raw.
        rotation: "haar" or "hadamard".
        norm_dtype: "float16" or "float32".
        norm_correction: decoders rescale centroid vectors to unit length.
        checksum: a CRC32 trailer covers the blob.
        norm_bits: v2: 0 (norms are floats of ``norm_dtype``) or 2..8: each norm is a
            code on a log-uniform grid per norm group (:meth:`norm_groups`).
        trellis: v2: every segment's indices are trellis codes (bits 2..7).
    """

    bits: int
    seed: int
    shape: tuple
    dtype: str
    use_qjl: bool = False
    qjl_sketch_size: int = 64
    version: int = VERSION_1
    value_bits: int | None = None
    kv_layout: bool = False
    skip_first: int = 0
    skip_last: int = 0
    rotation: str = "haar"
    norm_dtype: str = "float16"
    norm_correction: bool = False
    checksum: bool = False
    norm_bits: int = 0
    trellis: bool = False

    @property
    def dim(self) -> int:
        return self.shape[-1]

    @property
    def num_vectors(self) -> int:
        return math.prod(self.shape[:-1])

    def segments(self) -> list:
        """The quantized parts, in wire order: ``(group, bits, layer_lo, layer_hi, n_vectors)``.

        Without ``kv_layout`` there is one segment: the whole tensor (group/layers None).
        """
        if not self.kv_layout:
            return [(None, self.bits, None, None, self.num_vectors)]
        groups, layers = self.shape[0], self.shape[1]
        per_layer = math.prod(self.shape[2:-1])
        lo, hi = self.skip_first, layers - self.skip_last
        vb = self.bits if self.value_bits is None else self.value_bits
        return [(g, self.bits if g == 0 else vb, lo, hi, (hi - lo) * per_layer) for g in range(groups)]

    def raw_ranges(self) -> list:
        """The raw (unquantized) edge layers, in wire order: ``(group, layer_lo, layer_hi)``.

        Per group, the leading ``skip_first`` layers and then the trailing ``skip_last``;
        empty without ``kv_layout``.
        """
        if not self.kv_layout:
            return []
        layers = self.shape[1]
        ranges = ((0, self.skip_first), (layers - self.skip_last, layers))
        return [(g, lo, hi) for g in range(self.shape[0]) for lo, hi in ranges if hi > lo]

    def norm_groups(self, n_vec: int) -> int:
        """Log-coded norm groups of a segment of ``n_vec`` vectors: for ``ndim >= 3``, one per
        index of the first two axes (in a ``[2, L, T, H, D]`` KV tensor: per K/V and layer),
        i.e. runs of ``prod(shape[2:-1])`` consecutive vectors; for ``ndim <= 2``, one."""
        if len(self.shape) < 3:
            return 1
        per_layer = math.prod(self.shape[2:-1])
        return n_vec // per_layer if per_layer else 0

    def norms_nbytes(self, n_vec: int) -> int:
        """Bytes of a segment's norms section (Python ints)."""
        if self.norm_bits:
            return 8 * self.norm_groups(n_vec) + (n_vec * self.norm_bits + 7) // 8
        return n_vec * (4 if self.norm_dtype == "float32" else 2)

    def raw_nbytes(self) -> int:
        """Bytes of the raw (unquantized) edge layers, all groups."""
        if not self.kv_layout:
            return 0
        per_layer = math.prod(self.shape[2:])
        return self.shape[0] * (self.skip_first + self.skip_last) * per_layer * _ITEMSIZE[self.dtype]


class NormCodes(NamedTuple):
    """A segment's log-coded norms (``norm_bits``), as zero-copy views.

    ``ranges`` float32 (groups, 2): (lo, hi) = ln of the smallest positive and largest
    norm of each group; ``codes`` uint8: the LSB-first stream of ``count`` codes of
    ``bits`` bits (``tq_jax._src.norms.decode_log_norms`` turns them into norms).
    """

    ranges: np.ndarray
    codes: np.ndarray
    bits: int
    count: int


class Parsed(NamedTuple):
    """A parsed blob: header plus zero-copy views of its sections.

    ``indices``/``norms`` are lists with one entry per :meth:`Header.segments` entry
    (one for version 1); ``raw`` holds the raw edge layers (empty for version 1);
    ``header_bytes`` the header as read (up to the first section length) and ``nbytes``
    the blob's length, so a plan is built from the parse without writing them again.
    """

    header: Header
    indices: list  # of uint8 (idx_len,)
    norms: list  # of float16/float32 (n_vectors,), or NormCodes with norm_bits
    sketch: np.ndarray | None  # int8 (num_vectors, m)
    residual_norms: np.ndarray | None  # float16 (num_vectors,)
    raw: np.ndarray  # uint8 (raw_nbytes,)
    header_bytes: bytes = b""
    nbytes: int = 0

    @property
    def layout(self) -> Layout:
        """The blob's :class:`Layout` as read: its header, header bytes and length."""
        return Layout(self.header, self.header_bytes, self.nbytes)


class Layout(NamedTuple):
    """A header as a writer writes it, from one call (:func:`layout`), or as a parser
    read it (:attr:`Parsed.layout`): everything about a blob that its header decides.

    Attributes:
        header: the :class:`Header` as :func:`parse` reads it back (seed as int32, the
            dtype's name, a version-2 ``value_bits`` filled in).
        header_bytes: its bytes, up to the first section length.
        nbytes: the exact length of the blob it describes (Python int).
    """

    header: Header
    header_bytes: bytes
    nbytes: int


def seed32(seed: int) -> int:
    """The signed int32 the header stores for ``seed``: its low 32 bits, two's complement.

    torch seeds by the low 32 bits too, so ``seed`` and ``seed32(seed)`` name the same
    rotation. Examples: ``seed32(-5) == -5``, ``seed32(2**32 + 42) == 42``.
    """
    s = int(seed) & 0xFFFFFFFF
    return s - (1 << 32) if s >= (1 << 31) else s


def dense_dim(dim: int, rotation: str = "haar") -> int:
    """Side of the dense matrix a rotation of ``dim`` builds: ``dim`` for Haar, the odd
    part of ``dim`` for the structured Hadamard rotation (checked against MAX_DENSE_DIM)."""
    if rotation == "haar":
        return dim
    while dim and dim % 2 == 0:
        dim //= 2
    return dim


def header_nbytes(ndim: int, dtype: str, version: int = VERSION_1, norm_bits: int = 0) -> int:
    prefix = _PREFIX.size if version == VERSION_1 else _PREFIX2.size + (1 if norm_bits else 0)
    return prefix + 1 + 8 * ndim + 1 + len(dtype)


def section_sizes(shape, bits: int, use_qjl: bool = False, qjl_sketch_size: int = 64):
    """Byte lengths of (indices, norms, sketch, residual_norms) of a version-1 blob."""
    n_el = math.prod(int(s) for s in shape)
    n_vec = math.prod(int(s) for s in shape[:-1])
    idx = (n_el * bits + 7) // 8
    nrm = 2 * n_vec
    sk = n_vec * qjl_sketch_size if use_qjl else 0
    rn = 2 * n_vec if use_qjl else 0
    return idx, nrm, sk, rn


def blob_nbytes(header: Header) -> int:
    """Exact length of the blob that ``header`` describes (Python ints: no overflow)."""
    dim = header.shape[-1]
    n = header_nbytes(len(header.shape), header.dtype, header.version, header.norm_bits)
    if header.version == VERSION_1:
        idx, nrm, sk, rn = section_sizes(header.shape, header.bits, header.use_qjl, header.qjl_sketch_size)
        n += 8 + idx + 8 + nrm
        return n + (8 + sk + 8 + rn if header.use_qjl else 0)
    for _, bits, _, _, n_vec in header.segments():
        n += 8 + (n_vec * dim * bits + 7) // 8 + 8 + header.norms_nbytes(n_vec)
    n += 8 + header.raw_nbytes()
    return n + (_U32.size if header.checksum else 0)


def dtype_name(dtype) -> str:
    """The TQ01 name (one of :data:`DTYPES`) of ``dtype``: a name, numpy dtype or ``torch.*``.

    Raises:
        ValueError: ``dtype`` is not bfloat16, float16 or float32.
    """
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    name = name.replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(
            f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}: TQ01 records the "
            f"original float dtype so decode can restore it."
        )
    return name


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a TQ01 dtype name (2 for bfloat16/float16, 4 for float32)."""
    return _ITEMSIZE[dtype_name(dtype)]


def header_bytes(header: Header) -> bytes:
    """The header of ``header`` up to (not including) the first section length."""
    dtype = dtype_name(header.dtype).encode("ascii")
    shape = tuple(int(s) for s in header.shape)
    if header.rotation not in ROTATION_CODES:
        raise ValueError(
            f"rotation must be one of {ROTATIONS}, got {header.rotation!r}: the header names its "
            f"rotation by a code (wire.ROTATION_CODES)."
        )
    if header.version == VERSION_1:
        prefix = _PREFIX.pack(
            MAGIC, VERSION_1, header.bits, int(bool(header.use_qjl)), header.qjl_sketch_size, seed32(header.seed)
        )
    else:
        flags = (
            (FLAG_CHECKSUM if header.checksum else 0)
            | (FLAG_NORM_CORRECTION if header.norm_correction else 0)
            | (FLAG_NORMS_F32 if header.norm_dtype == "float32" else 0)
            | (FLAG_KV if header.kv_layout else 0)
            | (FLAG_NORM_CODES if header.norm_bits else 0)
            | (FLAG_TRELLIS if header.trellis else 0)
        )
        vb = header.bits if header.value_bits is None else header.value_bits
        prefix = _PREFIX2.pack(
            MAGIC,
            VERSION_2,
            flags,
            ROTATION_CODES[header.rotation],
            header.bits,
            vb,
            header.skip_first,
            header.skip_last,
            seed32(header.seed),
        )
        if header.norm_bits:
            prefix += struct.pack("<B", header.norm_bits)
    return b"".join(
        (prefix, struct.pack(f"<B{len(shape)}q", len(shape), *shape), struct.pack("<B", len(dtype)), dtype)
    )


# ----------------------------------------------------------------------------------
# Writing: the inverse of parse, checked against the parser's own view of the header
# ----------------------------------------------------------------------------------


def layout(header: Header) -> Layout:
    """The :class:`Layout` a writer needs of ``header``, in one call: its canonical form,
    its bytes and the blob's length.

    Invariant: the bytes are read back by the parser's own header check and must give
    the canonical header again, so a blob written to this layout parses.

    Raises:
        ValueError: an unknown dtype or rotation; a head_dim whose dense rotation factor
            exceeds :data:`MAX_DENSE_DIM`; a header the parser refuses (a
            :class:`WireError`) or one its version cannot carry (e.g. a version-1
            header with version-2 fields).
    """
    canonical = _canonical(header)
    if canonical.shape:
        dim = canonical.shape[-1]
        dense = dense_dim(dim, canonical.rotation)
        if dense > MAX_DENSE_DIM:
            raise ValueError(
                f"head_dim {dim} with rotation={canonical.rotation!r} needs a dense {dense}x{dense} rotation, "
                f"but TQ01 readers refuse more than MAX_DENSE_DIM={MAX_DENSE_DIM} (they build it from the "
                f"header alone). Use rotation='hadamard' (its dense factor is the odd part of head_dim) or "
                f"split the vectors into heads of at most {MAX_DENSE_DIM}."
            )
    hb = header_bytes(canonical)
    try:
        parsed = _read_header(_Reader(memoryview(hb)), verify=False)
    except WireError as e:
        raise ValueError(f"wire: refusing to write a header the parser refuses: {e}") from e
    if parsed != canonical:
        raise ValueError(
            f"wire: the TQ01 version-{header.version} header cannot carry {header}; it "
            f"would be read back as {parsed}. Use version 2 for per-group bits, raw layers, "
            f"the structured rotation, float32 or coded norms, norm correction and checksums."
        )
    return Layout(parsed, hb, blob_nbytes(parsed))


class Sections(NamedTuple):
    """The sections of a blob, to write with :func:`pieces` (the mirror of :class:`Parsed`).

    Attributes:
        indices: one entry per :meth:`Header.segments` entry (one for version 1): a
            sequence of bytes-like chunks (bytes, memoryview, C-contiguous uint8 arrays)
            whose concatenation is that segment's LSB-first index stream.
        norms: one entry per segment: a float16/float32 ndarray of the segment's
            ``n_vectors`` norms in the header's ``norm_dtype`` (float16 for version 1),
            or a :class:`NormCodes` when ``header.norm_bits`` (its ``ranges`` are written
            as little-endian float32, then its ``codes``).
        raw: bytes-like pieces whose concatenation is the raw edge layers (version 2;
            empty otherwise), in wire order: per group, the first then the last layers.
        sketch: version 1 with ``use_qjl``: int8 (num_vectors, m) QJL sketch.
        residual_norms: version 1 with ``use_qjl``: float16 (num_vectors,) residual norms.
    """

    indices: list
    norms: list
    raw: tuple = ()
    sketch: np.ndarray | None = None
    residual_norms: np.ndarray | None = None

    @classmethod
    def from_parsed(cls, parsed: Parsed) -> Sections:
        """The sections of a parsed blob: ``pieces(p.header, Sections.from_parsed(p))``
        rebuilds the blob byte for byte."""
        return cls(
            [[i] for i in parsed.indices],
            list(parsed.norms),
            (parsed.raw,) if len(parsed.raw) else (),
            parsed.sketch,
            parsed.residual_norms,
        )


def _byte_view(obj, what: str) -> memoryview:
    """A flat byte view of ``obj`` (no copy for bytes-like objects and contiguous arrays)."""
    if isinstance(obj, np.ndarray):
        obj = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"wire.pieces: {what} must be bytes-like (bytes, memoryview, numpy array), got "
            f"{type(obj).__name__}; convert it with numpy.asarray first."
        ) from None
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _check_length(n: int, expected: int, what: str) -> None:
    if n != expected:
        raise SectionLengthError(
            f"wire.pieces: the {what} section holds {n} bytes but the header's shape and bits "
            f"imply {expected}: refusing to write a blob the parser would refuse. Encode the "
            f"tensor the header describes (or build the header from the encoded tensor)."
        )


def _float_norms(norms, dtype: str, n_vec: int, what: str) -> memoryview:
    if isinstance(norms, NormCodes) or not isinstance(norms, np.ndarray):
        raise TypeError(
            f"wire.pieces: {what} must be a {dtype} ndarray (the header has norm_bits = 0), "
            f"got {type(norms).__name__}."
        )
    if norms.dtype != np.dtype(dtype):
        raise ValueError(
            f"wire.pieces: {what} are {norms.dtype} but the header stores {dtype} norms: cast "
            f"them with .astype({dtype!r}) (or set the header's norm_dtype)."
        )
    mv = _byte_view(norms, what)
    _check_length(len(mv), n_vec * np.dtype(dtype).itemsize, what)
    return mv


def _coded_norms(norms, header: Header, n_vec: int, what: str) -> list:
    if not isinstance(norms, NormCodes):
        raise TypeError(
            f"wire.pieces: {what} must be a wire.NormCodes (the header has norm_bits = "
            f"{header.norm_bits}), got {type(norms).__name__}."
        )
    groups = header.norm_groups(n_vec)
    if norms.bits != header.norm_bits or norms.count != n_vec:
        raise ValueError(
            f"wire.pieces: {what} hold {norms.count} codes of {norms.bits} bits, but the header "
            f"implies {n_vec} codes of norm_bits = {header.norm_bits}."
        )
    ranges = np.asarray(norms.ranges)
    if ranges.shape != (groups, 2):
        raise ValueError(
            f"wire.pieces: {what} ranges have shape {ranges.shape}, but the header implies "
            f"({groups}, 2): one (lo, hi) per norm group (Header.norm_groups)."
        )
    rb = _byte_view(np.ascontiguousarray(ranges, "<f4"), what + " ranges")
    cb = _byte_view(norms.codes, what + " codes")
    _check_length(len(rb) + len(cb), header.norms_nbytes(n_vec), what)
    return [rb, cb]


def _canonical(header: Header) -> Header:
    """``header`` as :func:`parse` reads it back from :func:`header_bytes` (for comparison)."""
    h = header._replace(
        seed=seed32(header.seed), shape=tuple(int(s) for s in header.shape), dtype=dtype_name(header.dtype)
    )
    if h.version == VERSION_2:
        return h._replace(value_bits=h.bits if h.value_bits is None else h.value_bits)
    return h


def pieces(header: Header | Layout, sections: Sections) -> list:
    """The blob of ``header`` and ``sections`` as byte pieces in wire order (zero-copy).

    The pieces are: the header bytes, then every section as its i64 length and its
    data (the given buffers as memoryviews, never concatenated), then the CRC32
    trailer when ``header.checksum``. ``b"".join(pieces(h, s))`` is the blob;
    :func:`write_into` copies the pieces into a preallocated buffer.

    ``header`` is a :class:`Header`, or its :class:`Layout` (from :func:`layout` or
    :attr:`Parsed.layout`) when the caller already holds it: then the header is not
    written and checked again.

    Invariants: the header is read back by the parser's own header check
    (:func:`layout`), and every section's length is checked against the one
    :func:`parse` expects for that header, so whatever this returns parses (writer and
    parser cannot drift).

    Raises:
        ValueError: the header is one the parser refuses (a :class:`WireError`) or one
            its bytes cannot carry (e.g. a version-1 header with version-2 fields);
            :class:`SectionLengthError`: a section's length disagrees with the header;
            other ``ValueError``s: wrong norm dtype, section count or norm-code shape.
        TypeError: a section is not bytes-like, or norms are of the wrong kind.
    """
    h, hb, _ = header if isinstance(header, Layout) else layout(header)
    segments = h.segments()
    if len(sections.indices) != len(segments) or len(sections.norms) != len(segments):
        raise ValueError(
            f"wire.pieces: the header has {len(segments)} segment(s) (Header.segments), got "
            f"{len(sections.indices)} index and {len(sections.norms)} norm entries."
        )
    out = [hb]
    for (g, bits, _, _, n_vec), chunks, norms in zip(segments, sections.indices, sections.norms):
        name = "" if g is None else f" group {g}"
        views = [_byte_view(c, f"indices{name} chunk") for c in chunks]
        n = sum(len(v) for v in views)
        _check_length(n, (n_vec * h.dim * bits + 7) // 8, f"indices{name}")
        out.append(_I64.pack(n))
        out.extend(views)
        if h.norm_bits:
            nv = _coded_norms(norms, h, n_vec, f"norms{name}")
        else:
            nv = [_float_norms(norms, h.norm_dtype, n_vec, f"norms{name}")]
        out.append(_I64.pack(sum(len(v) for v in nv)))
        out.extend(nv)
    if h.version == VERSION_1:
        if len(sections.raw) and any(len(_byte_view(r, "raw")) for r in sections.raw):
            raise ValueError("wire.pieces: a version-1 blob has no raw layers section; use version 2.")
        if h.use_qjl:
            if sections.sketch is None or sections.residual_norms is None:
                raise ValueError("wire.pieces: the header sets use_qjl but the sections carry no QJL sketch.")
            _, _, sk_n, rn_n = section_sizes(h.shape, h.bits, True, h.qjl_sketch_size)
            sk = np.asarray(sections.sketch)
            if sk.dtype != np.int8:
                raise ValueError(f"wire.pieces: the QJL sketch must be int8, got {sk.dtype}.")
            skv = _byte_view(sk, "QJL sketch")
            _check_length(len(skv), sk_n, "QJL sketch")
            rnv = _float_norms(np.asarray(sections.residual_norms), "float16", h.num_vectors, "QJL residual norms")
            _check_length(len(rnv), rn_n, "QJL residual norms")
            out += [_I64.pack(sk_n), skv, _I64.pack(rn_n), rnv]
        elif sections.sketch is not None or sections.residual_norms is not None:
            raise ValueError("wire.pieces: the sections carry a QJL sketch but the header has use_qjl = False.")
    else:
        if sections.sketch is not None or sections.residual_norms is not None:
            raise ValueError("wire.pieces: a version-2 blob has no QJL sections.")
        raw = [_byte_view(r, "raw layers piece") for r in sections.raw]
        n = sum(len(v) for v in raw)
        _check_length(n, h.raw_nbytes(), "raw layers")
        out.append(_I64.pack(n))
        out.extend(raw)
        if h.checksum:
            crc = 0
            for b in out:
                crc = zlib.crc32(b, crc)
            out.append(_U32.pack(crc))
    return out


def write_into(pieces: list, out) -> int:
    """Copy ``pieces`` (from :func:`pieces`) back to back into ``out``; return the bytes written.

    Args:
        pieces: bytes-like pieces.
        out: a writable buffer (memoryview, bytearray, uint8 array) of at least
            ``sum(len(p) for p in pieces)`` bytes; bytes past that are left untouched.

    Raises:
        ValueError: ``out`` is too small (nothing is written).
        TypeError: ``out`` is read-only.
    """
    mv = memoryview(out)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if mv.readonly:
        raise TypeError("wire.write_into: `out` is read-only; pass a writable buffer (bytearray, memoryview).")
    views = [_byte_view(p, "piece") for p in pieces]
    total = sum(len(v) for v in views)
    if total > len(mv):
        raise ValueError(
            f"wire.write_into: the blob needs {total} bytes but `out` holds {len(mv)}; size it "
            f"with tq_jax.serialized_size (or wire.blob_nbytes of the header)."
        )
    off = 0
    for v in views:
        mv[off : off + len(v)] = v
        off += len(v)
    return off


class _Reader:
    """Bounds-checked cursor over a blob: every read checks the bytes exist first."""

    __slots__ = ("buf", "off", "end")

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.off = 0
        self.end = len(buf)  # a checksum trailer is excluded once verified

    def need(self, n: int, what: str) -> None:
        left = self.end - self.off
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


def _check_bits(bits: int, allowed, what: str) -> None:
    if bits not in allowed:
        raise BadFieldError(f"TQ01 {what} must be one of {tuple(allowed)}, got {bits}: the header is corrupt.")


def _read_prefix(r: _Reader, verify: bool = True) -> dict:
    magic, version = r.unpack(struct.Struct("<4sB"), "the magic and version")
    if magic != MAGIC:
        raise BadMagicError(
            f"not a TQ01 blob: starts with {bytes(magic)!r}, expected {MAGIC!r}. Check that the "
            f"bytes came from a TQ01 writer (tq_jax or lmcache-turbo-quant-serde)."
        )
    if version not in VERSIONS:
        raise UnsupportedVersionError(
            f"TQ01 version {version} is not supported by this reader (it reads versions "
            f"{VERSIONS}); upgrade tq-jax to read blobs written by a newer version."
        )
    r.off = 0
    if version == VERSION_1:
        _, _, bits, use_qjl, qjl_m, seed = r.unpack(_PREFIX, "the 13-byte fixed prefix")
        _check_bits(bits, READ_BITS_V1, "v1 bits")
        if use_qjl not in (0, 1):
            raise BadFieldError(f"TQ01 use_qjl flag must be 0 or 1, got {use_qjl}: the header is corrupt.")
        if use_qjl and not 1 <= qjl_m <= MAX_QJL_SKETCH:
            raise LimitError(f"TQ01 QJL sketch size {qjl_m} is outside 1..{MAX_QJL_SKETCH} (MAX_QJL_SKETCH).")
        if use_qjl and seed + QJL_SEED_OFFSET < 0:
            raise BadFieldError(
                f"TQ01 QJL blob has seed {seed}: its QJL matrix is seeded with seed + {QJL_SEED_OFFSET}, which "
                f"numpy's default_rng (the reference's) refuses when negative, so no writer produced this "
                f"blob: the header is corrupt."
            )
        return dict(bits=bits, seed=seed, use_qjl=bool(use_qjl), qjl_sketch_size=qjl_m, version=1)
    _, _, flags, rot, kb, vb, s0, s1, seed = r.unpack(_PREFIX2, "the 17-byte v2 fixed prefix")
    if flags & ~_FLAGS_KNOWN:
        raise BadFieldError(f"TQ01 v2 flags 0x{flags:02x} set unknown bits: the header is corrupt.")
    if flags & FLAG_CHECKSUM and verify:
        _verify_checksum(r)
    if rot not in _ROTATION_NAMES:
        raise BadFieldError(f"TQ01 v2 rotation code {rot} is unknown (known: {ROTATION_CODES}).")
    _check_bits(kb, range(1, 9), "key bits")
    _check_bits(vb, range(1, 9), "value bits")
    if flags & FLAG_TRELLIS:
        _check_bits(kb, TRELLIS_BITS, "trellis key bits")
        _check_bits(vb, TRELLIS_BITS, "trellis value bits")
    kv = bool(flags & FLAG_KV)
    if not kv and (kb != vb or s0 or s1):
        raise BadFieldError(
            "TQ01 v2 blob without the KV-layout flag has per-group bits or raw layers: the header is corrupt."
        )
    norm_bits = 0
    if flags & FLAG_NORM_CODES:
        (norm_bits,) = r.unpack(struct.Struct("<B"), "norm_bits")
        _check_bits(norm_bits, NORM_BITS, "v2 norm_bits")
        if flags & FLAG_NORMS_F32:
            raise BadFieldError(
                "TQ01 v2 flags set both NORMS_F32 and NORM_CODES: norms are either floats or codes; the header is corrupt."
            )
    return dict(
        norm_bits=norm_bits,
        bits=kb,
        seed=seed,
        version=2,
        value_bits=vb,
        kv_layout=kv,
        skip_first=s0,
        skip_last=s1,
        rotation=_ROTATION_NAMES[rot],
        norm_dtype="float32" if flags & FLAG_NORMS_F32 else "float16",
        norm_correction=bool(flags & FLAG_NORM_CORRECTION),
        checksum=bool(flags & FLAG_CHECKSUM),
        trellis=bool(flags & FLAG_TRELLIS),
    )


def _verify_checksum(r: _Reader) -> None:
    if len(r.buf) < _PREFIX2.size + _U32.size:
        raise TruncatedError(f"TQ01 blob truncated: {len(r.buf)} bytes cannot hold a header and its CRC32.")
    (stored,) = _U32.unpack_from(r.buf, len(r.buf) - _U32.size)
    actual = zlib.crc32(r.buf[: len(r.buf) - _U32.size])
    if stored != actual:
        raise ChecksumError(
            f"TQ01 blob failed its CRC32 check (stored 0x{stored:08x}, computed 0x{actual:08x}): the "
            f"blob was corrupted in storage or transit. Treat it as missing and re-fetch or re-encode it."
        )
    r.end = len(r.buf) - _U32.size


def _read_header(r: _Reader, verify: bool = True) -> Header:
    fields = _read_prefix(r, verify)
    (ndim,) = r.unpack(struct.Struct("<B"), "ndim")
    if not 1 <= ndim <= MAX_NDIM:
        raise LimitError(f"TQ01 ndim {ndim} is outside 1..{MAX_NDIM} (MAX_NDIM): the header is corrupt.")
    shape = r.unpack(struct.Struct(f"<{ndim}q"), f"the {ndim}-entry shape")
    if any(s < 0 for s in shape):
        raise BadFieldError(f"TQ01 shape {shape} has a negative entry: the header is corrupt.")
    if not 2 <= shape[-1] <= MAX_DIM:
        raise LimitError(f"TQ01 head_dim (last shape entry) {shape[-1]} is outside 2..{MAX_DIM} (MAX_DIM).")
    # Python ints: the product cannot wrap, and it is checked before any use. A
    # zero-length axis counts as 1, so (0, 2**62, 8) is refused too: it holds no
    # coordinates, but numpy and XLA cannot even describe such an array.
    n_el = 1
    for s in shape:
        n_el *= max(s, 1)
        if n_el > MAX_ELEMENTS:
            raise LimitError(
                f"TQ01 shape {shape} holds more than MAX_ELEMENTS={MAX_ELEMENTS} coordinates (a "
                f"zero-length axis counted as 1): refusing it before allocating anything."
            )
    (dlen,) = r.unpack(struct.Struct("<B"), "dtype_len")
    raw = bytes(r.take(dlen, "the dtype name"))
    try:
        dtype = raw.decode("ascii")
    except UnicodeDecodeError:
        dtype = None
    if dtype not in DTYPES:
        raise BadFieldError(
            f"TQ01 dtype {raw!r} is not one of {DTYPES}: the header is corrupt or from an unsupported writer."
        )
    dense = dense_dim(shape[-1], fields.get("rotation", "haar"))
    if dense > MAX_DENSE_DIM:
        raise LimitError(
            f"TQ01 head_dim {shape[-1]} with the {fields.get('rotation', 'haar')} rotation needs a dense "
            f"{dense}x{dense} rotation, above MAX_DENSE_DIM={MAX_DENSE_DIM}: refusing to build it."
        )
    if fields.get("use_qjl") and fields["qjl_sketch_size"] * shape[-1] > MAX_DENSE_DIM**2:
        raise LimitError(
            f"TQ01 QJL sketch size {fields['qjl_sketch_size']} x head_dim {shape[-1]} exceeds the "
            f"MAX_DENSE_DIM**2={MAX_DENSE_DIM**2} entries allowed for a table built from a header."
        )
    if fields.get("kv_layout"):
        if ndim < 3 or shape[0] not in (1, 2):
            raise BadFieldError(
                f"TQ01 v2 KV layout needs shape [groups(1|2), layers, ..., head_dim], got {shape}: the header is corrupt."
            )
        if fields["skip_first"] + fields["skip_last"] > shape[1]:
            raise BadFieldError(
                f"TQ01 v2 raw layers {fields['skip_first']} + {fields['skip_last']} exceed the {shape[1]} layers."
            )
    return Header(shape=tuple(shape), dtype=dtype, **fields)


def _section(r: _Reader, expected: int, what: str) -> memoryview:
    (declared,) = r.unpack(_I64, f"the {what} length")
    if declared != expected:
        raise SectionLengthError(
            f"TQ01 {what} section declares {declared} bytes but the header's shape and bits "
            f"imply {expected}: the blob is corrupt or was written by an incompatible writer."
        )
    return r.take(expected, f"the {what} section")


def _norm_codes(section: memoryview, groups: int, bits: int, n_vec: int, name: str) -> NormCodes:
    """A log-coded norms section; each group's range must be finite, ordered, and
    small enough that every level exp(lo..hi) is a finite float32."""
    ranges = np.frombuffer(section[: 8 * groups], "<f4").reshape(groups, 2)
    lo, hi = ranges[:, 0], ranges[:, 1]
    bad = ~(np.isfinite(lo) & np.isfinite(hi)) | (lo > hi) | (hi > MAX_LOG_NORM)
    if bad.any():
        i = int(np.argmax(bad))
        raise BadFieldError(
            f"TQ01 norms{name}: group {i} has log-norm range ({lo[i]!r}, {hi[i]!r}); a writer stores finite "
            f"lo <= hi <= {MAX_LOG_NORM} (ln of float32 norms): the blob is corrupt."
        )
    return NormCodes(ranges, np.frombuffer(section[8 * groups :], np.uint8), bits, n_vec)


def _as_memoryview(blob) -> memoryview:
    if isinstance(blob, np.ndarray):
        if blob.dtype != np.uint8 or blob.ndim != 1:
            raise TypeError(f"a TQ01 blob array must be 1-D uint8, got {blob.dtype} with shape {blob.shape}")
        blob = np.ascontiguousarray(blob)
    try:
        mv = memoryview(blob)
    except TypeError:
        raise TypeError(
            f"a TQ01 blob must be bytes, bytearray, memoryview or a 1-D uint8 array, got {type(blob).__name__}"
        ) from None
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def field_offsets(blob):
    """Where a valid blob keeps its header fields and section lengths (for fuzzers/tools).

    Returns:
        ``(fields, section_length_offsets, checksum)``: ``fields`` maps a header field name
        (``"version"``, ``"bits"``, ``"shape[0]"``, ...) to ``(offset, struct format)``;
        the offsets of every i64 section-length field in order; whether a CRC32 trailer
        follows.
    """
    h = peek_header(blob)
    f = {"version": (4, "<B")}
    if h.version == VERSION_1:
        f.update(bits=(5, "<B"), use_qjl=(6, "<B"), qjl_m=(7, "<H"), seed=(9, "<i"))
        off = _PREFIX.size
    else:
        f.update(flags=(5, "<B"), rotation=(6, "<B"), key_bits=(7, "<B"), value_bits=(8, "<B"),
                 skip_first=(9, "<H"), skip_last=(11, "<H"), seed=(13, "<i"))
        off = _PREFIX2.size
        if h.norm_bits:
            f["norm_bits"] = (off, "<B")
            off += 1
    f["ndim"] = (off, "<B")
    for i in range(len(h.shape)):
        f[f"shape[{i}]"] = (off + 1 + 8 * i, "<q")
    off += 1 + 8 * len(h.shape)
    f["dtype_len"] = (off, "<B")
    off += 1 + len(h.dtype)
    lengths, end = [], len(blob) - (_U32.size if h.checksum else 0)
    while off < end:
        lengths.append(off)
        off += 8 + _I64.unpack_from(blob, off)[0]
    return f, lengths, h.checksum


def peek_header(blob, *, verify: bool = True) -> Header:
    """Parse only the header (for ``inspect``-style tools and size checks).

    ``blob`` may hold more than the blob it starts with (blobs back to back, or a
    buffer sized for another layout: the rest is ignored) or only its first bytes.
    A version-2 checksum is verified when ``blob`` holds the whole blob, whose length
    follows from the header, unless ``verify`` is False (a caller that hands the blob
    to :func:`parse`, ``loads`` or ``load_into`` next, which always verify it before
    decoding anything, need not pay for the CRC twice).
    """
    mv = _as_memoryview(blob)
    h = _read_header(_Reader(mv), verify=False)
    if h.checksum and verify:
        n = blob_nbytes(h)
        if len(mv) >= n:
            _verify_checksum(_Reader(mv[:n]))
    return h


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
    mv = _as_memoryview(blob)
    _refuse_key_trailer(mv)  # named, instead of a CRC mismatch or trailing bytes
    r = _Reader(mv)
    h = _read_header(r)
    header_bytes = bytes(mv[: r.off])
    dim = h.dim
    sk = rn = None
    if h.version == VERSION_1:
        idx_n, nrm_n, sk_n, rn_n = section_sizes(h.shape, h.bits, h.use_qjl, h.qjl_sketch_size)
        indices = [np.frombuffer(_section(r, idx_n, "indices"), np.uint8)]
        norms = [np.frombuffer(_section(r, nrm_n, "norms"), np.float16)]
        if h.use_qjl:
            sk = _section(r, sk_n, "QJL sketch")
            rn = _section(r, rn_n, "QJL residual norms")
        raw = np.zeros(0, np.uint8)
    else:
        ndt = np.float32 if h.norm_dtype == "float32" else np.float16
        indices, norms = [], []
        for g, bits, _, _, n_vec in h.segments():
            name = "" if g is None else f" group {g}"
            indices.append(np.frombuffer(_section(r, (n_vec * dim * bits + 7) // 8, f"indices{name}"), np.uint8))
            section = _section(r, h.norms_nbytes(n_vec), f"norms{name}")
            if h.norm_bits:
                norms.append(_norm_codes(section, h.norm_groups(n_vec), h.norm_bits, n_vec, name))
            else:
                norms.append(np.frombuffer(section, ndt))
        raw = np.frombuffer(_section(r, h.raw_nbytes(), "raw layers"), np.uint8)
    if r.off != r.end:
        raise TrailingBytesError(
            f"TQ01 blob has {r.end - r.off} bytes after its last section (expected "
            f"{r.off} bytes in all): the blob is corrupt or two blobs were concatenated."
        )
    n_vec = h.num_vectors
    return Parsed(
        h,
        indices,
        norms,
        None if sk is None else np.frombuffer(sk, np.int8).reshape(n_vec, h.qjl_sketch_size),
        None if rn is None else np.frombuffer(rn, np.float16),
        raw,
        header_bytes,
        len(mv),
    )
