"""Tensors ↔ TQ01 blobs: the block driver behind :func:`dumps` and :func:`loads`.

A tensor of any size is cut into blocks of ``block_vectors`` vectors (default: about
2**20 coordinates, so intermediates stay a few MB whatever the input size) and each
block runs through one jit-compiled kernel. A block shorter than that is padded up to
a *bucket* — the next size of the form 2**k or 3·2**(k-1), at least 8 — so a stream
of chunks of every length compiles a few programs, not one per length: LMCache's last
chunk of a prompt is short, and recompiling for it would cost far more than the
padding (at most 1/3 of a partial block).

Blocks are dispatched asynchronously and fetched in order, so host copies overlap
device work. On the CPU backend, 64-byte-aligned host buffers are shared with XLA
without a copy.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax import codec as _codec
from tq_jax import packing as _packing
from tq_jax import rotation as _rotation
from tq_jax import wire as _wire

__all__ = [
    "dumps",
    "dump_into",
    "loads",
    "load_into",
    "NormOverflowError",
    "bucket",
    "DEFAULT_BLOCK_COORDS",
]

DEFAULT_BLOCK_COORDS = 1 << 20  # coordinates per block: 4 MiB of float32 intermediates
_MIN_BUCKET = 8  # a multiple of 8 vectors keeps every block's bit stream byte-aligned
_F16_MAX = float(np.finfo(np.float16).max)
_ALIGN = 64

NORM_OVERFLOW = (
    "{count} of {total} vectors have an L2 norm that float16 cannot hold (largest: "
    "{largest:.6g}; float16 tops out at 65504). TQ01 version 1 stores norms as float16, "
    "so these vectors would silently decode as inf. Scale the tensor down before encoding, "
    "or use the wider-norm format (TQ01 version 2, float32 norms) once your readers support it."
)


class NormOverflowError(ValueError):
    """A vector's norm does not fit the float16 norms of TQ01 version 1."""


def bucket(n: int) -> int:
    """Smallest size >= n of the form 2**k or 3 * 2**(k-1), and at least 8."""
    n = max(int(n), _MIN_BUCKET)
    p = 1 << (n - 1).bit_length()  # next power of two
    three_quarters = 3 * p // 4
    return three_quarters if three_quarters >= n and three_quarters % _MIN_BUCKET == 0 else p


def _block_vectors(dim: int, block_vectors: int | None) -> int:
    if block_vectors is None:
        block_vectors = max(_MIN_BUCKET, DEFAULT_BLOCK_COORDS // dim)
    block_vectors = int(block_vectors)
    if block_vectors < _MIN_BUCKET:
        raise ValueError(f"block_vectors must be >= {_MIN_BUCKET}, got {block_vectors}")
    # Round down to a bucket size so full blocks and short tails share programs.
    p = 1 << (block_vectors.bit_length() - 1)
    three_halves = 3 * p // 2
    return three_halves if three_halves <= block_vectors and three_halves % _MIN_BUCKET == 0 else p


def _aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is 64-byte aligned."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off : off + nbytes].view(dtype).reshape(shape)


# --------------------------------------------------------------------------- kernels


@functools.partial(jax.jit, static_argnames="bits")
def _encode_block(x, n_valid, rotation, boundaries, grid, *, bits):
    """(B, d) floats → (bit stream of B*d indices, float32 norms (B,)).

    Rows at or past ``n_valid`` are padding: their indices are zeroed so the unused
    high bits of the stream's last byte are zero, as TQ01 requires.
    """
    idx, norms = _codec.encode_indices(x, rotation, boundaries, grid)
    valid = jnp.arange(x.shape[0]) < n_valid
    idx = jnp.where(valid[:, None], idx, jnp.uint8(0))
    return _packing.pack(idx.reshape(-1), bits), norms


@functools.partial(jax.jit, static_argnames=("bits", "dtype"))
def _decode_block(stream, norms, rotation, centroids, *, bits, dtype):
    n_vec, dim = norms.shape[0], _codec._dim_of(rotation)
    idx = _packing.unpack(stream, bits, n_vec * dim).reshape(n_vec, dim)
    return _codec.decode_indices(idx, norms, rotation, centroids, dtype)


@functools.partial(jax.jit, static_argnames=("bits", "dtype"))
def _decode_block_qjl(stream, norms, sketch, residual_norms, rotation, centroids, qjl_matrix, *, bits, dtype):
    n_vec, dim = norms.shape[0], _codec._dim_of(rotation)
    idx = _packing.unpack(stream, bits, n_vec * dim).reshape(n_vec, dim)
    qjl = (sketch, residual_norms, qjl_matrix)
    return _codec.decode_indices(idx, norms, rotation, centroids, dtype, qjl)


# --------------------------------------------------------------------------- helpers


def _host_view(x) -> np.ndarray:
    """A host numpy view (no copy for numpy input or CPU jax arrays)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.Array):
        return np.asarray(x)
    if hasattr(x, "__array__") or isinstance(x, (list, tuple)):
        return np.asarray(x)
    raise TypeError(f"expected a numpy or jax array, got {type(x).__name__}")


def _device_list(device) -> list:
    """``None`` (JAX's default device), one device, or a sequence of devices."""
    if device is None or isinstance(device, jax.Device):
        return [device]
    devices = list(device)
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise ValueError(f"device must be a jax.Device, a non-empty sequence of them, or None; got {device!r}")
    return devices


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows,) + a.shape[1:], a.dtype)
    out[: a.shape[0]] = a
    return out


