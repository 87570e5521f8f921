"""Tensors ↔ TQ01 blobs: the block driver behind :func:`dumps` and :func:`loads`.

A tensor of any size is cut into blocks of ``block_vectors`` vectors (default: about
2**19 coordinates on CPU, 2**20 elsewhere, so intermediates stay a few MB whatever the
input size) and each
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

import collections
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax import _lru
from tq_jax import codec as _codec
from tq_jax import options as _options
from tq_jax import rotation as _rotation
from tq_jax import wire as _wire
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

DEFAULT_BLOCK_COORDS = 1 << 20  # coordinates per block: 4 MiB of float32 intermediates
# On the CPU backend half that, so each 2 MiB float32 intermediate stays in the CPU's
# cache between the kernel's passes (benchmarks/results/design_notes.md).
CPU_BLOCK_COORDS = 1 << 19
_MIN_BUCKET = 8  # a multiple of 8 vectors keeps every block's bit stream byte-aligned
_F16_MAX = float(np.finfo(np.float16).max)
_ALIGN = 64
# Blocks dispatched ahead per device: enough to overlap host copies with device work,
# few enough that a large input never has more than a few blocks' worth of copies alive.
_IN_FLIGHT = 4

def bucket(n: int) -> int:
    """Smallest size >= n of the form 2**k or 3 * 2**(k-1), and at least 8."""
    n = max(int(n), _MIN_BUCKET)
    p = 1 << (n - 1).bit_length()  # next power of two
    three_quarters = 3 * p // 4
    return three_quarters if three_quarters >= n and three_quarters % _MIN_BUCKET == 0 else p


def _block_vectors(dim: int, block_vectors: int | None, devices=()) -> int:
    if block_vectors is None:
        coords = CPU_BLOCK_COORDS if devices and all(_is_cpu(d) for d in devices) else DEFAULT_BLOCK_COORDS
        block_vectors = max(_MIN_BUCKET, coords // dim)
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


def _default_device() -> jax.Device:
    """JAX's default device (``jax.default_device`` contexts included)."""
    d = jax.config.jax_default_device
    if isinstance(d, str):  # a platform name
        return jax.devices(d)[0]
    return d if d is not None else jax.devices()[0]


def _is_cpu(device) -> bool:
    return (device or _default_device()).platform == "cpu"


class _Staging:
    """Aligned host buffers, reused in turn, through which blocks reach the kernels.

    Blocks are handed to the jitted kernels as numpy arrays: JAX's C++ dispatch
    transfers them with the call, far cheaper than a separate ``jax.device_put``.
    XLA's CPU backend shares a host buffer without copying only when it is 64-byte
    aligned; numpy's large arrays are usually 16-byte aligned, so such blocks (and
    padded tails) are copied here, by numpy, which copies faster than XLA does, into
    one of ``slots`` buffers (benchmarks/results/design_notes.md has the timings). A
    slot is rewritten only ``slots`` puts later, when the block driver has collected
    (hence finished) the kernel that read it.
    """

    def __init__(self, slots: int):
        self.slots = slots
        self.bufs: dict = {}
        self.count = 0
        self.cpu: dict = {}

    def put(self, block: np.ndarray, rows: int, device) -> np.ndarray:
        cpu = self.cpu.get(device)
        if cpu is None:
            cpu = self.cpu[device] = _is_cpu(device)
        aligned = block.ctypes.data % _ALIGN == 0 and block.flags.c_contiguous
        if not cpu or (aligned and rows == block.shape[0]):
            return _pad_rows(block, rows)
        slot = self.count % self.slots
        self.count += 1
        shape = (rows,) + block.shape[1:]
        buf = self.bufs.get(slot)
        if buf is None or buf.shape != shape or buf.dtype != block.dtype:
            buf = self.bufs[slot] = _aligned_empty(shape, block.dtype)
        n = block.shape[0]
        buf[:n] = block
        buf[n:] = 0
        return buf


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
    block = _block_vectors(flat.shape[1], block_vectors, devices)
    staging = _Staging(_IN_FLIGHT * len(devices) + 1)  # see _Staging: one more than in flight

    def put(start, nb, rows, device):
        return staging.put(flat[start : start + nb], rows, device)

    return _encode_blocks(put, flat.shape[0], cfg, block, devices, np.asarray)


