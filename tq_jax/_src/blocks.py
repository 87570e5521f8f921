"""The block driver: how the blob layer cuts vectors into blocks and runs the codec on them.

A tensor of any size is cut into blocks of ``block_vectors`` vectors (default: about
2**19 coordinates on CPU, 2**20 elsewhere, so intermediates stay a few MB whatever the
input size) and each block runs through one jit-compiled kernel
(:func:`tq_jax._src.codec.encode_block` / :func:`tq_jax._src.codec.decode_block`). A block
shorter than that is padded up to a *bucket* — the next size of the form 2**k or
3·2**(k-1), at least 8 — so a stream of chunks of every length compiles a few
programs, not one per length: LMCache's last chunk of a prompt is short, and
recompiling for it would cost far more than the padding (at most 1/3 of a partial
block).

Blocks are dispatched asynchronously, devices in turn, at most :data:`IN_FLIGHT` per
device ahead of the results, so host copies overlap device work. On the CPU backend,
64-byte-aligned host buffers are shared with XLA without a copy (:class:`Staging`).

Used by :mod:`tq_jax._src.blob` (the host pipeline) and :mod:`tq_jax._src.resident` (the
per-block device path); neither re-derives what is decided here. What to encode — the
segments, their codecs and sizes — comes from a :class:`tq_jax._src.plan.Plan`; the device
program (:mod:`tq_jax._src.program`) cuts the same blocks inside one compiled program.
"""

from __future__ import annotations

import collections
import math

import jax
import numpy as np

from tq_jax._src import codec as _codec
from tq_jax._src import norms as _norms
from tq_jax._src import rotation as _rotation
from tq_jax._src import wire as _wire

__all__ = [
    "DEFAULT_BLOCK_COORDS",
    "CPU_BLOCK_COORDS",
    "MIN_BUCKET",
    "ALIGN",
    "IN_FLIGHT",
    "bucket",
    "block_vectors_for",
    "aligned_empty",
    "pad_rows",
    "default_device",
    "is_cpu",
    "device_list",
    "Staging",
    "encode_blocks",
    "decode_blocks",
    "segment_inputs",
    "rows",
    "encode_plan",
    "encode",
    "decode_plan",
]

DEFAULT_BLOCK_COORDS = 1 << 20  # coordinates per block: 4 MiB of float32 intermediates
# On the CPU backend half that, so each 2 MiB float32 intermediate stays in the CPU's
# cache between the kernel's passes (benchmarks/results/design_notes.md).
CPU_BLOCK_COORDS = 1 << 19
MIN_BUCKET = 8  # a multiple of 8 vectors keeps every block's bit stream byte-aligned
ALIGN = 64
# Blocks dispatched ahead per device: enough to overlap host copies with device work,
# few enough that a large input never has more than a few blocks' worth of copies alive.
IN_FLIGHT = 4


def bucket(n: int) -> int:
    """Smallest size >= n of the form 2**k or 3 * 2**(k-1), and at least 8."""
    n = max(int(n), MIN_BUCKET)
    p = 1 << (n - 1).bit_length()  # next power of two
    three_quarters = 3 * p // 4
    return three_quarters if three_quarters >= n and three_quarters % MIN_BUCKET == 0 else p


