"""Tensors ↔ TQ01 blobs: :func:`dumps`, :func:`dump_into`, :func:`serialized_size`,
:func:`loads`, :func:`load_into`.

The host pipeline: a tensor's vectors run block by block through the codec
(:mod:`tq_jax.blocks` cuts, pads to bucket sizes and dispatches them) and the codec's
output is written through :mod:`tq_jax.wire`'s write API. A ``jax.Array`` on an
accelerator (and ``loads(device=)`` for one) takes the device-resident path instead
(:mod:`tq_jax.resident`); the bytes do not depend on the path.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax import blocks as _blocks
from tq_jax import codec as _codec
from tq_jax import norms as _norms
from tq_jax import options as _options
from tq_jax import resident as _resident
from tq_jax import wire as _wire
from tq_jax.blocks import DEFAULT_BLOCK_COORDS, bucket  # re-exported: part of blob's API
from tq_jax.resident import CACHES, cache_stats, clear_caches  # noqa: F401 (blob.CACHES: its compiled programs)
from tq_jax.wire import NORM_OVERFLOW, NormOverflowError  # the format's limit; re-exported here

__all__ = [
    "dumps",
    "dump_into",
    "loads",
    "load_into",
    "NormOverflowError",
    "bucket",
    "serialized_size",
    "DEFAULT_BLOCK_COORDS",
]



def compiled_programs() -> int:
    """Block programs the driver has dispatched so far (encode + decode), for tests
    and long-running checks: :func:`tq_jax.codec.compiled_programs`."""
    return _codec.compiled_programs()


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


def _check_tensor(x: np.ndarray) -> str:
    try:
        dtype = _wire.dtype_name(x.dtype)
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


def _encode_vectors(flat: np.ndarray, cfg: _codec.CodecConfig, block_vectors, devices):
    """Run the codec over host vectors ``flat`` (n, d) block by block: ([stream chunks], norms f32 (n,))."""
    block = _blocks.block_vectors_for(flat.shape[1], block_vectors, devices)
    staging = _blocks.Staging(_blocks.IN_FLIGHT * len(devices) + 1)  # see _blocks.Staging: one more than in flight

    def put(start, nb, rows, device):
        return staging.put(flat[start : start + nb], rows, device)

    return _blocks.encode_blocks(put, flat.shape[0], cfg, block, devices, np.asarray)


def _group_view(host: np.ndarray, header: _wire.Header, g, lo, hi) -> np.ndarray:
    """The vectors of one segment as a C-contiguous (n, d) view (no copy)."""
    if g is None:
        return host.reshape(-1, header.dim)
    return host[g, lo:hi].reshape(-1, header.dim)


def _raw_bytes(host: np.ndarray, header: _wire.Header) -> list:
    return [
        memoryview(np.ascontiguousarray(host[g, lo:hi]).reshape(-1).view(np.uint8)) for g, lo, hi in header.raw_ranges()
    ]


def _norm_overflow(norms: list) -> tuple[int, int, float]:
    count, total, largest = 0, 0, 0.0
    for n in norms:
        big = np.isfinite(n) & (n >= 65520.0)  # rounds to inf in float16
        count += int(big.sum())
        total += n.size
        if big.any():
            largest = max(largest, float(n[big].max()))
    return count, total, largest


def _single_device(x, device):
    """The one device a ``jax.Array`` input is encoded on (``device``, else the one it
    lives on), or None: numpy input, a sharded array, a device sequence."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    if device is not None and not isinstance(device, jax.Device):
        return None
    try:
        held = x.devices()
    except Exception:  # a deleted or otherwise unplaced array: the host path says why
        return None
    if len(held) != 1:
        return None
    return device if device is not None else next(iter(held))


def _encode(x, options: _options.Options, block_vectors, device):
    """Encode ``x`` under ``options``: (header, ``wire.pieces`` of the blob)."""
    dev = _single_device(x, device)
    if dev is not None and _resident.takes(dev):
        dtype = _check_tensor(x)
        shape = tuple(x.shape)
        header = options.header(shape, dtype)  # validates the shape for the options
        encoded, raw = _resident.encode(x, header, options, block_vectors, dev)
    else:
        host = _host_view(x)
        dtype = _check_tensor(host)
        host = np.ascontiguousarray(host)
        shape = host.shape
        header = options.header(shape, dtype)  # validates the shape for the options
        devices = _blocks.device_list(device if dev is None else dev)
        encoded = []
        for g, _, lo, hi, _ in header.segments():
            cfg = options.codec_config(header.dim, 1 if g == 1 else 0)  # g None: one group, key_bits
            encoded.append(_encode_vectors(_group_view(host, header, g, lo, hi), cfg, block_vectors, devices))
        raw = _raw_bytes(host, header) if header.version == _wire.VERSION_2 else []

    if not options.norm_bits:
        count, total, largest = _norm_overflow([n for _, n in encoded])
        if count and options.norm_dtype == "float16":
            raise NormOverflowError(NORM_OVERFLOW.format(count=count, total=total, largest=largest))
        if count or options.norm_dtype == "float32":
            header = options.header(shape, dtype, norm_dtype="float32")
    ndt = np.float32 if header.norm_dtype == "float32" else np.float16
    norm_sections = []
    for (_, norms), (_, _, _, _, n_vec) in zip(encoded, header.segments()):
        if header.norm_bits:
            ranges, codes = _norms.encode_log_norms(norms, header.norm_groups(n_vec), header.norm_bits)
            norm_sections.append(_wire.NormCodes(ranges, codes, header.norm_bits, n_vec))
        else:
            norm_sections.append(norms.astype(ndt))
    sections = _wire.Sections([chunks for chunks, _ in encoded], norm_sections, tuple(raw))
    return header, _wire.pieces(header, sections)  # the CRC32 trailer included when asked for


