"""The device executor: a whole blob computed by one compiled program on one device.

:func:`encode` runs one jitted program per (:class:`~tq_jax._src.plan.Plan`, block, device,
input dtype) that writes every section of the blob into one uint8 buffer in device
memory: the header and section lengths (constants of the plan), each segment's index
stream and float norms, and the raw edge layers' bytes. Only the finished bytes then
cross to the host, in one transfer. :func:`decode` is the mirror: the blob crosses to
the device in one transfer and one program writes the tensor there.

Inside the program each segment runs through the codec's block kernels
(:func:`tq_jax._src.codec.encode_stream` / :func:`~tq_jax._src.codec.decode_stream`) in a
``lax.fori_loop`` over blocks of ``block`` vectors, the last one padded to its bucket
(:func:`tq_jax._src.blocks.bucket`), exactly the blocks the host block driver cuts. Each
block is read with a ``dynamic_slice`` and its result written in place with a
``dynamic_update_slice``, so the program's temporary memory is one block's
intermediates whatever the tensor's size (a test reads it from XLA's memory analysis);
besides its input and output the program holds at most :func:`temp_bound` bytes.

What stays on the host, and why:

- Log-coded norms (``norm_bits``): their grid is defined in float64
  (:func:`tq_jax._src.norms.encode_log_norms`), which accelerators do not compute by
  default, so the program returns the float32 norms (4 bytes per vector, 1/64 of a
  bfloat16 tensor at head_dim 128) and the host codes them into the output; on load
  the host decodes them and sends the float32 norms with the blob.
- The CRC32 (``checksum``): ``zlib.crc32`` over the returned bytes.

The blocks are those of the host path, so on the CPU backend the blobs are the host
path's byte for byte (tests/test_program.py). Decoded values are the host path's too,
except that XLA may order a float32 sum differently inside this program than in the
block decoder: elements then differ at float32 rounding of their vector's norm (seen
for 3-bit Hadamard rows at head_dim 128: decoded to bfloat16, 4 of 49,152; decoded to
float32 under jax 0.9.2's XLA, about 1 in 8, under 0.10.2 none). On an accelerator the default block is
larger (:data:`DEVICE_BLOCK_COORDS`: fewer, fuller loop iterations). Offsets are
int32 inside the program, so a blob of 2 GiB or more (and a tensor of 2**31 rows or
more) takes the block executor instead (:func:`fits`).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import _kernels, _lru
from tq_jax._src import blocks as _blocks
from tq_jax._src import codec as _codec
from tq_jax._src import norms as _norms
from tq_jax._src import wire as _wire
from tq_jax._src.plan import Plan

__all__ = [
    "DEVICE_BLOCK_COORDS",
    "MAX_BLOB_BYTES",
    "PROGRAMS",
    "block_vectors",
    "fits",
    "temp_bound",
    "encoder",
    "decoder",
    "encode",
    "encode_into",
    "decode",
    "finish",
    "export",
]

# Coordinates per block on an accelerator: 8 Mi (a 16 MiB bfloat16 block, 32 MiB per
# float32 intermediate, temp_bound 192 MiB), so a 1 GiB tensor is 64 loop iterations of
# kernels large enough to fill the device. On the CPU backend the host path's block (2**19).
DEVICE_BLOCK_COORDS = 1 << 23
MAX_BLOB_BYTES = (1 << 31) - 1  # int32 offsets inside the program

# Compiled programs keyed by a plan (a decoder's comes from an untrusted header):
# bounded, least recently used first.
PROGRAMS = _lru.LRU("device programs", max_entries=32)


def block_vectors(plan: Plan, block_vectors: int | None, device) -> int:
    """Vectors per block for ``plan`` on ``device``: ``block_vectors`` if given, else
    the host path's default on a CPU device and :data:`DEVICE_BLOCK_COORDS` elsewhere
    (both rounded down to a bucket size, as :func:`tq_jax._src.blocks.block_vectors_for` does)."""
    dim = plan.dim
    if block_vectors is None and not _blocks.is_cpu(device):
        block_vectors = max(_blocks.MIN_BUCKET, DEVICE_BLOCK_COORDS // dim)
    return _blocks.block_vectors_for(dim, block_vectors, [device])


def fits(plan: Plan) -> bool:
    """Whether the program can run ``plan`` (int32 offsets; no QJL residual to read)."""
    return plan.nbytes <= MAX_BLOB_BYTES and plan.rows < (1 << 31) and not plan.qjl


def temp_bound(plan: Plan, block: int) -> int:
    """Bytes of temporaries the programs may hold besides input and output: six float32
    copies of one (bucketed) block, the tables, and float32 norms of the log-coded
    segments (4 bytes per vector: the only part that grows with the tensor). XLA's
    memory analysis of the CPU programs stays under it (tests/test_program.py)."""
    coords = max(block, _blocks.bucket(block)) * plan.dim
    tables = sum(4 * (plan.dim * plan.dim + 2 ** s.bits) for s in plan.segments)
    norms = sum(4 * s.n_vectors for s in plan.segments) if plan.norm_bits else 0
    return 6 * 4 * coords + tables + norms + (1 << 20)


def _blocks_of(n: int, block: int) -> tuple:
    """``(full blocks, tail vectors, tail bucket)`` of a segment of ``n`` vectors."""
    full = n // block
    tail = n - full * block
    return full, tail, (_blocks.bucket(tail) if tail else 0)


def _constants(plan: Plan) -> list:
    """``(offset, uint8 array)`` of the plan's constant bytes: header, section lengths."""
    out = [(0, np.frombuffer(plan.header_bytes, np.uint8))]
    for off, value in plan.section_lengths():
        out.append((off, np.frombuffer(int(value).to_bytes(8, "little", signed=True), np.uint8)))
    return out


