"""The TurboQuant codec: norm → rotation → Lloyd–Max indices → packed rows, and back.

Encode, per vector ``x`` of length ``d`` (computed in float32, as the reference does):

1. ``n = ||x||₂`` and ``u = x / (n + 1e-10)``;
2. ``y = u @ Q.T`` with the seeded rotation ``Q`` (:mod:`tq_jax._src.rotation`): the
   reference's dense Haar rotation, or the structured randomized Hadamard one;
3. ``idx_j`` = the number of Lloyd–Max decision boundaries strictly below ``y_j``
   (:mod:`tq_jax._src.codebook`) — the nearest centroid, found by comparing against the
   boundaries, never by building a ``(…, d, 2**bits)`` distance tensor;
4. indices are bit-packed per vector (:mod:`tq_jax._src.packing`). When rows are
   byte-aligned (``d * bits % 8 == 0``) the Haar rotation's rows are permuted once so
   that step 2 emits the indices as *planes* (``packing.plane_order``), which pack
   without interleaving — same bytes, fewer passes. The Hadamard rotation does the
   same per group of 16 coordinates when ``d`` is 16, 32, …, 128
   (``tq_jax._src._kernels.encode_groups``).

Decode: ``x̂ = (c[idx] @ Q) · n``, cast to the requested dtype. Byte-aligned rows
unpack as words straight into natural order (:func:`packing.unpack_groups`), so the
rotation applies as it is.

Everything here is a pure function of arrays and a small frozen :class:`CodecConfig`,
so :func:`encode` and :func:`decode` can be called inside a user's own ``jit``,
``vmap`` or sharded computation. The blob layer (:mod:`tq_jax._src.blob`) drives the same
kernels block by block through this module's block API (:func:`encode_block`,
:func:`decode_block`, and :func:`stream_nbytes` for each block's share of the index
section); it never picks a kernel. Which kernel family a codec's blocks run is decided
below the block API, and :func:`layout` names it; the kernels themselves live in the
private module ``tq_jax._src._kernels``.

References:
    Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal
    Distortion Rate", arXiv:2504.19874 (2025).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import _kernels, _lru
from tq_jax._src import codebook as _codebook
from tq_jax._src import packing as _packing
from tq_jax._src import rotation as _rotation
from tq_jax._src import trellis as _trellis

# The rotation as arrays and the two rotation kernels are part of codec's public API.
from tq_jax._src._kernels import RotationOp, rotate, unrotate

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float, Float32, UInt8

__all__ = [
    "CodecConfig",
    "Encoded",
    "RotationOp",
    "encode",
    "decode",
    "rotate",
    "unrotate",
    "tables",
    "device_tables",
    "layout",
    "stream_nbytes",
    "encode_stream",
    "decode_stream",
    "encode_block",
    "decode_block",
]


@dataclasses.dataclass(frozen=True)
class CodecConfig:
    """What a codec needs besides the data: head dimension, bit width, rotation seed.

    Attributes:
        dim: vector length (head_dim), >= 2.
        bits: bits per coordinate, 1..8 (the codebook has ``2**bits`` levels).
        seed: rotation seed; like torch's generator only its low 32 bits matter.
        rotation: ``"haar"`` (the reference's dense rotation, O(d²)) or ``"hadamard"``
            (the structured randomized Hadamard rotation, O(d log d); TQ01 v2).
        norm_correction: rescale the decoded centroid vector to unit length before the
            inverse rotation (vLLM's "nc"; TQ01 v2).
        trellis: code the rotated coordinates as one trellis path per vector
            (:mod:`tq_jax._src.trellis`; bits 2..7, same bytes; TQ01 v2).
    """

    dim: int
    bits: int
    seed: int = 42
    rotation: str = "haar"
    norm_correction: bool = False
    trellis: bool = False

    def __post_init__(self):
        if not isinstance(self.dim, (int, np.integer)) or isinstance(self.dim, bool) or self.dim < 2:
            raise ValueError(
                f"`dim` must be an int >= 2, got {self.dim!r}: it is the length of each "
                f"vector (head_dim), the last axis of the input."
            )
        bits_range = _codebook.BITS_RANGE
        if not isinstance(self.bits, (int, np.integer)) or isinstance(self.bits, bool) or self.bits not in bits_range:
            raise ValueError(
                f"`bits` must be an int in {bits_range.start}..{bits_range.stop - 1}, got {self.bits!r}: "
                f"bits sets the codebook size 2**bits."
            )
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise ValueError(f"`seed` must be an int, got {self.seed!r}.")
        if self.rotation not in _rotation.ROTATIONS:
            raise ValueError(
                f"`rotation` must be one of {_rotation.ROTATIONS}, got {self.rotation!r}: 'haar' is the "
                f"reference's dense rotation, 'hadamard' the fast structured one."
            )
        if not isinstance(self.norm_correction, (bool, np.bool_)):
            raise ValueError(f"`norm_correction` must be a bool, got {self.norm_correction!r}.")
        object.__setattr__(self, "norm_correction", bool(self.norm_correction))
        if not isinstance(self.trellis, (bool, np.bool_)):
            raise ValueError(f"`trellis` must be a bool, got {self.trellis!r}.")
        object.__setattr__(self, "trellis", bool(self.trellis))
        if self.trellis and self.bits not in _trellis.BITS:
            raise ValueError(
                f"trellis coding takes bits in {_trellis.BITS.start}..{_trellis.BITS.stop - 1}, got bits="
                f"{self.bits}: its doubled codebook has bits + 1 bits, and codebooks stop at 8."
            )
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


# Keyed by header fields (a decoder meets whatever seed and head_dim a blob names), so
# every cache here is a bounded tq_jax._src._lru.LRU: by entries and by bytes held.
_TABLE_CACHE_SIZE = 64
_TABLE_CACHE_BYTES = 128 << 20  # a Haar table at MAX_DENSE_DIM holds two dense float32 copies
_TABLES = _lru.LRU("codec tables", _TABLE_CACHE_SIZE, _TABLE_CACHE_BYTES)


def _build_tables(dim: int, bits: int, seed: int, rotation: str, trellis: bool) -> _kernels.Tables:
    cb, grid = _kernels.quantizer(dim, bits)
    planar_dense = None
    if rotation == "haar":
        op = RotationOp(dense=_rotation.haar_rotation(dim, seed))
        if _kernels.planar(dim, bits):
            planar_dense = np.ascontiguousarray(op.dense[_packing.plane_order(dim, bits)])
            planar_dense.flags.writeable = False
    else:
        st = _rotation.structured_rotation(dim, seed)
        op = RotationOp(signs=st.signs, odd=st.odd)
    return _kernels.Tables(op, cb.centroids, cb.boundaries, grid, planar_dense, () if trellis else None)


def _tables(dim: int, bits: int, seed: int, rotation: str, trellis: bool) -> _kernels.Tables:
    key = (dim, bits, seed, rotation, trellis)
    return _TABLES.get_or_create(key, lambda: _build_tables(*key))


def tables(config: CodecConfig) -> _kernels.Tables:
    """The rotation and codebook (or trellis) arrays of ``config`` (cached, read-only numpy)."""
    return _tables(config.dim, config.bits, config.seed, config.rotation, config.trellis)


# One device copy per (dim, bits, seed, rotation, device).
_DEVICE_CACHE_SIZE = 64
_device_cache = _lru.LRU("codec device tables", _DEVICE_CACHE_SIZE, _TABLE_CACHE_BYTES)


# One device copy of a rotation per (dim, seed, rotation, device), shared by the device
# tables of every bit width (a K4V3 blob's two widths use one rotation).
_device_rotations = _lru.LRU("codec device rotations", _DEVICE_CACHE_SIZE, _TABLE_CACHE_BYTES)


def _to_arrays(t: _kernels.Tables, put, rot: RotationOp) -> _kernels.Tables:
    grid = None if t.grid is None else tuple(put(np.asarray(a)) for a in t.grid)
    planar = None if t.planar_dense is None else put(t.planar_dense)
    return _kernels.Tables(rot, put(t.centroids), put(t.boundaries), grid, planar, t.trellis)


def device_tables(config: CodecConfig, device=None) -> _kernels.Tables:
    """``tables(config)`` as concrete device arrays, transferred once per device.

    Safe to call while JAX traces a user's ``jit``/``vmap``/``shard_map``: the tables
    come from numpy values and are placed eagerly (``jax.ensure_compile_time_eval``),
    so the cache only ever holds concrete arrays, which a trace captures as constants.
    Storing a tracer here would break every later trace and eager call with
    ``UnexpectedTracerError``.
    """
    key = (config.dim, config.bits, config.seed, config.rotation, config.trellis, device)
    hit = _device_cache.get(key)
    if hit is not None:
        return hit

    def build():
        host = tables(config)
        put = functools.partial(jax.device_put, device=device)
        with jax.ensure_compile_time_eval():
            rot = _device_rotations.get_or_create(
                (config.dim, config.seed, config.rotation, device),
                lambda: RotationOp(*(None if a is None else put(a) for a in host.rotation)),
            )
            return _to_arrays(host, put, rot)

    return _device_cache.put(key, build())  # refuses tracers (tq_jax._src._lru)


# name -> tq_jax._src._lru.LRU (plus the encoders below)
CACHES = {
    "quantizers": _kernels.QUANTIZERS,
    "tables": _TABLES,
    "device rotations": _device_rotations,
    "device tables": _device_cache,
}


def cache_stats() -> dict:
    """``{name: tq_jax._src._lru.Stats}`` of every cache in :data:`CACHES` (quantizer tables,
    tables, device rotations, device tables, block encoders)."""
    return {name: c.stats() for name, c in CACHES.items()}


def clear_caches() -> None:
    """Empty the codec's caches (everything is rebuilt, identically, on demand)."""
    for c in CACHES.values():
        c.clear()


# --------------------------------------------------------------------------- blocks
#
# The row-level API the block driver (tq_jax._src.blob) uses: a *block* is B vectors (B a
# multiple of 8) whose indices form one LSB-first bit stream of B * dim * bits bits,
# the layout of a TQ01 index section. Which kernel runs (Hadamard groups, planar rows,
# natural-order indices) is decided here, never by the caller.


def layout(config: CodecConfig) -> str:
    """The kernel family ``config``'s blocks run (:func:`encode_block`,
    :func:`decode_block`): ``"trellis"`` (trellis codes), ``"groups"`` (Hadamard rotation
    of up to 8 groups of 16), ``"planar"`` (byte-aligned rows) or ``"natural"`` (other rows)."""
    return _kernels.layout(config.dim, config.bits, config.rotation, config.trellis)


def stream_nbytes(config: CodecConfig, n_vectors: int) -> int:
    """Bytes of the index stream of ``n_vectors`` vectors: ``ceil(n * dim * bits / 8)``
    (a Python int; the last byte's unused high bits are zero on the wire)."""
    return (int(n_vectors) * config.dim * config.bits + 7) // 8


def encode_stream(x, config: CodecConfig, device=None):
    """Encode a block ``x`` (B, dim): ``(stream, norms)``, traceable.

    ``stream`` is uint8 and its C-order flattening begins with the block's index
    stream (:func:`stream_nbytes` bytes; any bits past ``B*dim*bits`` hold padding
    rows' indices); ``norms`` is float32 (B,). The tables are the concrete
    :func:`device_tables` of ``device``, so inside a ``jit`` they are constants.
    """
    return _kernels.encode_stream(x, device_tables(config, device), config.bits)


def decode_stream(stream, norms, config: CodecConfig, dtype, device=None):
    """Decode a block, traceable: ``norms`` (B,), ``stream`` uint8 of exactly
    ``B*dim*bits/8`` bytes (B a multiple of 8). Returns an array of ``dtype`` whose
    C-order flattening is the ``(B, dim)`` vectors (``config.norm_correction`` applies)."""
    return _kernels.decode_stream(
        stream, norms, device_tables(config, device), config.bits, jnp.dtype(dtype), config.norm_correction
    )


# Compiled block encoders, one per (dim, bits, seed, rotation, device): like the device
# tables, keyed by values a writer chooses, so bounded (least recently used go first).
_MAX_ENCODE_KERNELS = 64
_encoders = _lru.LRU("codec block encoders", _MAX_ENCODE_KERNELS)
CACHES["block encoders"] = _encoders
_programs_lock = threading.Lock()
_programs: collections.OrderedDict = collections.OrderedDict()  # program signatures seen
_MAX_PROGRAM_KEYS = 4096
_programs_seen = 0


def _note_program(key) -> None:
    global _programs_seen
    if key in _programs:
        return
    with _programs_lock:
        if key not in _programs:
            _programs_seen += 1
            _programs[key] = None
            while len(_programs) > _MAX_PROGRAM_KEYS:
                _programs.popitem(last=False)


def compiled_programs() -> int:
    """Distinct block programs :func:`encode_block` and :func:`decode_block` have
    dispatched so far: one per (kernel, block shape, dtypes), each compiled once by
    ``jax.jit``. A plain counter of our own calls (no JAX internals)."""
    return _programs_seen


def _block_encoder(config: CodecConfig, device):
    """The jitted block encoder of one codec on one device.

    The tables are closed over rather than passed, so XLA sees them as constants of
    the program that it can fold into the fused rotation and quantizer loops, not as
    run-time arguments. Padding rows are cut off by the caller: masking them here
    would defeat the fusion of quantizer and packer.
    """
    key = (config.dim, config.bits, config.seed, config.rotation, config.trellis, device)
    kernel = _encoders.get(key)
    if kernel is not None:
        return kernel
    device_tables(config, device)  # concrete, cached before any trace reads them

    def encode_one(x):
        return encode_stream(x, config, device)

    if device is None:
        kernel = jax.jit(encode_one)
    else:  # numpy blocks go straight to `device` as arguments: no device_put per block
        placed = jax.sharding.SingleDeviceSharding(device)
        kernel = jax.jit(encode_one, in_shardings=placed, out_shardings=placed)
    return _encoders.put(key, kernel)


def encode_block(x, config: CodecConfig, device=None):
    """Dispatch the encode of one block ``x`` (B, dim) on ``device`` (None: JAX's
    default); returns :func:`encode_stream`'s ``(stream, norms)`` as device arrays
    without waiting for them. One compiled program per block shape."""
    key = (config.dim, config.bits, config.seed, config.rotation, config.trellis, device, x.shape, str(x.dtype))
    if key not in _programs:
        _note_program(key)
    return _block_encoder(config, device)(x)


def decode_block(stream, norms, config: CodecConfig, dtype, device=None, qjl=None):
    """Dispatch the decode of one block (see :func:`decode_stream`) on ``device``.

    ``qjl``: ``(sketch int8 (B, m), residual_norms (B,), matrix (m, dim))`` for blobs
    written with the QJL residual (TQ01 v1 read compatibility; Haar rotation only).
    """
    tabs = device_tables(config, device)
    dtype = jnp.dtype(dtype)
    key = (config.dim, config.bits, config.rotation, config.norm_correction, config.trellis, device, dtype,
           jnp.shape(stream), qjl is None)
    if key not in _programs:
        _note_program(key)
    if qjl is not None:
        sketch, residual, matrix = qjl
        return _kernels.decode_stream_qjl_jit(
            stream, norms, sketch, residual, tabs.rotation, tabs.centroids, matrix, bits=config.bits, dtype=dtype
        )
    return _kernels.decode_stream_jit(
        stream, norms, tabs, bits=config.bits, dtype=dtype, norm_correction=config.norm_correction
    )


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

    Leading axes are batched natively, so there is no need to ``vmap`` this; under
    ``vmap`` the Hadamard encoder runs both its paths (see ``tq_jax._src._kernels.encode_groups``).

    Examples:
        >>> import jax.numpy as jnp
        >>> cfg = CodecConfig(dim=64, bits=4)
        >>> enc = encode(jnp.ones((3, 64)), cfg)
        >>> enc.packed.shape, enc.norms.shape
        ((3, 32), (3,))
    """
    x = _check_input(x, config)
    return Encoded(*_kernels.encode_jit(x, device_tables(config), bits=config.bits))


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
    return _kernels.decode_jit(
        packed,
        norms,
        device_tables(config),
        bits=config.bits,
        dtype=jnp.dtype(dtype),
        norm_correction=config.norm_correction,
    )