def _resolve(bits, options, kwargs: dict) -> _options.Options:
    """The one :class:`~tq_jax.Options` of a call: ``options=``, an Options passed as
    ``bits``, or ``bits`` plus keyword fields."""
    if isinstance(bits, _options.Options):
        if options is not None:
            raise ValueError("pass the Options once: as `options=`, not also as `bits`")
        bits, options = None, bits
    if options is not None:
        if not isinstance(options, _options.Options):
            raise TypeError(
                f"`options` must be a tq_jax.Options, got {type(options).__name__}: build one with "
                f"tq_jax.Options.make(bits, ...) or pass the fields as keywords instead."
            )
        if bits is not None or kwargs:
            given = (["bits"] if bits is not None else []) + sorted(kwargs)
            raise ValueError(
                f"pass either an Options object or bits/keyword options, not both (got Options and {given}): "
                f"use options.replace(...) to change a field."
            )
        return options
    return _options.Options.make(bits, **kwargs)


def serialized_size(shape, dtype, bits=None, *, options=None, **kwargs) -> int:
    """Exact blob length for a tensor of ``shape``/``dtype`` under ``bits``/``options``.

    Computed from the layout alone. With ``norm_dtype="auto"`` (the default) this is
    the length when every norm fits float16; an overflowing tensor is written with
    float32 norms instead (2 more bytes per vector). Pin ``norm_dtype`` when the size
    must be known in advance (the LMCache bridge does).

    Examples:
        >>> serialized_size((2, 32, 256, 8, 128), "bfloat16", 4)
        8650831
    """
    return _resolve(bits, options, kwargs).serialized_size(shape, dtype)


def dumps(x, bits=None, *, options=None, block_vectors: int | None = None, device=None, **kwargs) -> bytes:
    """Encode a tensor into a TQ01 blob.

    With the reference's settings (one ``bits`` of 2, 3, 4, 6 or 8, Haar rotation,
    norms that fit float16) the blob is version 1, byte-compatible with
    ``lmcache-turbo-quant-serde``; any other setting writes version 2.

    Args:
        x: numpy or jax array ``(..., head_dim)`` of bfloat16, float16 or float32. With
            per-group bits or raw layers: ``[2 (K, V) or 1, layers, ..., head_dim]``.
        bits: bits per coordinate for every vector (an :class:`~tq_jax.Options` here
            is taken as ``options``).
        options: a :class:`~tq_jax.Options`; then pass neither ``bits`` nor fields.
        block_vectors: vectors per kernel call (default: ~2**19 coordinates on CPU, 2**20 elsewhere).
        device: JAX device to compute on (default: where a single-device
            ``jax.Array`` lives, else JAX's default device), or a sequence of
            devices that take blocks in turn; the bytes do not depend on where or
            on how many devices the work runs. A ``jax.Array`` on an accelerator
            is cut into blocks and encoded there; only the packed result comes to
            the host.
        **kwargs: :class:`~tq_jax.Options` fields: ``seed`` (42), ``key_bits``,
            ``value_bits``, ``skip_first_layers``, ``skip_last_layers``, ``rotation``
            ("haar"), ``norm_dtype`` ("auto"), ``norm_correction``, ``checksum``, ``norm_bits`` (0).

    Returns:
        The blob.

    Raises:
        ValueError: unsupported bits/dtype/shape/option.
        NormOverflowError: ``norm_dtype="float16"`` and a finite norm exceeds 65504.
    """
    header, pieces = _encode(x, _resolve(bits, options, kwargs), block_vectors, device)
    out = b"".join(pieces)  # one allocation, no extra copy
    if len(out) != _wire.blob_nbytes(header):
        raise AssertionError(f"tq_jax wrote {len(out)} bytes, its header implies {_wire.blob_nbytes(header)}")
    return out