def _norm_bytes(norms, norm_dtype: str):
    """float32 norms (n,) as the little-endian bytes of ``norm_dtype`` (n * itemsize,)."""
    n = norms.astype(jnp.float16 if norm_dtype == "float16" else jnp.float32)
    return jax.lax.bitcast_convert_type(n, jnp.uint8).reshape(-1)


def _overflow(norms, stats):
    """Running (count, largest) of finite norms that round to inf in float16."""
    big = jnp.isfinite(norms) & (norms >= 65520.0)
    count, largest = stats
    return (
        count + jnp.sum(big, dtype=jnp.int32),
        jnp.maximum(largest, jnp.max(jnp.where(big, norms, 0.0), initial=0.0)),
    )


def _jit(program, device):
    """``program`` jitted onto ``device``, or, for a platform name, unplaced (to be
    lowered for that platform: :func:`export`)."""
    if isinstance(device, str):
        return jax.jit(program)
    placed = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(program, in_shardings=placed, out_shardings=placed)


def _tables_device(device):
    """Where the codec's tables live while a program is traced: ``device``, or JAX's
    default one for a program built for a platform name (inside the trace the tables
    are constants either way)."""
    return None if isinstance(device, str) else device


@PROGRAMS.memoize
def encoder(plan: Plan, block: int, device, dtype):
    """The jitted program ``x`` (the plan's shape, ``dtype``, on ``device``) →
    ``(blob uint8 (plan.nbytes,), (overflow count, largest), (float32 norms of each
    log-coded segment))``. The blob's CRC32 and norm codes are left zero (:func:`finish`).
    ``device`` may be a platform name (``"tpu"``): the program that platform's devices
    run, unplaced, for :func:`export`."""
    dim, rows = plan.dim, plan.rows
    tables_on = _tables_device(device)
    float_norms = plan.norm_dtype is not None
    watch = plan.overflow != "keep"

    def program(x):
        flat = x.reshape(rows, dim)
        out = jnp.zeros(plan.nbytes, jnp.uint8)
        for off, const in _constants(plan):
            out = jax.lax.dynamic_update_slice(out, jnp.asarray(const), (off,))
        stats = (jnp.int32(0), jnp.float32(0))
        coded = []
        for s in plan.segments:
            cfg, n = s.config, s.n_vectors
            full, tail, rows_tail = _blocks_of(n, block)
            step = block * dim * cfg.bits // 8  # exact: block is a multiple of 8
            seg_norms = jnp.zeros(n if plan.norm_bits else 0, jnp.float32)

            def body(i, carry, s=s, cfg=cfg, step=step):
                out, stats, seg_norms = carry
                # A barrier over the input and the index: XLA would otherwise move the
                # kernel's float32 conversion of the block onto the whole input and
                # hoist it out of the loop, a float32 copy of the tensor (XLA's memory
                # analysis shows it; tests/test_program.py checks the bound).
                src, j = jax.lax.optimization_barrier((flat, i))
                xb = jax.lax.dynamic_slice(src, (s.row_start + j * block, 0), (block, dim))
                stream, norms = _codec.encode_stream(xb, cfg, tables_on)
                out = jax.lax.dynamic_update_slice(out, stream.reshape(-1), (s.index_offset + i * step,))
                if float_norms:
                    nb = _norm_bytes(norms, plan.norm_dtype)
                    out = jax.lax.dynamic_update_slice(out, nb, (s.norms_offset + i * nb.shape[0],))
                else:
                    seg_norms = jax.lax.dynamic_update_slice(seg_norms, norms, (i * block,))
                if watch:
                    stats = _overflow(norms, stats)
                return out, stats, seg_norms

            if full:
                out, stats, seg_norms = jax.lax.fori_loop(0, full, body, (out, stats, seg_norms))
            if tail:
                start = s.row_start + full * block
                xb = jnp.pad(flat[start : start + tail], ((0, rows_tail - tail), (0, 0)))
                stream, norms = _codec.encode_stream(xb, cfg, tables_on)
                norms = norms[:tail]
                used = tail * dim * cfg.bits
                st = stream.reshape(-1)[: (used + 7) // 8]
                if used % 8:  # the last byte also holds padding rows' bits: TQ01 wants them zero
                    st = st.at[-1].set(st[-1] & jnp.uint8((1 << (used % 8)) - 1))
                out = jax.lax.dynamic_update_slice(out, st, (s.index_offset + full * step,))
                if float_norms:
                    isz = 2 if plan.norm_dtype == "float16" else 4
                    out = jax.lax.dynamic_update_slice(out, _norm_bytes(norms, plan.norm_dtype), (s.norms_offset + full * block * isz,))
                else:
                    seg_norms = jax.lax.dynamic_update_slice(seg_norms, norms, (full * block,))
                if watch:
                    stats = _overflow(norms, stats)
            if plan.norm_bits:
                coded.append(seg_norms)
        for r in plan.raw:
            part = jax.lax.bitcast_convert_type(flat[r.row_start : r.row_start + r.rows], jnp.uint8).reshape(-1)
            out = jax.lax.dynamic_update_slice(out, part, (r.offset,))
        return out, stats, tuple(coded)

    return _jit(program, device)


def finish(plan: Plan, out: np.ndarray, coded_norms) -> None:
    """Complete a blob the encoder wrote into host bytes ``out`` (``plan.nbytes``): the
    log-coded norm sections from the returned float32 norms, then the CRC32."""
    if plan.norm_bits:
        for s, norms in zip(plan.segments, coded_norms):
            ranges, codes = _norms.encode_log_norms(np.asarray(norms), s.norm_groups, plan.norm_bits)
            rb = np.ascontiguousarray(ranges, "<f4").reshape(-1).view(np.uint8)
            out[s.norms_offset : s.norms_offset + rb.size] = rb
            out[s.norms_offset + rb.size : s.norms_offset + rb.size + codes.size] = codes
    if plan.checksum:
        end = plan.nbytes - 4
        out[end:] = np.frombuffer(zlib.crc32(out[:end]).to_bytes(4, "little"), np.uint8)


def _run(plan: Plan, x, block_vectors_, device):
    """Dispatch the encoder of ``plan`` on ``x``; raise or widen on a float16 overflow.
    Returns ``(plan, device blob, coded norms)`` (the plan that was written)."""
    if not isinstance(x, jax.Array) or device not in x.devices():
        x = jax.device_put(x, device)  # one transfer (host to device, or device to device)
    dtype = jnp.dtype(x.dtype)
    block = block_vectors(plan, block_vectors_, device)
    blob, (count, largest), coded = encoder(plan, block, device, dtype)(x)
    if plan.overflow != "keep":
        count, largest = jax.device_get((count, largest))  # the one wait before the bytes come back
        count = int(count)
        if count and plan.overflow == "raise":
            raise _wire.NormOverflowError(_wire.NORM_OVERFLOW.format(count=count, total=plan.rows, largest=float(largest)))
        if count:  # "auto": the same tensor written with float32 norms
            return _run(plan.widened, x, block_vectors_, device)
    return plan, blob, coded


def encode(plan: Plan, x, block_vectors_: int | None, device) -> tuple[Plan, np.ndarray]:
    """The blob of ``x`` under ``plan``, computed on ``device``: ``(the plan written (its
    widened one after a float16 overflow), host uint8 array of its bytes)``."""
    plan, blob, coded = _run(plan, x, block_vectors_, device)
    out = np.asarray(jax.device_get(blob))
    if not out.flags.writeable:  # a zero-copy view of a CPU buffer: copy before completing it
        out = out.copy()
    finish(plan, out, coded)
    return plan, out


def encode_into(plan: Plan, x, out: memoryview, block_vectors_: int | None, device) -> Plan:
    """:func:`encode` into the caller's writable buffer ``out`` (at least the written
    plan's ``nbytes``; nothing is written otherwise). Returns the plan written.

    Raises:
        ValueError: ``out`` is smaller than the blob (after a float16 overflow widened it).
    """
    plan, blob, coded = _run(plan, x, block_vectors_, device)
    if plan.nbytes > len(out):
        raise ValueError(
            f"output buffer holds {len(out)} bytes but this blob needs {plan.nbytes}: some "
            f"norms overflow float16, so they are stored as float32. Pin norm_dtype to size buffers in advance."
        )
    dst = np.frombuffer(out, np.uint8, count=plan.nbytes)
    dst[:] = np.asarray(jax.device_get(blob))  # the transfer lands in the caller's buffer
    finish(plan, dst, coded)
    return plan


@PROGRAMS.memoize
def decoder(plan: Plan, block: int, device, dtype):
    """The jitted program ``(blob uint8 (plan.nbytes,), (float32 norms of each log-coded
    segment), (each segment's codec tables))`` on ``device`` → the plan's tensor of
    ``dtype``, born there. ``device`` may be a platform name, as for :func:`encoder`."""
    dim, rows = plan.dim, plan.rows
    src = jnp.dtype(plan.dtype)
    if plan.norm_dtype is not None:
        norm_dt = jnp.dtype(jnp.float16 if plan.norm_dtype == "float16" else jnp.float32)

    def norms_of(blob, coded, s, start, count):
        if plan.norm_bits:
            return jax.lax.dynamic_slice(coded, (start,), (count,))
        isz = norm_dt.itemsize
        raw = jax.lax.dynamic_slice(blob, (s.norms_offset + start * isz,), (count * isz,))
        return jax.lax.bitcast_convert_type(raw.reshape(count, isz), norm_dt)

    # On the CPU backend a 16-bit float output is carried as uint16: XLA's CPU backend
    # updates a bfloat16 buffer by converting all of it to float32 and back in every
    # loop iteration (a pass over the whole tensor per block), integers in place; the
    # final bitcast then costs one copy of the output, within the CPU programs' memory.
    # Accelerators update bfloat16 in place, and the final bitcast would cost a copy.
    half = jnp.dtype(dtype).itemsize == 2  # bfloat16, float16: converted; float32 is updated in place
    carry = jnp.dtype(jnp.uint16) if half and _blocks.is_cpu(device) else jnp.dtype(dtype)

    def as_carry(v):
        return jax.lax.bitcast_convert_type(v, carry)

    def program(blob, coded_norms, tables):
        out = jnp.zeros((rows, dim), carry)
        k = 0
        for k_seg, s in enumerate(plan.segments):
            cfg, n = s.config, s.n_vectors
            coded = coded_norms[k] if plan.norm_bits else None
            k += 1 if plan.norm_bits else 0
            full, tail, rows_tail = _blocks_of(n, block)
            step = block * dim * cfg.bits // 8

            def decode(stream, norms, cfg=cfg, tabs=tables[k_seg]):
                # the barrier ends the kernel's fusion where the host path's program ends
                # it, rather than inside the update of the output
                v = _kernels.decode_stream(stream, norms, tabs, cfg.bits, dtype, cfg.norm_correction)
                return jax.lax.optimization_barrier(v)

            def body(i, out, s=s, step=step, coded=coded, decode=decode):
                stream = jax.lax.dynamic_slice(blob, (s.index_offset + i * step,), (step,))
                norms = norms_of(blob, coded, s, i * block, block)
                vals = as_carry(decode(stream, norms).reshape(block, dim))
                return jax.lax.dynamic_update_slice(out, vals, (s.row_start + i * block, 0))

            if full:
                out = jax.lax.fori_loop(0, full, body, out)
            if tail:
                lo = s.index_offset + full * step
                piece = blob[lo : s.index_offset + s.index_nbytes]
                piece = jnp.pad(piece, (0, rows_tail * dim * cfg.bits // 8 - piece.shape[0]))
                norms = norms_of(blob, coded, s, full * block, tail)
                norms = jnp.pad(norms, (0, rows_tail - tail))
                vals = as_carry(decode(piece, norms).reshape(rows_tail, dim)[:tail])
                out = jax.lax.dynamic_update_slice(out, vals, (s.row_start + full * block, 0))
        for r in plan.raw:
            part = blob[r.offset : r.offset + r.nbytes].reshape(r.rows, dim, src.itemsize)
            vals = as_carry(jax.lax.bitcast_convert_type(part, src).astype(dtype))
            out = jax.lax.dynamic_update_slice(out, vals, (r.row_start, 0))
        return jax.lax.bitcast_convert_type(out, dtype).reshape(plan.shape)

    return _jit(program, device)


def decode(plan: Plan, parsed: _wire.Parsed, blob, dtype, block_vectors_: int | None, device) -> jax.Array:
    """The tensor of a parsed blob (``blob`` its bytes, already checked by
    :func:`tq_jax._src.wire.parse`), decoded by one program on ``device`` and born there."""
    coded = ()
    if plan.norm_bits:
        coded = tuple(
            jax.device_put(_norms.decode_log_norms(c.ranges, c.codes, c.bits, c.count), device) for c in parsed.norms
        )
    buf = np.frombuffer(blob, np.uint8, count=plan.nbytes)
    block = block_vectors(plan, block_vectors_, device)
    # The tables are arguments, as the host path's block decoder takes them: XLA then
    # compiles the same arithmetic (as constants it may fuse and round differently).
    tables = tuple(_codec.device_tables(s.config, device) for s in plan.segments)
    return decoder(plan, block, device, jnp.dtype(dtype))(jax.device_put(buf, device), coded, tables)


def export(plan: Plan, dtype, platform: str, block_vectors_: int | None = None) -> tuple:
    """The encoder and decoder of ``plan`` for ``dtype`` as a ``platform`` device
    (``"tpu"``, ``"cuda"``, ...) runs them, exported for that platform from any host:
    ``(jax.export.Exported encoder, jax.export.Exported decoder)``, the blocks
    :func:`block_vectors` gives that platform. The programs are XLA, so lowering them
    checks that the platform's compiler is handed no op it rejects (no float64, no
    64-bit integer: :func:`encoder` keeps offsets in int32); whether the compiler then
    accepts them and how fast they run only that platform can tell."""
    dtype = jnp.dtype(dtype)
    block = block_vectors(plan, block_vectors_, platform)
    x = jax.ShapeDtypeStruct(plan.shape, dtype)
    enc = jax.export.export(encoder(plan, block, platform, dtype), platforms=[platform])(x)
    coded = tuple(jax.ShapeDtypeStruct((s.n_vectors,), jnp.float32) for s in plan.segments) if plan.norm_bits else ()
    tables = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tuple(_codec.device_tables(s.config) for s in plan.segments)
    )
    dec = jax.export.export(decoder(plan, block, platform, dtype), platforms=[platform])(
        jax.ShapeDtypeStruct((plan.nbytes,), jnp.uint8), coded, tables
    )
    return enc, dec