def _check_bits_v1(bits):
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or bits not in _wire.READ_BITS_V1:
        extra = ""
        if isinstance(bits, (int, np.integer)) and 1 <= bits <= 8:
            extra = (
                f" The codec itself (tq_jax.encode) supports {bits} bits, but TQ01 version 1 "
                f"can only say {_wire.READ_BITS_V1}, the widths the reference plugin reads."
            )
        raise ValueError(f"`bits` must be one of {_wire.READ_BITS_V1} for TQ01 v1, got {bits!r}.{extra}")
    return int(bits)


def _check_tensor(x: np.ndarray) -> str:
    try:
        dtype = _wire._dtype_name(x.dtype)
    except ValueError:
        raise ValueError(
            f"can only encode bfloat16, float16 or float32 tensors, got {x.dtype}: cast it "
            f"first (TQ01 records one of those three as the tensor's original dtype)."
        ) from None
    if x.ndim < 1 or x.shape[-1] < 2:
        raise ValueError(
            f"the last axis must be head_dim >= 2, got shape {x.shape}: reshape so each "
            f"vector to quantize is a row along the last axis."
        )
    if x.ndim > _wire.MAX_NDIM or x.shape[-1] > _wire.MAX_DIM:
        raise ValueError(f"shape {x.shape} exceeds the TQ01 limits (ndim <= {_wire.MAX_NDIM}, head_dim <= {_wire.MAX_DIM}).")
    return dtype


# --------------------------------------------------------------------------- encode


