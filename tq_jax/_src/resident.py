"""The per-block device path of :mod:`tq_jax._src.blob`: data on an accelerator stays there.

The device path has two executors: one compiled program per blob
(:mod:`tq_jax._src.program`, the default), and the per-block dispatch here, which runs
what the program does not (QJL blobs, blobs of 2 GiB or more) and is kept so that one
run on one card can measure both (a call's ``executor="blocks"``,
``benchmarks/accelerator.py`` step 2). :mod:`tq_jax._src.blob` makes the choice, in one
place (``blob.takes``, ``blob._executor``), from the device and the call's ``executor``.

The per-block dispatch: a jax.Array on one device is encoded there: one
program cuts its blocks on the device (the last one padded to its bucket, so every
block has the shape the host path gives it and the bytes are the same), they run
through the host path's block kernels, and only the packed results and the raw
layers' bytes come to the host. ``loads(device=d)`` sends the blob's sections to d,
decodes every block there and assembles the tensor there.

On the CPU backend a device's memory is host memory: the host pipeline reads a CPU
jax.Array in place (``np.asarray`` is a view) and its 64-byte-aligned output becomes
the result without a copy, so it already keeps the data where it lives, and it
pipelines blocks with bounded memory. CPU devices therefore take it; tests pin
``executor="program"`` or ``"blocks"`` to run the accelerator path on CPU devices.
(benchmarks/results/device_path_cpu.md has the measurements behind this choice.)

The public API stays :func:`tq_jax.dumps` / :func:`tq_jax.loads`: :mod:`tq_jax._src.blob`
decides whether a device's data come here and calls :func:`encode` / :func:`decode`. The blocks run through the same block driver (:mod:`tq_jax._src.blocks`)
and kernels as the host path, so the bytes are the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import _lru
from tq_jax._src import blocks as _blocks
from tq_jax._src import program as _program
from tq_jax._src import wire as _wire
from tq_jax._src.plan import Plan

__all__ = ["encode", "decode", "encoder", "assembler", "CACHES",
           "cache_stats", "clear_caches"]

# Compiled programs keyed by a blob's layout and shape (a decoder's come from untrusted
# headers): bounded, least recently used first.
PROGRAMS = _lru.LRU("device-resident programs", max_entries=32)
CACHES = {"device-resident programs": PROGRAMS, "device programs": _program.PROGRAMS}


def cache_stats() -> dict:
    """``{name: tq_jax._src._lru.Stats}`` of the device-resident path's caches (see also codec's)."""
    return {name: c.stats() for name, c in CACHES.items()}


def clear_caches() -> None:
    """Empty the device-resident path's caches (programs are rebuilt, identically, on demand)."""
    for c in CACHES.values():
        c.clear()


@PROGRAMS.memoize
def encoder(plan: Plan, block: int, device):
    """The encoder of ``header``'s layout on ``device``: x (a jax.Array there) →
    ([(stream chunks, norms)] per segment, [raw layer bytes]).

    One jitted program cuts ``x`` into every segment's blocks (the last one padded to
    its bucket) and the raw layers' bytes; the blocks then run through the block
    kernels the host path uses, a few in flight, and only their packed results come back.
    """
    dim = plan.dim

    def cut(x):
        blocks = []
        flat = x.reshape(plan.rows, dim)
        for s in plan.segments:
            v, n_vec = flat[s.row_start : s.row_start + s.n_vectors], s.n_vectors
            seg = []
            for start in range(0, n_vec, block):
                nb = min(block, n_vec - start)
                b = v[start : start + nb]
                seg.append(b if nb == block else jnp.pad(b, ((0, _blocks.bucket(nb) - nb), (0, 0))))
            blocks.append(seg)
        raw = [jax.lax.bitcast_convert_type(flat[r.row_start : r.row_start + r.rows], jnp.uint8).reshape(-1)
               for r in plan.raw]
        return blocks, raw

    placed = jax.sharding.SingleDeviceSharding(device)
    cut = jax.jit(cut, in_shardings=placed, out_shardings=placed)

    def encode(x):
        blocks, raw = cut(x)
        encoded = []
        for seg, s in zip(blocks, plan.segments):
            put = functools.partial(lambda seg, start, nb, rows, _: seg[start // block], seg)
            encoded.append(_blocks.encode_blocks(put, s.n_vectors, s.config, block, [device], jax.device_get))
        return encoded, jax.device_get(raw)

    return encode


def encode(x, plan: Plan, block_vectors, device):
    """``x`` (a jax.Array) encoded on ``device`` block by block under ``plan``:
    ([(stream chunks, norms)] per segment, raw pieces)."""
    if device not in x.devices():
        x = jax.device_put(x, device)  # device to device
    block = _blocks.block_vectors_for(plan.dim, block_vectors, [device])
    encoded, raw = encoder(plan, block, device)(x)
    return encoded, [memoryview(r) for r in raw]



# A blob decoded onto one device: its blocks run through the same block kernels as
# the host path, every one dispatched at once (their results are the output, so
# nothing is gained by waiting), and one program per layout assembles them with the
# raw layers into the tensor, on the device. No host output buffer is filled.


@PROGRAMS.memoize
def assembler(plan: Plan, dtype, block: int, device):
    """The jitted program (block results per segment, raw bytes) → the blob's tensor on ``device``."""
    src = jnp.dtype(plan.dtype)
    dim = plan.dim

    def assemble(blocks, raw):
        out = jnp.zeros((plan.rows, dim), dtype)
        for s, seg in zip(plan.segments, blocks):
            n = s.n_vectors
            if n == 0:
                continue
            v = jnp.concatenate([b.reshape(-1, dim) for b in seg])[:n] if len(seg) > 1 else seg[0].reshape(-1, dim)[:n]
            out = out.at[s.row_start : s.row_start + n].set(v)
        base = plan.raw_offset or 0
        for r in plan.raw:
            lo = r.offset - base
            vals = jax.lax.bitcast_convert_type(raw[lo : lo + r.nbytes].reshape(-1, src.itemsize), src)
            out = out.at[r.row_start : r.row_start + r.rows].set(vals.reshape(r.rows, dim).astype(dtype))
        return out.reshape(plan.shape)

    placed = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(assemble, in_shardings=placed, out_shardings=placed)


def decode(p: _wire.Parsed, plan: Plan, dtype, block_vectors, device) -> jax.Array:
    """The blob's tensor decoded block by block on ``device`` and born there."""
    block = _blocks.block_vectors_for(plan.dim, block_vectors, [device])
    segments, qjl = _blocks.segment_inputs(p, plan, [device])
    results = []
    for s, (stream, norms) in zip(plan.segments, segments):
        put = lambda piece, nbytes, _: _blocks.pad_rows(piece, nbytes)  # noqa: E731 (no staging: nothing is reused)
        blocks = _blocks.decode_blocks(stream, norms, s.config, s.n_vectors, block, dtype, [device], put, qjl)
        results.append(tuple(res for _, _, res in blocks))
    raw = jax.device_put(p.raw if len(p.raw) else np.zeros(0, np.uint8), device)
    return assembler(plan, dtype, block, device)(tuple(results), raw)