def dump_into(x, out, bits=None, *, options=None, block_vectors: int | None = None, device=None, **kwargs) -> int:
    """Like :func:`dumps`, but write into ``out`` (a writable bytes-like/uint8 buffer).

    Nothing is written unless the whole blob fits and encoding succeeded.

    Returns:
        The number of bytes written.

    Raises:
        ValueError: ``out`` is too small (the message gives the size needed), or as
            :func:`dumps`.
    """
    mv = memoryview(out.reshape(-1)) if isinstance(out, np.ndarray) else memoryview(out).cast("B")
    if mv.readonly:
        raise ValueError("dump_into needs a writable buffer, got a read-only one")
    opts = _resolve(bits, options, kwargs)
    arr = x if isinstance(x, (np.ndarray, jax.Array)) else _host_view(x)  # a jax.Array stays put
    need = opts.serialized_size(arr.shape, _check_tensor(arr))
    if len(mv) < need:
        raise ValueError(
            f"output buffer holds {len(mv)} bytes but this blob needs {need}: allocate "
            f"tq_jax.serialized_size(shape, dtype, ...) bytes."
        )
    header, pieces = _encode(arr, opts, block_vectors, device)
    if _wire.blob_nbytes(header) > len(mv):  # "auto" norms grew to float32
        raise ValueError(
            f"output buffer holds {len(mv)} bytes but this blob needs {_wire.blob_nbytes(header)}: some "
            f"norms overflow float16, so they are stored as float32. Pin norm_dtype to size buffers in advance."
        )
    return _wire.write_into(pieces, mv)


# --------------------------------------------------------------------------- decode


def _np_dtype(dtype):
    return np.dtype(jnp.dtype(dtype))


def _decode_vectors(stream, norms, out_flat, cfg, block_vectors, devices, qjl=None):
    """Decode one segment's stream + norms into the host array ``out_flat`` (n, d),
    at most ``_blocks.IN_FLIGHT`` blocks per device ahead of the copies out."""
    n_vec, dim = out_flat.shape
    block = _blocks.block_vectors_for(dim, block_vectors, devices)
    pending = collections.deque()
    staging = _blocks.Staging(_blocks.IN_FLIGHT * len(devices) + 1)  # see _blocks.Staging: one more than in flight

    def collect():
        start, nb, res = pending.popleft()
        out_flat[start : start + nb] = np.asarray(res).reshape(-1, dim)[:nb]  # a view

    for item in _blocks.decode_blocks(stream, norms, cfg, n_vec, block, jnp.dtype(out_flat.dtype), devices, staging.put, qjl):
        pending.append(item)
        if len(pending) > _blocks.IN_FLIGHT * len(devices):
            collect()
    while pending:
        collect()


def _decode_parsed(p: _wire.Parsed, out: np.ndarray, block_vectors, device) -> None:
    h = p.header
    devices = _blocks.device_list(device)
    out = out.reshape(h.shape)
    segments, qjl = _blocks.segment_inputs(p, devices)
    for (g, _, lo, hi, _), (cfg, stream, norms) in zip(h.segments(), segments):
        _decode_vectors(stream, norms, _group_view(out, h, g, lo, hi), cfg, block_vectors, devices, qjl)
    src_dt = _np_dtype(jnp.dtype(h.dtype))
    off = 0
    for g, lo, hi in h.raw_ranges():
        part = out[g, lo:hi]
        n = part.size * src_dt.itemsize
        part[...] = p.raw[off : off + n].view(src_dt).reshape(part.shape)
        off += n


def _check_out_dtype(dtype):
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype (e.g. jnp.bfloat16, jnp.float32), got {dtype!r}")
    return dt


def loads(blob, *, dtype=None, block_vectors: int | None = None, device=None) -> jax.Array:
    """Decode a TQ01 blob (version 1 or 2; every blob the reference writes, QJL included).

    Args:
        blob: bytes-like object or 1-D uint8 numpy array.
        dtype: output dtype; default: the dtype recorded in the blob.
        block_vectors: vectors per kernel call (default: ~2**19 coordinates on CPU, 2**20 elsewhere).
        device: JAX device for the computation and the result (default: JAX's
            default device), or a sequence of devices that take blocks in turn
            (the result lands on the first). On an accelerator the blob's sections
            go to the device and the tensor is decoded and assembled there, with
            no host output buffer; on the CPU backend the result is the aligned
            host buffer the blocks were decoded into, adopted without a copy.

    Returns:
        ``jax.Array`` of the blob's shape.

    Raises:
        WireError: the blob is malformed or corrupt (one subclass per cause).
    """
    p = _wire.parse(blob)
    dt = _check_out_dtype(p.header.dtype if dtype is None else dtype)
    target = _blocks.default_device() if device is None else device
    if isinstance(target, jax.Device) and _resident.takes(target):  # decoded where it will live
        return _resident.decode(p, dt, block_vectors, target)
    out = _blocks.aligned_empty(p.header.shape, _np_dtype(dt))
    _decode_parsed(p, out, block_vectors, device)
    # Zero-copy on CPU: `out` is 64-byte aligned. With several devices the result
    # lands on the first.
    return jax.device_put(out, _blocks.device_list(device)[0])


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