def _encode_blocks(put, n_vec: int, cfg: _codec.CodecConfig, block: int, devices, fetch):
    """Dispatch ``codec.encode_block`` over the blocks ``put(start, nb, rows, device)``
    returns (``rows`` = ``block``, or the last block's bucket), devices in turn, at most
    ``_IN_FLIGHT`` per device ahead of the results, which ``fetch`` brings to the host:
    ([stream chunks], norms f32 (n,))."""
    dim, bits = cfg.dim, cfg.bits
    norms = np.empty(n_vec, np.float32)
    chunks = []
    pending = collections.deque()

    def collect():
        start, nb, (stream, nrm) = pending.popleft()
        used = nb * dim * bits
        chunk = fetch(stream).reshape(-1)[: _codec.stream_nbytes(cfg, nb)]  # a view
        if used % 8:  # the last byte also holds padding rows' bits: TQ01 wants them zero
            chunk = chunk.copy()
            chunk[-1] &= (1 << (used % 8)) - 1
        chunks.append(chunk)
        norms[start : start + nb] = fetch(nrm)[:nb]

    for i, start in enumerate(range(0, n_vec, block)):
        nb = min(block, n_vec - start)
        rows = block if nb == block else bucket(nb)
        device = devices[i % len(devices)]
        pending.append((start, nb, _codec.encode_block(put(start, nb, rows, device), cfg, device)))
        if len(pending) > _IN_FLIGHT * len(devices):
            collect()
    while pending:
        collect()
    return chunks, norms


def _group_view(host: np.ndarray, header: _wire.Header, g, lo, hi) -> np.ndarray:
    """The vectors of one segment as a C-contiguous (n, d) view (no copy)."""
    if g is None:
        return host.reshape(-1, header.dim)
    return host[g, lo:hi].reshape(-1, header.dim)


def _raw_bytes(host: np.ndarray, header: _wire.Header) -> list:
    return [
        memoryview(np.ascontiguousarray(host[g, lo:hi]).reshape(-1).view(np.uint8)) for g, lo, hi in header.raw_ranges()
    ]


# --------------------------------------------------------------------------- device-resident path
#
# Data on an accelerator stays there. A jax.Array on one device is encoded there: one
# program cuts its blocks on the device (the last one padded to its bucket, so every
# block has the shape the host path gives it and the bytes are the same), they run
# through the host path's block kernels, and only the packed results and the raw
# layers' bytes come to the host. ``loads(device=d)`` sends the blob's sections to d,
# decodes every block there and assembles the tensor there.
#
# On the CPU backend a device's memory is host memory: the host pipeline reads a CPU
# jax.Array in place (``np.asarray`` is a view) and its 64-byte-aligned output becomes
# the result without a copy, so it already keeps the data where it lives, and it
# pipelines blocks with bounded memory. CPU devices therefore take it; tests set
# ``_RESIDENT_ON_CPU`` to run the accelerator path on CPU devices.
# (benchmarks/results/device_path_cpu.md has the measurements behind this choice.)

_RESIDENT_ON_CPU = False


def _resident(device) -> bool:
    """Whether data for ``device`` (None: JAX's default) takes the device-resident path."""
    return _RESIDENT_ON_CPU or not _is_cpu(device)


# Compiled programs keyed by a blob's layout and shape (a decoder's come from untrusted
# headers): bounded, least recently used first.
_RESIDENT_PROGRAMS = _lru.LRU("device-resident programs", max_entries=32)
CACHES = {"device-resident programs": _RESIDENT_PROGRAMS}


def cache_stats() -> dict:
    """``{name: tq_jax._lru.Stats}`` of the blob layer's caches (see also codec's)."""
    return {name: c.stats() for name, c in CACHES.items()}


def clear_caches() -> None:
    """Empty the blob layer's caches (programs are rebuilt, identically, on demand)."""
    for c in CACHES.values():
        c.clear()


def _segment_configs(header: _wire.Header, seed: int, rotation: str, norm_correction: bool = False) -> tuple:
    return tuple(
        _codec.CodecConfig(header.dim, bits, seed, rotation, norm_correction) for _, bits, _, _, _ in header.segments()
    )


def _segment_vectors(x, g, lo, hi, dim):
    return x.reshape(-1, dim) if g is None else x[g, lo:hi].reshape(-1, dim)


