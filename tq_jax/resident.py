"""The device-resident path of :mod:`tq_jax.blob`: data on an accelerator stays there.

A jax.Array on one device is encoded there: one
program cuts its blocks on the device (the last one padded to its bucket, so every
block has the shape the host path gives it and the bytes are the same), they run
through the host path's block kernels, and only the packed results and the raw
layers' bytes come to the host. ``loads(device=d)`` sends the blob's sections to d,
decodes every block there and assembles the tensor there.

On the CPU backend a device's memory is host memory: the host pipeline reads a CPU
jax.Array in place (``np.asarray`` is a view) and its 64-byte-aligned output becomes
the result without a copy, so it already keeps the data where it lives, and it
pipelines blocks with bounded memory. CPU devices therefore take it; tests set
:data:`ON_CPU` to run the accelerator path on CPU devices.
(benchmarks/results/device_path_cpu.md has the measurements behind this choice.)

The public API stays :func:`tq_jax.dumps` / :func:`tq_jax.loads`: :mod:`tq_jax.blob`
asks :func:`takes` whether a device's data come here and calls :func:`encode` /
:func:`decode`. The blocks run through the same block driver (:mod:`tq_jax.blocks`)
and kernels as the host path, so the bytes are the same.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax import _lru
from tq_jax import blocks as _blocks
from tq_jax import options as _options
from tq_jax import wire as _wire

__all__ = ["ON_CPU", "takes", "encode", "decode", "encoder", "assembler", "CACHES", "cache_stats", "clear_caches"]

ON_CPU = False  # True: take this path on CPU devices too (tests, benchmarks)


def takes(device) -> bool:
    """Whether data for ``device`` (None: JAX's default) takes the device-resident path."""
    return ON_CPU or not _blocks.is_cpu(device)


# Compiled programs keyed by a blob's layout and shape (a decoder's come from untrusted
# headers): bounded, least recently used first.
PROGRAMS = _lru.LRU("device-resident programs", max_entries=32)
CACHES = {"device-resident programs": PROGRAMS}


def cache_stats() -> dict:
    """``{name: tq_jax._lru.Stats}`` of the device-resident path's caches (see also codec's)."""
    return {name: c.stats() for name, c in CACHES.items()}


def clear_caches() -> None:
    """Empty the device-resident path's caches (programs are rebuilt, identically, on demand)."""
    for c in CACHES.values():
        c.clear()


def _segment_vectors(x, g, lo, hi, dim):
    return x.reshape(-1, dim) if g is None else x[g, lo:hi].reshape(-1, dim)


@PROGRAMS.memoize
def encoder(header: _wire.Header, cfgs: tuple, block: int, device):
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
                seg.append(b if nb == block else jnp.pad(b, ((0, _blocks.bucket(nb) - nb), (0, 0))))
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
            encoded.append(_blocks.encode_blocks(put, n_vec, cfg, block, [device], jax.device_get))
        return encoded, jax.device_get(raw)

    return encode


def encode(x, header: _wire.Header, options: _options.Options, block_vectors, device):
    """``x`` (a jax.Array) encoded on ``device``: ([(stream chunks, norms)] per segment, raw pieces)."""
    if device not in x.devices():
        x = jax.device_put(x, device)  # device to device
    cfgs = tuple(options.codec_config(header.dim, 1 if g == 1 else 0) for g, *_ in header.segments())
    block = _blocks.block_vectors_for(header.dim, block_vectors, [device])
    encoded, raw = encoder(header, cfgs, block, device)(x)
    return encoded, [memoryview(r) for r in raw]



# A blob decoded onto one device: its blocks run through the same block kernels as
# the host path, every one dispatched at once (their results are the output, so
# nothing is gained by waiting), and one program per layout assembles them with the
# raw layers into the tensor, on the device. No host output buffer is filled.


@PROGRAMS.memoize
def assembler(header: _wire.Header, dtype, block: int, device):
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


def decode(p: _wire.Parsed, dtype, block_vectors, device) -> jax.Array:
    """The blob's tensor decoded on ``device`` and born there."""
    h = p.header
    block = _blocks.block_vectors_for(h.dim, block_vectors, [device])
    segments, qjl = _blocks.segment_inputs(p, [device])
    results = []
    for (_, _, _, _, n), (cfg, stream, norms) in zip(h.segments(), segments):
        put = lambda piece, nbytes, _: _blocks.pad_rows(piece, nbytes)  # noqa: E731 (no staging: nothing is reused)
        blocks = _blocks.decode_blocks(stream, norms, cfg, n, block, dtype, [device], put, qjl)
        results.append(tuple(res for _, _, res in blocks))
    raw = jax.device_put(p.raw if len(p.raw) else np.zeros(0, np.uint8), device)
    return assembler(h, dtype, block, device)(tuple(results), raw)