def block_vectors_for(dim: int, block_vectors: int | None, devices=()) -> int:
    """Vectors per block for ``dim``: ``block_vectors`` (None: the default for ``devices``)
    rounded down to a bucket size, so full blocks and short tails share programs."""
    if block_vectors is None:
        coords = CPU_BLOCK_COORDS if devices and all(is_cpu(d) for d in devices) else DEFAULT_BLOCK_COORDS
        block_vectors = max(MIN_BUCKET, coords // dim)
    block_vectors = int(block_vectors)
    if block_vectors < MIN_BUCKET:
        raise ValueError(f"block_vectors must be >= {MIN_BUCKET}, got {block_vectors}")
    # Round down to a bucket size so full blocks and short tails share programs.
    p = 1 << (block_vectors.bit_length() - 1)
    three_halves = 3 * p // 2
    return three_halves if three_halves <= block_vectors and three_halves % MIN_BUCKET == 0 else p


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is 64-byte aligned."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + nbytes].view(dtype).reshape(shape)


def device_list(device) -> list:
    """``None`` (JAX's default device), one device, or a sequence of devices."""
    if device is None or isinstance(device, jax.Device):
        return [device]
    devices = list(device)
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise ValueError(f"device must be a jax.Device, a non-empty sequence of them, or None; got {device!r}")
    return devices


def pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` with zero rows appended up to ``rows`` (``a`` itself when it has them)."""
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows,) + a.shape[1:], a.dtype)
    out[: a.shape[0]] = a
    return out


def default_device() -> jax.Device:
    """JAX's default device (``jax.default_device`` contexts included)."""
    d = jax.config.jax_default_device
    if isinstance(d, str):  # a platform name
        return jax.devices(d)[0]
    return d if d is not None else jax.devices()[0]


def is_cpu(device) -> bool:
    """Whether ``device`` (None: JAX's default; or a platform name, ``"cpu"``, ``"tpu"``,
    for a program built to be lowered for that platform) is a CPU device."""
    if isinstance(device, str):
        return device == "cpu"
    return (device or default_device()).platform == "cpu"


class Staging:
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
            cpu = self.cpu[device] = is_cpu(device)
        aligned = block.ctypes.data % ALIGN == 0 and block.flags.c_contiguous
        if not cpu or (aligned and rows == block.shape[0]):
            return pad_rows(block, rows)
        slot = self.count % self.slots
        self.count += 1
        shape = (rows,) + block.shape[1:]
        buf = self.bufs.get(slot)
        if buf is None or buf.shape != shape or buf.dtype != block.dtype:
            buf = self.bufs[slot] = aligned_empty(shape, block.dtype)
        n = block.shape[0]
        buf[:n] = block
        buf[n:] = 0
        return buf


def encode_blocks(put, n_vec: int, cfg: _codec.CodecConfig, block: int, devices, fetch):
    """Dispatch ``codec.encode_block`` over the blocks ``put(start, nb, rows, device)``
    returns (``rows`` = ``block``, or the last block's bucket), devices in turn, at most
    ``IN_FLIGHT`` per device ahead of the results, which ``fetch`` brings to the host:
    ([stream chunks], norms f32 (n,))."""
    dim, bits = cfg.dim, cfg.bits
    norms = np.empty(n_vec, np.float32)
    chunks = []
    pending = collections.deque()

    def collect():
        start, nb, (stream, nrm) = pending.popleft()
        used = nb * dim * bits
        chunk = fetch(stream).reshape(-1)[: (used + 7) // 8]  # a view: the block's stream
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
        if len(pending) > IN_FLIGHT * len(devices):
            collect()
    while pending:
        collect()
    return chunks, norms


def decode_blocks(stream, norms, cfg, n_vec: int, block: int, dtype, devices, put, qjl=None):
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
        nrm = pad_rows(norms[start : start + nb], rows)
        block_qjl = None
        if qjl is not None:
            sketch, residual, matrices = qjl
            block_qjl = (
                pad_rows(sketch[start : start + nb], rows),
                pad_rows(residual[start : start + nb], rows),
                matrices[i % len(devices)],
            )
        yield start, nb, _codec.decode_block(piece, nrm, cfg, dtype, dev, block_qjl)


def segment_inputs(p: _wire.Parsed, plan, devices):
    """Per segment of ``plan`` (:func:`tq_jax._src.plan.for_header` of ``p.header``) the
    ``(stream, norms)`` of a parsed blob, norms float16/float32 or decoded from log
    codes, and the QJL inputs (``None`` unless the blob has them) with its matrix on
    each device."""
    h = plan.header
    qjl = None
    if h.use_qjl and h.num_vectors:
        try:
            m = _rotation.qjl_matrix(h.dim, h.qjl_sketch_size, h.seed)
        except ValueError as e:
            raise _wire.BadFieldError(f"TQ01 QJL blob cannot be decoded: {e}") from None
        qjl = (p.sketch, p.residual_norms, [jax.device_put(m, d) for d in devices])
    segments = []
    for stream, norms in zip(p.indices, p.norms):
        if isinstance(norms, _wire.NormCodes):
            norms = _norms.decode_log_norms(norms.ranges, norms.codes, norms.bits, norms.count)
        segments.append((stream, norms))
    return segments, qjl


# --------------------------------------------------------------------------- the host executor
#
# A plan (tq_jax._src.plan.Plan) run on host data: the segments' vectors block by block
# through the kernels above, devices in turn.


def rows(host: np.ndarray, plan, start: int, count: int) -> np.ndarray:
    """Rows ``start:start+count`` of a C-contiguous tensor's ``(rows, d)`` view (no copy):
    a segment's vectors or a raw layer range of ``plan``."""
    return host.reshape(plan.rows, plan.dim)[start : start + count]


def _encode_vectors(flat: np.ndarray, cfg: _codec.CodecConfig, block_vectors, devices):
    """Run the codec over host vectors ``flat`` (n, d) block by block: ([stream chunks], norms f32 (n,))."""
    block = block_vectors_for(flat.shape[1], block_vectors, devices)
    staging = Staging(IN_FLIGHT * len(devices) + 1)  # see Staging: one more than in flight

    def put(start, nb, rows, device):
        return staging.put(flat[start : start + nb], rows, device)

    return encode_blocks(put, flat.shape[0], cfg, block, devices, np.asarray)


def encode_plan(host: np.ndarray, plan, block_vectors, devices):
    """Encode a C-contiguous host tensor under ``plan``: ``([(stream chunks, float32
    norms)] per segment, [raw layer bytes])``, for :mod:`tq_jax._src.blob` to write."""
    encoded = [_encode_vectors(rows(host, plan, s.row_start, s.n_vectors), s.config, block_vectors, devices)
               for s in plan.segments]
    raw = [memoryview(rows(host, plan, r.row_start, r.rows).reshape(-1).view(np.uint8)) for r in plan.raw]
    return encoded, raw


def encode(host: np.ndarray, plan, block_vectors, device):
    """The host executor of ``dumps``: :func:`encode_plan` on ``device``'s list."""
    return encode_plan(host, plan, block_vectors, device_list(device))


def _decode_vectors(stream, norms, out_flat, cfg, block_vectors, devices, qjl=None):
    """Decode one segment's stream + norms into the host array ``out_flat`` (n, d),
    at most ``IN_FLIGHT`` blocks per device ahead of the copies out."""
    n_vec, dim = out_flat.shape
    block = block_vectors_for(dim, block_vectors, devices)
    pending = collections.deque()
    staging = Staging(IN_FLIGHT * len(devices) + 1)  # see Staging: one more than in flight

    def collect():
        start, nb, res = pending.popleft()
        out_flat[start : start + nb] = np.asarray(res).reshape(-1, dim)[:nb]  # a view

    for item in decode_blocks(stream, norms, cfg, n_vec, block, jax.numpy.dtype(out_flat.dtype), devices, staging.put, qjl):
        pending.append(item)
        if len(pending) > IN_FLIGHT * len(devices):
            collect()
    while pending:
        collect()


def decode_plan(p: _wire.Parsed, plan, out: np.ndarray, block_vectors, devices) -> None:
    """Decode a parsed blob into the host array ``out`` (the plan's number of values,
    C-contiguous, any float dtype) under ``plan`` (:func:`tq_jax._src.plan.for_header`)."""
    out = out.reshape(plan.shape)
    segments, qjl = segment_inputs(p, plan, devices)
    for s, (stream, norms) in zip(plan.segments, segments):
        _decode_vectors(stream, norms, rows(out, plan, s.row_start, s.n_vectors), s.config, block_vectors, devices, qjl)
    src_dt = np.dtype(jax.numpy.dtype(plan.dtype))
    base = plan.raw_offset or 0
    for r in plan.raw:
        part = rows(out, plan, r.row_start, r.rows)
        part[...] = p.raw[r.offset - base : r.offset - base + r.nbytes].view(src_dt).reshape(part.shape)


def decode(p: _wire.Parsed, plan, dtype, block_vectors, device) -> jax.Array:
    """The host executor of ``loads``: the blob's tensor decoded block by block
    (:func:`decode_plan`) into a 64-byte-aligned host buffer that becomes the result on
    ``device`` (:func:`device_list`'s first), adopted without a copy on the CPU backend."""
    devices = device_list(device)
    out = aligned_empty(plan.shape, np.dtype(jax.numpy.dtype(dtype)))
    decode_plan(p, plan, out, block_vectors, devices)
    return jax.device_put(out, devices[0])


def decode_into(p: _wire.Parsed, plan, out: np.ndarray, block_vectors, device) -> None:
    """The host executor of ``load_into``: :func:`decode_plan` on ``device``'s list."""
    decode_plan(p, plan, out, block_vectors, device_list(device))