def _encode_sections(x, bits, seed, block_vectors, device):
    """Run the codec over ``x`` block by block; return (header, [index chunks], norms f32)."""
    bits = _check_bits_v1(bits)
    host = _host_view(x)
    dtype = _check_tensor(host)
    shape = tuple(int(s) for s in host.shape)
    dim = shape[-1]
    n_vec = math.prod(shape[:-1])
    cfg = _codec.CodecConfig(dim, bits, seed)
    devices = _device_list(device)
    tabs = [_codec.device_tables(cfg, d) for d in devices]
    flat = np.ascontiguousarray(host).reshape(n_vec, dim)
    block = _block_vectors(dim, block_vectors)

    pending = []
    for i, start in enumerate(range(0, n_vec, block)):
        nb = min(block, n_vec - start)
        rows = block if nb == block else bucket(nb)
        rot, _, bnd, grid = tabs[i % len(devices)]
        xb = jax.device_put(_pad_rows(flat[start : start + nb], rows), devices[i % len(devices)])
        pending.append((nb, _encode_block(xb, nb, rot, bnd, grid, bits=bits)))

    norms = np.empty(n_vec, np.float32)
    chunks = []
    start = 0
    for nb, (stream, nrm) in pending:
        chunks.append(np.asarray(stream)[: (nb * dim * bits + 7) // 8])
        norms[start : start + nb] = np.asarray(nrm)[:nb]
        start += nb

    big = np.isfinite(norms) & (norms >= 65520.0)  # rounds to inf in float16
    if big.any():
        raise NormOverflowError(
            NORM_OVERFLOW.format(count=int(big.sum()), total=n_vec, largest=float(norms[big].max()))
        )
    header = _wire.Header(bits=bits, seed=_wire._seed32(seed), shape=shape, dtype=dtype)
    return header, chunks, norms.astype(np.float16)


def _write(header, chunks, norms16, out: memoryview) -> int:
    idx_n, nrm_n, _, _ = _wire.section_sizes(header.shape, header.bits)
    head = _wire.header_bytes(header)
    off = 0

    def put(b):
        nonlocal off
        n = len(b)
        out[off : off + n] = b
        off += n

    put(head)
    put(_wire._I64.pack(idx_n))
    for c in chunks:
        put(memoryview(c))
    put(_wire._I64.pack(nrm_n))
    put(memoryview(norms16).cast("B"))
    return off


def dumps(x, *, bits: int, seed: int = 42, block_vectors: int | None = None, device=None) -> bytes:
    """Encode a tensor into a TQ01 version-1 blob, byte-compatible with the reference.

    Args:
        x: numpy or jax array ``(..., head_dim)`` of bfloat16, float16 or float32.
        bits: 2, 3, 4, 6 or 8 bits per coordinate.
        seed: rotation seed (stored as int32; only the low 32 bits matter).
        block_vectors: vectors per kernel call (default: ~2**20 coordinates).
        device: JAX device to compute on (default: JAX's default device), or a
            sequence of devices that take blocks in turn; the bytes do not depend
            on how many devices share the work.

    Returns:
        The blob; its length is :func:`tq_jax.serialized_size` of the layout.

    Raises:
        ValueError: unsupported bits/dtype/shape.
        NormOverflowError: a finite vector's norm exceeds float16's range.
    """
    header, chunks, norms16 = _encode_sections(x, bits, seed, block_vectors, device)
    out = bytearray(_wire.serialized_size(header.shape, header.dtype, header.bits))
    n = _write(header, chunks, norms16, memoryview(out))
    assert n == len(out)
    return bytes(out)


def dump_into(x, out, *, bits: int, seed: int = 42, block_vectors: int | None = None, device=None) -> int:
    """Like :func:`dumps`, but write into ``out`` (a writable bytes-like/uint8 buffer).

    Nothing is written unless the whole blob fits and encoding succeeded.

    Returns:
        The number of bytes written (the exact serialized size).

    Raises:
        ValueError: ``out`` is too small (the message gives the size needed), or as
            :func:`dumps`.
    """
    mv = memoryview(out).cast("B") if not isinstance(out, np.ndarray) else memoryview(out.reshape(-1))
    if mv.readonly:
        raise ValueError("dump_into needs a writable buffer, got a read-only one")
    host = _host_view(x)
    need = _wire.serialized_size(host.shape, _check_tensor(host), _check_bits_v1(bits))
    if len(mv) < need:
        raise ValueError(
            f"output buffer holds {len(mv)} bytes but this blob needs {need}: allocate "
            f"tq_jax.serialized_size(shape, dtype, bits) bytes."
        )
    header, chunks, norms16 = _encode_sections(host, bits, seed, block_vectors, device)
    return _write(header, chunks, norms16, mv)


# --------------------------------------------------------------------------- decode


def _np_dtype(dtype):
    return np.dtype(jnp.dtype(dtype))


def _decode_parsed(p: _wire.Parsed, out: np.ndarray, block_vectors, device) -> None:
    h = p.header
    dim, bits, n_vec = h.dim, h.bits, h.num_vectors
    cfg = _codec.CodecConfig(dim, bits, h.seed)
    devices = _device_list(device)
    tabs = [_codec.device_tables(cfg, d) for d in devices]
    dtype = jnp.dtype(out.dtype)
    flat_out = out.reshape(n_vec, dim)
    block = _block_vectors(dim, block_vectors)
    qjl_matrix = None
    if h.use_qjl:
        try:
            qjl_matrix = _rotation.qjl_matrix(dim, h.qjl_sketch_size, h.seed)
        except ValueError as e:
            raise _wire.BadFieldError(f"TQ01 QJL blob cannot be decoded: {e}") from None
        qjl_matrix = [jax.device_put(qjl_matrix, d) for d in devices]

    pending = []
    for i, start in enumerate(range(0, n_vec, block)):
        dev = devices[i % len(devices)]
        rot, cen, _, _ = tabs[i % len(devices)]
        nb = min(block, n_vec - start)
        rows = block if nb == block else bucket(nb)
        lo = start * dim * bits // 8  # exact: start is a multiple of 8
        hi = min(len(p.indices), lo + (nb * dim * bits + 7) // 8)
        stream = p.indices[lo:hi]
        want = rows * dim * bits // 8
        if len(stream) != want:
            padded = np.zeros(want, np.uint8)
            padded[: min(len(stream), want)] = stream[:want]
            stream = padded
        put = functools.partial(jax.device_put, device=dev)
        norms = put(_pad_rows(p.norms[start : start + nb], rows))
        if h.use_qjl:
            res = _decode_block_qjl(
                put(stream),
                norms,
                put(_pad_rows(p.sketch[start : start + nb], rows)),
                put(_pad_rows(p.residual_norms[start : start + nb], rows)),
                rot,
                cen,
                qjl_matrix[i % len(devices)],
                bits=bits,
                dtype=dtype,
            )
        else:
            res = _decode_block(put(stream), norms, rot, cen, bits=bits, dtype=dtype)
        pending.append((start, nb, res))
    for start, nb, res in pending:
        flat_out[start : start + nb] = np.asarray(res)[:nb]


def _check_out_dtype(dtype):
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype (e.g. jnp.bfloat16, jnp.float32), got {dtype!r}")
    return dt


def loads(blob, *, dtype=None, block_vectors: int | None = None, device=None) -> jax.Array:
    """Decode a TQ01 blob (any the reference writes, QJL included) into a JAX array.

    Args:
        blob: bytes-like object or 1-D uint8 numpy array.
        dtype: output dtype; default: the dtype recorded in the blob.
        block_vectors: vectors per kernel call (default: ~2**20 coordinates).
        device: JAX device for the computation and the result, or a sequence of
            devices that take blocks in turn (the result lands on the first).

    Returns:
        ``jax.Array`` of the blob's shape.

    Raises:
        WireError: the blob is malformed (one subclass per cause).
    """
    p = _wire.parse(blob)
    dt = _check_out_dtype(p.header.dtype if dtype is None else dtype)
    out = _aligned_empty(p.header.shape, _np_dtype(dt))
    _decode_parsed(p, out, block_vectors, device)
    # Zero-copy on CPU: `out` is 64-byte aligned. With several devices the result
    # lands on the first.
    return jax.device_put(out, _device_list(device)[0])


def load_into(blob, out: np.ndarray, *, block_vectors: int | None = None, device=None) -> _wire.Header:
    """Decode a TQ01 blob into an existing writable numpy array of any float dtype.

    ``out`` must have the blob's number of elements and its last axis must be a
    multiple of the blob's head_dim (so ``[..., H*D]`` receives ``[..., H, D]``).

    Returns:
        The blob's :class:`~tq_jax.wire.Header`.
    """
    p = _wire.parse(blob)
    h = p.header
    n_el = math.prod(h.shape)
    if not isinstance(out, np.ndarray) or not out.flags.writeable or not out.flags.c_contiguous:
        raise ValueError("load_into needs a writable C-contiguous numpy array")
    _check_out_dtype(out.dtype)
    if out.size != n_el or (out.ndim and out.shape[-1] % h.dim):
        raise ValueError(
            f"blob holds shape {h.shape} ({n_el} values) but the output has shape {out.shape}: "
            f"the destination must have the same number of values and a last axis that is a "
            f"multiple of head_dim={h.dim}."
        )
    _decode_parsed(p, out, block_vectors, device)
    return h
