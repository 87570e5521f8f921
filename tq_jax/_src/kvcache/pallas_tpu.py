"""Decode attention over a :mod:`tq_jax._src.kvcache` cache as one Pallas kernel.

The kernel walks each sequence's pages once, as TPU paged attention does: the grid is
``(batch, units)`` (a unit is a page, or a block of ``block_tokens`` inside a large
page), the lengths and page table are scalar-prefetched (``PrefetchScalarGridSpec``), and
the code/norm blocks' index maps read the page table, so a step's pool rows arrive
already addressed. A step past the sequence's length maps to its last unit again (no new
copy) and computes nothing. In the step, the uint8 codes are unpacked by shifts into
planar index planes and looked up in the codebook by a select tree on the index bits
(``2**bits - 1`` selects, no gather: element-wise on every backend), then scored per plane
against the planar query slices; the online-softmax state (running max, sum and the
rotated-domain accumulator) lives in the output blocks, which stay resident across a
sequence's units. The rotation of the queries and the final divide/un-rotation are XLA
ops around the call (once per query), shared with the XLA path.

Mosaic, and what a CPU can check of it. The kernel follows the platform it is lowered for
(:func:`tq_jax._src.kvcache.target.kernel`): exported for a TPU it is one ``tpu_custom_call``,
run on a CPU it is the Pallas interpreter. Its lowering is chip-free (no op whose Mosaic
rule asks for the chip, such as ``sign``, which jnp's integer ``//`` and ``%`` emit: the
index arithmetic uses ``lax.div``/``lax.rem`` on non-negative ints). Every block's last
two dims are the array's own (:func:`blocks`; :func:`tiling_ok` is Mosaic's rule), so no
array needs padding; Mosaic pads them to its (8/16/32, 128) tiles in VMEM, which
:func:`vmem_bytes` counts and the unit size keeps under :data:`VMEM_BUDGET`. Inside, the
codes are widened to int32 before they are unpacked and the float16 norms arrive as
their uint16 bits and are converted exactly in int32 (:func:`f16_bits_to_f32`): the
kernel computes only in 32-bit types, which every TPU's vector unit has (Pallas TPU lists
no float16). The grid's batch axis is ``parallel`` (megacore chips split it), the unit
axis ``arbitrary`` (the online softmax walks it in order).

Status: verified on CPU in the Pallas interpreter and in TPU interpret mode
(``pltpu.InterpretParams``: TPU memory spaces, DMA semantics, race detection) against
the dense float64 references (``tests/test_kvcache*.py``, ``tests/test_tpu.py``), and
lowered for a TPU in every test run; never compiled by the TPU compiler nor timed on a
TPU, which is why :func:`tq_jax._src.kvcache.attend`'s ``impl="auto"`` keeps the XLA loop on
TPUs (docs/tpu.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tq_jax._src import codec as _codec
from tq_jax._src.kvcache import scoring as _scoring
from tq_jax._src.kvcache.state import CacheConfig, KVCache

__all__ = ["partial", "Block", "blocks", "tile", "tiling_ok", "vmem_bytes", "unit_tokens", "f16_bits_to_f32",
           "compiler_params", "LANES", "SUBLANES", "VMEM_BUDGET", "MAX_UNIT"]

_HI = lax.Precision.HIGHEST

LANES = 128  # a vector register's lanes: the last dim of a Mosaic tile
SUBLANES = {4: 8, 2: 16, 1: 32}  # second-to-last dim of a tile by itemsize: (8, 128) 32-bit, (16, 128) 16-bit, (32, 128) 8-bit
# Scoped VMEM a kernel may use by default on the current TPU generations that allow the
# least (16 MiB; later ones allow more). The unit is halved until the double-buffered
# blocks fit in half of it, leaving the rest to the step's temporaries.
VMEM_BUDGET = 16 << 20
MAX_UNIT = 256  # tokens per grid step at most (a page, or a block of a larger one)


class Block(NamedTuple):
    """One operand of the kernel as Mosaic sees it: a ``block`` of an ``array`` (both
    shapes in full; a squeezed dim counts as 1) of ``dtype``, ``buffers`` copies in VMEM."""

    name: str
    block: tuple
    array: tuple
    dtype: object
    buffers: int = 2  # double-buffered: the next step's copy lands while this one computes


def tile(dtype) -> tuple:
    """Mosaic's tile ``(sublanes, lanes)`` for ``dtype``: (8, 128) 32-bit, (16, 128)
    16-bit, (32, 128) 8-bit."""
    return SUBLANES[np.dtype(dtype).itemsize], LANES


def tiling_ok(block: tuple, array: tuple, dtype) -> bool:
    """Mosaic's rule for a block in VMEM: each of its last two dims is a multiple of the
    tile's (:func:`tile`) or equal to the array's."""
    if len(block) < 2:
        return len(block) == 1 and (block[0] == array[0] or block[0] % LANES == 0)
    sub, lanes = tile(dtype)
    return (block[-1] == array[-1] or block[-1] % lanes == 0) and (block[-2] == array[-2] or block[-2] % sub == 0)


def vmem_bytes(blocks_: list) -> int:
    """VMEM the blocks take, each padded to its tile: the last dim to a multiple of 128,
    the second to last to the tile's sublanes, times the buffers."""
    total = 0
    for b in blocks_:
        sub, lanes = tile(b.dtype)
        shape = (1,) * (2 - len(b.block)) + tuple(b.block)
        lead = int(np.prod(shape[:-2], dtype=np.int64))
        total += b.buffers * lead * -(-shape[-2] // sub) * sub * -(-shape[-1] // lanes) * lanes * np.dtype(b.dtype).itemsize
    return total


def blocks(cache: KVCache, rows: int, unit: int) -> list:
    """The kernel's blocks over ``cache`` (arrays or ``jax.ShapeDtypeStruct`` leaves; the
    local shapes under ``shard_map``) with ``rows`` query rows per KV head and ``unit``
    tokens per grid step: the query parts, the code and norm pools, then the outputs, in
    the order :func:`partial` passes them."""
    cfg = cache.config
    batch, (pages, page, heads, rk), rv = cache.lengths.shape[0], cache.k_codes.shape, cache.v_codes.shape[3]
    dim, nk, nv = cfg.head_dim, _scoring.parts(cfg.key_bits), _scoring.parts(cfg.value_bits)
    n_units = pages * (page // unit)
    per_seq = lambda name, *shape: Block(name, (1, *shape), (batch, *shape), np.float32)  # noqa: E731
    return (
        [per_seq(f"q{i}", heads, rows, dim // nk) for i in range(nk)]
        + [
            Block("k_codes", (1, unit, heads, rk), (n_units, unit, heads, rk), np.uint8),
            Block("k_norms", (1, unit, heads), (n_units, unit, heads), np.uint16),
            Block("v_codes", (1, unit, heads, rv), (n_units, unit, heads, rv), np.uint8),
            Block("v_norms", (1, unit, heads), (n_units, unit, heads), np.uint16),
        ]
        + [per_seq("m", heads, rows), per_seq("l", heads, rows)]
        + [per_seq(f"acc{i}", heads, rows, dim // nv) for i in range(nv)]
    )


def unit_tokens(cache: KVCache, rows: int) -> int:
    """Tokens per grid step: a page, or a block of ``block_tokens`` inside a larger page,
    at most :data:`MAX_UNIT`, halved while the double-buffered blocks take more than half
    of :data:`VMEM_BUDGET` (a power of two dividing the page either way)."""
    cfg = cache.config
    unit = min(cfg.page_tokens, cfg.block_tokens, MAX_UNIT)
    while unit > 8 and vmem_bytes(blocks(cache, rows, unit)) > VMEM_BUDGET // 2:
        unit //= 2
    return unit


def compiler_params():
    """Mosaic's compiler parameters: the batch axis ``parallel``, the unit axis
    ``arbitrary`` (``CompilerParams``; ``TPUCompilerParams`` before jax 0.6)."""
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=("parallel", "arbitrary"))


def f16_bits_to_f32(bits):
    """float16 values, given as their bits (any integer dtype holding 0..65535), as
    float32, exactly (inf and NaN included), in 32-bit integer ops only."""
    h = bits.astype(jnp.int32) & 0xFFFF
    sign = lax.shift_left(lax.shift_right_logical(h, 15), 31)
    exp = lax.shift_right_logical(h, 10) & 0x1F
    man = h & 0x3FF
    wide = jnp.where(exp == 0x1F, 0x7F800000 | lax.shift_left(man, 13),  # inf, NaN
                     lax.shift_left(exp + 112, 23) | lax.shift_left(man, 13))  # normal: exponent re-biased 15 -> 127
    normal = lax.bitcast_convert_type(sign | wide, jnp.float32)
    tiny = man.astype(jnp.float32) * np.float32(2.0**-24)  # zero and subnormals: man * 2**-24 is a normal float32
    return jnp.where(exp == 0, jnp.where(sign != 0, -tiny, tiny), normal)


def _select_lookup(idx, centroids: np.ndarray, bits: int):
    """``centroids[idx]`` by a binary select tree on the bits of ``idx`` (int32):
    level ``b`` picks between pairs by bit ``b``; the table is compile-time constants."""
    vals = [np.float32(c) for c in centroids]
    for b in range(bits):
        on = (idx & (1 << b)) != 0
        vals = [jnp.where(on, vals[2 * i + 1], vals[2 * i]) for i in range(len(vals) // 2)]
    return vals[0]


def _kernel(
    lengths_ref, hi_ref, sink_lo_ref, table_ref, *refs, cfg: CacheConfig, unit: int, q_len: int, nk: int, nv: int,
    kc, vc, dim: int, sliding: int | None = None
):
    """One unit of one sequence. Refs (after the two scalar-prefetch ones): the ``nk``
    planar query slices ``[H, R, D/nk]``, codes ``[unit, H, rk]``, norms ``[unit, H]``
    (K, then V), then the outputs m, l ``[H, R]`` and ``nv`` accumulators ``[H, R, D/nv]``."""
    q_refs, (kc_ref, kn_ref, vc_ref, vn_ref, m_ref, l_ref), acc_refs = refs[:nk], refs[nk : nk + 6], refs[nk + 6 :]
    b, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        for a in acc_refs:
            a[...] = jnp.zeros(a.shape, jnp.float32)

    length, hi, sink_lo = lengths_ref[b], hi_ref[b], sink_lo_ref[b]
    t0 = j * unit

    def coded(tok):  # scoring.coded_mask without the causal part
        keep = tok < hi
        if cfg.sinks:
            keep &= (tok < sink_lo) | (tok >= cfg.sinks)
        return keep

    @pl.when(t0 < hi)
    def _step():
        rows = m_ref.shape[1]
        tok = t0 + lax.broadcasted_iota(jnp.int32, (rows, unit), 1)
        last = length - q_len + lax.rem(lax.broadcasted_iota(jnp.int32, (rows, unit), 0), q_len)
        mask = ((tok <= last) & coded(tok))[None]  # [1, R, unit]
        if sliding:  # a sliding window: nothing at or below last - W
            mask &= (tok > last - sliding)[None]
        present = coded(t0 + lax.broadcasted_iota(jnp.int32, (unit, 1), 0))  # [unit, 1]
        kn = jnp.where(present, f16_bits_to_f32(kn_ref[...]), 0.0).T  # [H, unit]
        vn = jnp.where(present, f16_bits_to_f32(vn_ref[...]), 0.0).T
        kidx = _scoring.planes(kc_ref[...].astype(jnp.int32), cfg.key_bits, dim, nk)  # [unit, H, D/nk] each
        s = sum(
            jnp.einsum("hrd,thd->hrt", qr[...], _select_lookup(ip, kc, cfg.key_bits), precision=_HI)
            for qr, ip in zip(q_refs, kidx)
        )
        s = jnp.where(mask, s * kn[:, None, :], -jnp.inf)
        m = m_ref[...]
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1)
        m_ref[...] = m_new
        pv = p * vn[:, None, :]
        for a, ip in zip(acc_refs, _scoring.planes(vc_ref[...].astype(jnp.int32), cfg.value_bits, dim, nv)):
            cv = _select_lookup(ip, vc, cfg.value_bits)
            a[...] = alpha[..., None] * a[...] + jnp.einsum("hrt,thd->hrd", pv, cv, precision=_HI)


TILING = (
    "the TPU kernel's block {name} is {block} of an array {array} ({dtype}): Mosaic needs each of a block's last two "
    "dims to be a multiple of its tile {tile} or the array's own. This is a bug in tq_jax._src.kvcache.pallas_tpu.blocks; "
    "use impl='xla' meanwhile."
)


def partial(cache: KVCache, query: _scoring.Query, *, interpret):
    """The coded part of :func:`tq_jax._src.kvcache.attend` in one Pallas kernel:
    ``(m, l, acc)`` as :func:`tq_jax._src.kvcache.xla.partial` returns them (traceable;
    shapes checked by the caller). ``interpret``: False for the Mosaic kernel, True for
    the Pallas interpreter, or a ``pltpu.InterpretParams`` for TPU interpret mode
    (:func:`tq_jax._src.kvcache.target.kernel` chooses between the first two by platform).

    Raises:
        ValueError: a block that breaks Mosaic's tiling (:func:`tiling_ok`; a bug).
    """
    cfg = cache.config
    batch, dim = cache.lengths.shape[0], cfg.head_dim
    rows, nk, nv = query.rows, len(query.parts), _scoring.parts(cfg.value_bits)
    unit = unit_tokens(cache, rows)
    per_page = cfg.page_tokens // unit
    pps = cache.page_table.shape[1]
    units = pps * per_page  # grid steps per sequence
    layout = blocks(cache, rows, unit)
    for b in layout:
        if not tiling_ok(b.block, b.array, b.dtype):
            raise ValueError(TILING.format(name=b.name, block=b.block, array=b.array, dtype=np.dtype(b.dtype).name,
                                           tile=tile(b.dtype)))

    def step(hi, table, b, j):
        """Pool unit of step ``j`` of sequence ``b``; steps past the coded tokens repeat the last."""
        j = jnp.minimum(j, jnp.maximum(lax.div(hi[b] + unit - 1, unit) - 1, 0))
        page = jnp.maximum(table[b, lax.div(j, per_page)], 0)
        return page * per_page + lax.rem(j, per_page)

    def spec(blk):
        shape = (None, *blk.block[1:])
        if blk.name.endswith(("codes", "norms")):  # the pool: the unit the page table names
            return pl.BlockSpec(shape, lambda b, j, n, h, s, t: (step(h, t, b, j),) + (0,) * (len(shape) - 1))
        return pl.BlockSpec(shape, lambda b, j, n, h, s, t: (b,) + (0,) * (len(shape) - 1))  # per sequence

    def pool(a):
        a = a.reshape(a.shape[0] * per_page, unit, *a.shape[2:])
        return lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.float16 else a  # norms: their bits

    n_in = nk + 4
    kc, vc = _codec.tables(cfg.key_codec).centroids, _codec.tables(cfg.value_codec).centroids
    kernel = functools.partial(_kernel, cfg=cfg, unit=unit, q_len=query.q_len, nk=nk, nv=nv, kc=kc, vc=vc, dim=dim,
                               sliding=query.sliding_window)
    m, l, *acc = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(batch, units),
            in_specs=[spec(b) for b in layout[:n_in]], out_specs=[spec(b) for b in layout[n_in:]],
        ),
        out_shape=[jax.ShapeDtypeStruct(b.array, jnp.float32) for b in layout[n_in:]],
        compiler_params=compiler_params(),
        interpret=interpret,
        name=f"tq_decode_tpu_k{cfg.key_bits}v{cfg.value_bits}",
    )(
        cache.lengths,
        query.hi,
        query.sink_lo,
        cache.page_table,
        *query.parts,
        pool(cache.k_codes),
        pool(cache.k_norms),
        pool(cache.v_codes),
        pool(cache.v_norms),
    )
    return m, l, jnp.concatenate(acc, axis=-1)