@_RESIDENT_PROGRAMS.memoize
def _resident_encoder(header: _wire.Header, cfgs: tuple, block: int, device):
    """The encoder of ``header``'s layout on ``device``: x (a jax.Array there) →
    ([(stream chunks, norms)] per segment, [raw layer bytes]).

    One jitted program cuts ``x`` into every segment's blocks (the last one padded to
    its bucket) and the raw layers' bytes; the blocks then run through the block
    kernels the host path uses, a few in flight, and only their packed results come back.
    """
    segments = header.segments()
    raw_ranges = header.raw_ranges() if header.version == _wire.VERSION_2 else []

    def cut(x):
        blocks = []
        for g, _, lo, hi, n_vec in segments:
            v = _segment_vectors(x, g, lo, hi, header.dim)
            seg = []
            for start in range(0, n_vec, block):
                nb = min(block, n_vec - start)
                b = v[start : start + nb]
                seg.append(b if nb == block else jnp.pad(b, ((0, bucket(nb) - nb), (0, 0))))
            blocks.append(seg)
        raw = [jax.lax.bitcast_convert_type(x[g, lo:hi], jnp.uint8).reshape(-1) for g, lo, hi in raw_ranges]
        return blocks, raw

    placed = jax.sharding.SingleDeviceSharding(device)
    cut = jax.jit(cut, in_shardings=placed, out_shardings=placed)

    def encode(x):
        blocks, raw = cut(x)
        encoded = []
        for seg, cfg, (_, _, _, _, n_vec) in zip(blocks, cfgs, segments):
            put = functools.partial(lambda seg, start, nb, rows, _: seg[start // block], seg)
            encoded.append(_encode_blocks(put, n_vec, cfg, block, [device], jax.device_get))
        return encoded, jax.device_get(raw)

    return encode


def _encode_resident(x, header: _wire.Header, options: _options.Options, block_vectors, device):
    """``x`` (a jax.Array) encoded on ``device``: ([(stream chunks, norms)] per segment, raw pieces)."""
    if device not in x.devices():
        x = jax.device_put(x, device)  # device to device
    cfgs = _segment_configs(header, options.seed, options.rotation)
    block = _block_vectors(header.dim, block_vectors, [device])
    encoded, raw = _resident_encoder(header, cfgs, block, device)(x)
    return encoded, [memoryview(r) for r in raw]


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
    if dev is not None and _resident(dev):
        dtype = _check_tensor(x)
        shape = tuple(x.shape)
        header = options.header(shape, dtype)  # validates the shape for the options
        encoded, raw = _encode_resident(x, header, options, block_vectors, dev)
    else:
        host = _host_view(x)
        dtype = _check_tensor(host)
        host = np.ascontiguousarray(host)
        shape = host.shape
        header = options.header(shape, dtype)  # validates the shape for the options
        devices = _device_list(device if dev is None else dev)
        encoded = []
        for g, bits, lo, hi, _ in header.segments():
            cfg = _codec.CodecConfig(header.dim, bits, options.seed, options.rotation)
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
            ranges, codes = _codec.encode_log_norms(norms, header.norm_groups(n_vec), header.norm_bits)
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


def _decode_blocks(stream, norms, cfg, n_vec: int, block: int, dtype, devices, put, qjl=None):
    """Dispatch ``codec.decode_block`` over one segment's blocks, devices in turn,
    yielding ``(start, nb, result)`` as each is dispatched (results not waited for).

    ``put(piece, nbytes, device)`` hands a block's stream bytes to the kernel,
    zero-padded to ``nbytes`` (the block's bucket); ``qjl`` is ``(sketch,
    residual_norms, [matrix per device])`` for QJL blobs. A segment of no vectors
    dispatches nothing, so builds no rotation (a 50-byte blob may name a huge one).
    """
    dim, bits = cfg.dim, cfg.bits
    for i, start in enumerate(range(0, n_vec, block)):
        dev = devices[i % len(devices)]
        nb = min(block, n_vec - start)
        rows = block if nb == block else bucket(nb)
        lo = start * dim * bits // 8  # exact: start is a multiple of 8
        hi = min(len(stream), lo + (nb * dim * bits + 7) // 8)
        # numpy arguments follow the tables, which are committed to `dev`
        piece = put(stream[lo:hi], rows * dim * bits // 8, dev)
        nrm = _pad_rows(norms[start : start + nb], rows)
        block_qjl = None
        if qjl is not None:
            sketch, residual, matrices = qjl
            block_qjl = (
                _pad_rows(sketch[start : start + nb], rows),
                _pad_rows(residual[start : start + nb], rows),
                matrices[i % len(devices)],
            )
        yield start, nb, _codec.decode_block(piece, nrm, cfg, dtype, dev, block_qjl)


def _decode_vectors(stream, norms, out_flat, cfg, block_vectors, devices, qjl=None):
    """Decode one segment's stream + norms into the host array ``out_flat`` (n, d),
    at most ``_IN_FLIGHT`` blocks per device ahead of the copies out."""
    n_vec, dim = out_flat.shape
    block = _block_vectors(dim, block_vectors, devices)
    pending = collections.deque()
    staging = _Staging(_IN_FLIGHT * len(devices) + 1)  # see _Staging: one more than in flight

    def collect():
        start, nb, res = pending.popleft()
        out_flat[start : start + nb] = np.asarray(res).reshape(-1, dim)[:nb]  # a view

    for item in _decode_blocks(stream, norms, cfg, n_vec, block, jnp.dtype(out_flat.dtype), devices, staging.put, qjl):
        pending.append(item)
        if len(pending) > _IN_FLIGHT * len(devices):
            collect()
    while pending:
        collect()


def _segment_inputs(p: _wire.Parsed, devices):
    """Per segment ``(config, stream, float32 norms)`` of a parsed blob, and the QJL
    inputs (``None`` unless the blob has them) with its matrix on each device."""
    h = p.header
    qjl = None
    if h.use_qjl and h.num_vectors:
        try:
            m = _rotation.qjl_matrix(h.dim, h.qjl_sketch_size, h.seed)
        except ValueError as e:
            raise _wire.BadFieldError(f"TQ01 QJL blob cannot be decoded: {e}") from None
        qjl = (p.sketch, p.residual_norms, [jax.device_put(m, d) for d in devices])
    segments = []
    for (_, bits, _, _, _), stream, norms in zip(h.segments(), p.indices, p.norms):
        if isinstance(norms, _wire.NormCodes):
            norms = _codec.decode_log_norms(norms.ranges, norms.codes, norms.bits, norms.count)
        segments.append((_codec.CodecConfig(h.dim, bits, h.seed, h.rotation, h.norm_correction), stream, norms))
    return segments, qjl


def _decode_parsed(p: _wire.Parsed, out: np.ndarray, block_vectors, device) -> None:
    h = p.header
    devices = _device_list(device)
    out = out.reshape(h.shape)
    segments, qjl = _segment_inputs(p, devices)
    for (g, _, lo, hi, _), (cfg, stream, norms) in zip(h.segments(), segments):
        _decode_vectors(stream, norms, _group_view(out, h, g, lo, hi), cfg, block_vectors, devices, qjl)
    src_dt = _np_dtype(jnp.dtype(h.dtype))
    off = 0
    for g, lo, hi in h.raw_ranges():
        part = out[g, lo:hi]
        n = part.size * src_dt.itemsize
        part[...] = p.raw[off : off + n].view(src_dt).reshape(part.shape)
        off += n


# A blob decoded onto one device: its blocks run through the same block kernels as
# the host path, every one dispatched at once (their results are the output, so
# nothing is gained by waiting), and one program per layout assembles them with the
# raw layers into the tensor, on the device. No host output buffer is filled.


@_RESIDENT_PROGRAMS.memoize
def _resident_assembler(header: _wire.Header, dtype, block: int, device):
    """The jitted program (block results per segment, raw bytes) → the blob's tensor on ``device``."""
    segments = tuple(header.segments())
    raw_ranges = tuple(header.raw_ranges())
    src = jnp.dtype(header.dtype)
    dim = header.dim

    def assemble(blocks, raw):
        out = jnp.zeros(header.shape, dtype)
        for (g, _, lo, hi, n), seg in zip(segments, blocks):
            if n == 0:
                continue
            v = jnp.concatenate([b.reshape(-1, dim) for b in seg])[:n] if len(seg) > 1 else seg[0].reshape(-1, dim)[:n]
            if g is None:
                out = v.reshape(header.shape)
            else:
                out = out.at[g, lo:hi].set(v.reshape(out[g, lo:hi].shape))
        off = 0
        for g, lo, hi in raw_ranges:
            part_shape = out[g, lo:hi].shape
            count = math.prod(part_shape) * src.itemsize
            vals = jax.lax.bitcast_convert_type(raw[off : off + count].reshape(-1, src.itemsize), src)
            out = out.at[g, lo:hi].set(vals.reshape(part_shape).astype(dtype))
            off += count
        return out

    placed = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(assemble, in_shardings=placed, out_shardings=placed)


def _decode_resident(p: _wire.Parsed, dtype, block_vectors, device) -> jax.Array:
    """The blob's tensor decoded on ``device`` and born there."""
    h = p.header
    block = _block_vectors(h.dim, block_vectors, [device])
    segments, qjl = _segment_inputs(p, [device])
    results = []
    for (_, _, _, _, n), (cfg, stream, norms) in zip(h.segments(), segments):
        put = lambda piece, nbytes, _: _pad_rows(piece, nbytes)  # noqa: E731 (no staging: nothing is reused)
        blocks = _decode_blocks(stream, norms, cfg, n, block, dtype, [device], put, qjl)
        results.append(tuple(res for _, _, res in blocks))
    raw = jax.device_put(p.raw if len(p.raw) else np.zeros(0, np.uint8), device)
    return _resident_assembler(h, dtype, block, device)(tuple(results), raw)


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
    target = _default_device() if device is None else device
    if isinstance(target, jax.Device) and _resident(target):  # decoded where it will live
        return _decode_resident(p, dt, block_vectors, target)
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
