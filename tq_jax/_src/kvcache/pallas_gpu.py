"""Decode attention over a :mod:`tq_jax._src.kvcache` cache as one Pallas kernel for GPUs
(the Triton lowering).

One program per (sequence, KV head, split): it serves the head's whole query group
(``rows = group * q_len`` rows, padded to a power of two of at least 16 for the tensor
cores) and walks its share of the sequence's tokens in blocks of ``block`` tokens (a
``fori_loop`` inside the kernel, as flash-decoding does: Triton programs do not revisit
output blocks in order, so the online softmax lives in registers, not in resident
output blocks as in :mod:`~tq_jax._src.kvcache.pallas_tpu`). The sequence is cut into
``splits`` equal ranges, one per program, whose online-softmax states are merged by a
few XLA ops after the call; a program whose range lies past the sequence's end does no
block.

In a block, each token's pool row is found through the page table (paged and unpaged
alike: an unpaged sequence owns one page of its whole capacity), the uint8 codes are
read byte plane by byte plane (byte ``j`` of every byte group of the row: ``[block,
head_dim / G]``), the index lanes are shifted out of them in registers (lane ``i`` of
every group, :func:`tq_jax._src.packing.plane_order`), and the codebook is looked up in
registers: a select tree on the index bits over the table's compile-time constants (half
a tree and a sign when the table is symmetric, as the Lloyd–Max tables are), or, with
``lookup="gather"``, a load from the 2**bits-entry table (a few hundred bytes, L1
resident). Each lane is scored against its slice of the planar query by one dot
(``[rows, W] x [W, block]``; a multiply-reduce when a dimension is below Triton's 16),
norms applied after the dot, masked to the coded part and causally, online softmax; the
values are accumulated per lane in the rotated domain. No float tensor of a block ever
leaves the registers.

Two modes (``Tuning.mode``). ``"exact"`` (the default) runs at about float32 accuracy:
float32 centroids, queries and probabilities, each dot as ``Tuning.dot`` (``bf16x3``: three
bf16 tensor-core passes). ``"bf16"`` runs at dense bf16 attention's accuracy: the block's
codes are looked up straight into bf16 keys and values (the 2**bits-entry table held in
bf16, scaled by the factor in [1, 2) that bf16 represents best: a table's values are each
rounded once, so their rounding repeats across tokens instead of averaging), the rotated
query and the probabilities (times the value norms) are rounded to bf16, and each dot is
one bf16 pass accumulating in float32: two passes a block where the exact mode runs six.
Its error against float64 is held to a fixed multiple of ``jax.nn.dot_product_attention``'s
over the same decoded K/V in bf16 (``BOUND`` in tests/test_kvcache_gpu_bf16.py;
docs/accelerator.md has every case). Its default block is 128 tokens, not 64.

What the kernel computes is only the *coded* part of attention: token ``t`` of sequence
``b`` counts iff ``t < hi[b]`` and (``t < sink_lo[b]`` or ``t >= sinks``) and ``t <=
last[b, r]``. It returns the online-softmax state ``(m, l, acc)`` (running max, sum, and
the accumulator in the rotated domain, planar value order), which :func:`attend` divides
and un-rotates with :func:`tq_jax._src.kvcache.scoring.finish` and which a caller holding an
exact window can merge with that window's state first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tq_jax._src import codec as _codec
from tq_jax._src import packing as _packing
from tq_jax._src.kvcache import exact as _exact
from tq_jax._src.kvcache import scoring as _scoring
from tq_jax._src.kvcache.state import KVCache

__all__ = ["attend", "partial", "Tuning", "DEFAULT_TUNING", "BF16_TUNING", "MODES", "LOOKUPS", "DOTS", "available",
           "compiler_params", "pair_table", "NO_TRITON", "NO_TILE"]

MODES = ("exact", "bf16")
LOOKUPS = ("select", "gather", "pair")
DOTS = ("bf16x3", "tf32x3", "ieee")
DEFAULT_BLOCK = {"exact": 64, "bf16": 128}  # tokens per loop step when ``Tuning.block`` is None
MIN_DOT = 16  # Triton's smallest dot dimension
ROW_TILE = 64  # query rows per program at most (a decode step has group * q_len of them)
TARGET_PROGRAMS = 1024  # splits fill about this many programs (a few waves on a ~100-SM GPU)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Static knobs of the kernel (hashable; pass as ``tuning=`` to :func:`partial` or
    :func:`tq_jax._src.kvcache.attend`).

    Attributes:
        mode: ``"exact"`` (the default) scores and accumulates at about float32 accuracy:
            float32 centroids, float32 queries and probabilities, each dot run as
            ``dot``. ``"bf16"`` is dense bf16 attention's accuracy: a block's codes are
            looked up straight into bf16 keys and values (the 2**bits-entry table in bf16),
            the rotated query and the probabilities are rounded to bf16, and each dot is
            one bf16 tensor-core pass accumulating in float32 (``dot`` does not apply).
            Its error against float64 attention is held to a fixed multiple of that of
            ``jax.nn.dot_product_attention`` over the same decoded K/V in bf16 (``BOUND``
            in tests/test_kvcache_gpu_bf16.py).
        block: tokens per loop step (a power of two >= 16; None: ``DEFAULT_BLOCK[mode]``,
            64 exact, 128 bf16).
        splits: ranges per sequence, one program each (None: about ``TARGET_PROGRAMS``
            programs in all, at most one range per block).
        lookup: ``"gather"`` (loads from the 2**bits-entry table, L1-resident; the
            default: never slower than the select tree in the GPU measurements of
            benchmarks/results/accelerator_nvidia_h200.md), ``"select"`` (a select tree
            on compile-time constants) or, in the bf16 mode only, ``"pair"``: a 4-bit side
            loads both lanes of a code byte at once, one 32-bit entry of a 256-entry table
            of bf16 pairs (no shift or mask per index, half the loads; other widths
            gather; benchmarks/accelerator.py's tuning sweep times it against ``"gather"``).
        dot: the compiled dots' algorithm: ``"bf16x3"`` and ``"tf32x3"`` run on tensor
            cores at about float32 accuracy, ``"ieee"`` is float32 FMAs (the interpreter
            always computes in float32).
        num_warps, num_stages: Triton's.
    """

    mode: str = "exact"
    block: int | None = None
    splits: int | None = None
    lookup: str = "gather"
    dot: str = "bf16x3"
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(
                f"`mode` must be one of {MODES}, got {self.mode!r}: float32-level accuracy, or dense bf16 attention's."
            )
        if self.block is not None and (
            not isinstance(self.block, int) or self.block < MIN_DOT or self.block & (self.block - 1)
        ):
            raise ValueError(
                f"`block` must be a power of two >= {MIN_DOT}, got {self.block!r}: Triton tiles are powers of two."
            )
        if self.splits is not None and (not isinstance(self.splits, int) or self.splits < 1):
            raise ValueError(f"`splits` must be None or an int >= 1, got {self.splits!r}: ranges of a sequence.")
        if self.lookup not in LOOKUPS:
            raise ValueError(f"`lookup` must be one of {LOOKUPS}, got {self.lookup!r}.")
        if self.dot not in DOTS:
            raise ValueError(f"`dot` must be one of {DOTS}, got {self.dot!r}.")
        if self.lookup == "pair" and self.mode != "bf16":
            raise ValueError(
                "`lookup='pair'` needs mode='bf16', got mode='exact': its table holds bf16 pairs; the exact "
                "mode's lookups are float32 ('gather' or 'select')."
            )

    @property
    def block_tokens(self) -> int:
        """The block actually used: ``block``, or the mode's default."""
        return self.block if self.block is not None else DEFAULT_BLOCK[self.mode]


DEFAULT_TUNING = Tuning()
BF16_TUNING = Tuning(mode="bf16")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


NO_TRITON = (
    "impl='pallas_gpu' needs Pallas's Triton backend (jax.experimental.pallas.triton), which this jax {version} "
    "does not have (jax 0.11 deprecated it): use impl='xla', or impl='auto', which falls back to it."
)


NO_TILE = (
    "impl='pallas_gpu' needs head_dim / plane_count to be a power of two for both widths (Triton tiles), got "
    "head_dim={dim} at key_bits={kb}, value_bits={vb}: use impl='xla'."
)


def _triton():
    """The ``jax.experimental.pallas.triton`` module, or None when this jax lacks it."""
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:
        return None
    cls = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams", None)
    return pltriton if cls is not None else None


def available() -> bool:
    """Whether this jax has the Pallas Triton backend the compiled kernel needs (the
    interpreter, on CPU, does not need it)."""
    return _triton() is not None


def compiler_params(num_warps: int, num_stages: int):
    """Triton compiler parameters under whichever name this jax version uses
    (``CompilerParams`` since jax 0.6, ``TritonCompilerParams`` before). Passing them is
    also what selects the Triton lowering over Mosaic GPU, the default GPU backend.

    Raises:
        RuntimeError: this jax has no Triton backend (:data:`NO_TRITON`).
    """
    pltriton = _triton()
    if pltriton is None:
        raise RuntimeError(NO_TRITON.format(version=jax.__version__))
    cls = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


# --------------------------------------------------------------------------- in-kernel pieces


def _lane(byte_planes, i: int, bits: int):
    """Index lane ``i`` of every byte group (int32 ``[T, W]``) from the group's byte planes
    (int32, 0..255): bits ``i*bits ..`` of the group, LSB first, spanning at most two bytes."""
    first, shift = divmod(i * bits, 8)
    x = byte_planes[first] >> shift if shift else byte_planes[first]
    if shift + bits > 8:
        x = x | (byte_planes[first + 1] << (8 - shift))
    return x & ((1 << bits) - 1)


def _tree(idx, values, bits: int, dtype):
    """``values[idx]`` by a binary select tree on the low ``bits`` bits of ``idx``."""
    vals = [np.asarray(c, dtype) for c in values]
    for b in range(bits):
        on = (idx & (1 << b)) != 0
        vals = [jnp.where(on, vals[2 * i + 1], vals[2 * i]) for i in range(len(vals) // 2)]
    return vals[0]


def _select_lookup(idx, centroids: np.ndarray, bits: int, dtype):
    """``centroids[idx]`` in registers. A symmetric table (``c[n-1-i] == -c[i]`` exactly,
    as Lloyd–Max tables of a symmetric density are) needs half the tree: the top bit is
    the sign, the mirrored low bits select ``|c|``."""
    n = 1 << bits
    if bits > 1 and np.array_equal(centroids[::-1], -centroids):
        top = idx >= n // 2
        low = jnp.where(top, (n - 1) - idx, idx)
        v = _tree(low, centroids[: n // 2], bits - 1, dtype)
        return jnp.where(top, -v, v)
    return _tree(idx, centroids, bits, dtype)


def _mm(a, b, *, trans_b: bool, precision):
    """``a @ b`` (``a @ b.T`` with ``trans_b``) of 2-D tiles (both float32, or both bf16),
    float32 out: Triton's dot when every dimension is at least 16, else a broadcast
    multiply-reduce in float32."""
    bt = b.T if trans_b else b  # only used for the shape check
    if min(a.shape[0], a.shape[1], bt.shape[1]) >= MIN_DOT:  # lax's dot: pl.dot moves between versions
        dims = (((1,), (1 if trans_b else 0,)), ((), ()))
        return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if trans_b:  # [M, K] x [N, K] -> [M, N]
        return jnp.sum(a[:, None, :] * b[None, :, :], axis=2)
    return jnp.sum(a[:, :, None] * b[None, :, :], axis=1)  # [M, K] x [K, N]


def pair_table(centroids: np.ndarray) -> np.ndarray:
    """int32 ``[256]``: entry ``byte`` holds the bf16 bit patterns of the centroids of both
    4-bit indices of a code byte, lane 0 (the low nibble, LSB first) in the low 16 bits,
    lane 1 (the high nibble) in the high 16 bits."""
    if len(centroids) != 16:
        raise ValueError(f"a pair table needs the 16 centroids of 4-bit codes, got {len(centroids)}.")
    bits = np.asarray(centroids, np.float32).astype(jnp.bfloat16).view(np.uint16).astype(np.uint32)  # numpy, ml_dtypes
    byte = np.arange(256)
    return (bits[byte & 15] | (bits[byte >> 4] << np.uint32(16))).view(np.int32)


@functools.lru_cache(maxsize=64)  # keyed by a table's values (plain floats); 2**bits <= 256 entries each
def _bf16_scale(centroids: tuple) -> float:
    """The factor ``s`` in [1, 2) whose table ``s * c`` bf16 represents best (least squared
    rounding error in the table's own units): bf16 keeps 8 significant bits, and a table's
    2**bits values are each rounded once, so their rounding repeats across every token
    instead of averaging; scaling moves them onto the bf16 grid. Powers of two change
    nothing, so [1, 2) in steps of 1/1024 covers every choice."""
    c = np.asarray(centroids, np.float64)
    s = 1.0 + np.arange(1024, dtype=np.float64)[:, None] / 1024.0
    scaled = s * c[None, :]
    err = np.sum(((scaled.astype(np.float32).astype(jnp.bfloat16).astype(np.float64) - scaled) / s) ** 2, axis=1)
    return float(s[int(np.argmin(err)), 0])


def _kernel(hi_ref, lo_ref, table_ref, last_ref, q_ref, kc_ref, kn_ref, vc_ref, vn_ref, *refs, st):
    """One (sequence, KV head, row tile, split). ``st`` holds the static facts (a dict)."""
    kpair_ref = vpair_ref = None
    if st["lookup"] == "pair":
        ktab_ref, vtab_ref, kpair_ref, vpair_ref, m_ref, l_ref, acc_ref = refs
    elif st["lookup"] == "gather":
        ktab_ref, vtab_ref, m_ref, l_ref, acc_ref = refs
    else:
        m_ref, l_ref, acc_ref = refs
    b, h = pl.program_id(0), pl.program_id(1)
    s = lax.rem(pl.program_id(2), st["splits"])  # axis 2 is (row tile, split)
    blk, page, pps, chunk, sinks = st["block"], st["page"], st["pps"], st["chunk"], st["sinks"]
    kbits, vbits, precision, cdt = st["kbits"], st["vbits"], st["precision"], st["dtype"]
    hi, sink_lo = hi_ref[b], lo_ref[b]
    start = s * chunk
    end = jnp.minimum(start + chunk, hi)
    n_blocks = jnp.maximum(end - start + (blk - 1), 0) // blk
    last = last_ref[...]  # [Rp]
    gk = st["gk"]
    q = [q_ref[i] for i in range(gk)]  # [Rp, Wk] per key lane

    def lookup(idx, bits, which):
        if st["lookup"] in ("gather", "pair"):
            return (ktab_ref if which == "k" else vtab_ref)[idx]
        return _select_lookup(idx, st["kc"] if which == "k" else st["vc"], bits, cdt)

    def lanes(codes_ref, rows, bits, per_group, g):
        planes = [codes_ref[rows, h, :, j].astype(jnp.int32) & 0xFF for j in range(per_group)]
        return [_lane(planes, i, bits) for i in range(g)]

    def dequantized(codes_ref, rows, bits, per_group, g, which):
        """The block's vectors in planar lanes, ``g`` tiles ``[T, W]`` of ``cdt``."""
        pair_ref = kpair_ref if which == "k" else vpair_ref
        if pair_ref is not None and bits == 4:  # both lanes of a byte from one 32-bit entry
            w = pair_ref[codes_ref[rows, h, :, 0].astype(jnp.int32) & 0xFF]  # [T, W] int32
            low = lax.bitcast_convert_type(lax.shift_left(w, jnp.int32(16)), jnp.float32)  # exact bf16 values
            high = lax.bitcast_convert_type(w & jnp.int32(-65536), jnp.float32)
            return [low.astype(cdt), high.astype(cdt)]
        return [lookup(idx, bits, which) for idx in lanes(codes_ref, rows, bits, per_group, g)]

    def body(j, carry):
        m, l, acc = carry
        tok = start + j * blk + lax.broadcasted_iota(jnp.int32, (blk,), 0)
        coded = (tok < hi) & ((tok < sink_lo) | (tok >= sinks))  # [T]
        col = jnp.minimum(lax.div(tok, page), pps - 1)
        rows = jnp.maximum(table_ref[b, col], 0) * page + lax.rem(tok, page)  # pool rows, in bounds
        kn = jnp.where(coded, kn_ref[rows, h].astype(jnp.float32), 0.0)
        vn = jnp.where(coded, vn_ref[rows, h].astype(jnp.float32), 0.0)
        sc = None
        for qi, k in zip(q, dequantized(kc_ref, rows, kbits, st["pgk"], gk, "k")):  # k [T, Wk]: dequantized once
            part = _mm(qi, k, trans_b=True, precision=precision)  # [Rp, T]
            sc = part if sc is None else sc + part
        mask = coded[None, :] & (tok[None, :] <= last[:, None])  # [Rp, T]
        if st["sliding"]:  # a sliding window: nothing at or below last - W
            mask &= tok[None, :] > last[:, None] - st["sliding"]
        sc = jnp.where(mask, sc * kn[None, :], -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no token seen yet
        p = jnp.where(mask, jnp.exp(sc - m_safe[:, None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=1)
        pv = (p * vn[None, :]).astype(cdt)  # bf16 mode: the probabilities rounded as dense bf16 attention's
        acc = tuple(
            alpha[:, None] * a + _mm(pv, v, trans_b=False, precision=precision)
            for a, v in zip(acc, dequantized(vc_ref, rows, vbits, st["pgv"], st["gv"], "v"))
        )
        return m_new, l, acc

    rp, wv = last.shape[0], st["wv"]
    init = (
        jnp.full((rp,), -jnp.inf, jnp.float32),
        jnp.zeros((rp,), jnp.float32),
        tuple(jnp.zeros((rp, wv), jnp.float32) for _ in range(st["gv"])),
    )
    m, l, acc = lax.fori_loop(0, n_blocks, body, init)
    m_ref[...] = m
    l_ref[...] = l
    for i, a in enumerate(acc):
        acc_ref[i] = a


# --------------------------------------------------------------------------- the call


def _splits(tuning: Tuning, programs: int, capacity_blocks: int) -> int:
    if tuning.splits is not None:
        return max(1, min(tuning.splits, capacity_blocks))
    want = -(-TARGET_PROGRAMS // programs)
    return max(1, min(_pow2(want), capacity_blocks))


def partial(cache: KVCache, query: _scoring.Query, *, interpret: bool, tuning: Tuning = DEFAULT_TUNING):
    """The coded part of attention as online-softmax state ``(m, l, acc)``: ``m``, ``l``
    float32 ``[B, H, R]`` (``m`` is -inf and ``l`` 0 for a row that sees no coded token),
    ``acc`` float32 ``[B, H, R, D]`` in the rotated value domain, planar value order.

    The coded part is ``t < hi[b]`` and (``t < sink_lo[b]`` or ``t >= sinks``), and ``t <=
    query.last[b, r]`` (:func:`tq_jax._src.kvcache.scoring.coded_mask`; ``hi``, ``sink_lo`` and
    ``sinks`` are the query's). Traceable; shapes are checked by the caller.
    """
    cfg = cache.config
    batch, heads = cache.lengths.shape[0], cache.k_codes.shape[2]
    dim = cfg.head_dim
    rows = query.rows
    rp = max(MIN_DOT, _pow2(rows))
    rt = min(rp, ROW_TILE)  # rows per program; more rows (a prefill) take more programs
    n_rt = rp // rt
    gk, gv = _packing.plane_count(cfg.key_bits), _packing.plane_count(cfg.value_bits)
    wk, wv = dim // gk, dim // gv
    pgk, pgv = gk * cfg.key_bits // 8, gv * cfg.value_bits // 8
    if not _scoring.lanes_tile(cfg):
        raise ValueError(NO_TILE.format(dim=dim, kb=cfg.key_bits, vb=cfg.value_bits))
    hi, sink_lo, sinks = query.hi, query.sink_lo, query.sinks

    page = cfg.page_tokens
    pps = cache.page_table.shape[1]
    blk = tuning.block_tokens
    capacity_blocks = -(-pps * page // blk)
    ns = _splits(tuning, batch * heads * n_rt, capacity_blocks)
    chunk = blk * -(-capacity_blocks // ns)

    # queries: planar key order -> [B, H, gk, Rp, Wk]; padded rows see nothing (last = -1)
    qp = jnp.concatenate(query.parts, axis=-1) if len(query.parts) > 1 else query.parts[0]
    qp = qp.reshape(batch, heads, rows, gk, wk).transpose(0, 1, 3, 2, 4)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, 0), (0, rp - rows), (0, 0)))
    last = jnp.pad(query.last.astype(jnp.int32), ((0, 0), (0, rp - rows)), constant_values=-1)
    n_rows = cfg.num_pages * page
    kc = cache.k_codes.reshape(n_rows, heads, wk, pgk)
    vc = cache.v_codes.reshape(n_rows, heads, wv, pgv)
    kn = cache.k_norms.reshape(n_rows, heads)
    vn = cache.v_norms.reshape(n_rows, heads)
    ktab = np.asarray(_codec.tables(cfg.key_codec).centroids, np.float32)
    vtab = np.asarray(_codec.tables(cfg.value_codec).centroids, np.float32)

    bf16 = tuning.mode == "bf16"
    cdt = jnp.bfloat16 if bf16 else jnp.float32  # what the dots read: queries, centroids, weighted probabilities
    if bf16:
        precision = None  # one bf16 pass, float32 accumulation (the interpreter computes it exactly)
        # the rotated query as two bf16 terms (hi + lo, ~16 significant bits): dense bf16 attention
        # reads the model's query as given, while q' = R q / sqrt(d) is float32; one bf16 term
        # alone would add its rounding to every score, an error dense bf16 attention does not make
        # the tables scaled onto the bf16 grid (a table's rounding repeats on every token, so the
        # scale that rounds it least matters; docs/accelerator.md); the query carries 1 / s_k, the
        # accumulator is divided by s_v after the call
        k_scale, v_scale = _bf16_scale(tuple(ktab.tolist())), _bf16_scale(tuple(vtab.tolist()))
        ktab, vtab = (ktab * np.float32(k_scale)).astype(np.float32), (vtab * np.float32(v_scale)).astype(np.float32)
        qp = (qp * np.float32(1.0 / k_scale)).astype(jnp.bfloat16)
    elif interpret:
        precision = lax.Precision.HIGHEST
    else:
        precision = {
            "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
            "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
            "ieee": lax.Precision.HIGHEST,
        }[tuning.dot]
    st = dict(
        block=blk, page=page, pps=pps, chunk=chunk, sinks=sinks, kbits=cfg.key_bits, vbits=cfg.value_bits,
        gk=gk, gv=gv, pgk=pgk, pgv=pgv, wv=wv, lookup=tuning.lookup, precision=precision, splits=ns,
        kc=ktab, vc=vtab, dtype=cdt, sliding=query.sliding_window,
    )
    whole = lambda a: pl.BlockSpec(a.shape, lambda b, h, s, n=a.ndim: (0,) * n)  # noqa: E731
    inputs = [hi.astype(jnp.int32), sink_lo.astype(jnp.int32), cache.page_table, last, qp, kc, kn, vc, vn]
    in_specs = [whole(a) for a in inputs[:3]] + [
        pl.BlockSpec((None, rt), lambda b, h, s: (b, s // ns)),
        pl.BlockSpec((None, None, gk, rt, wk), lambda b, h, s: (b, h, 0, s // ns, 0)),
    ] + [whole(a) for a in inputs[5:]]
    if tuning.lookup in ("gather", "pair"):
        inputs += [jnp.asarray(ktab, cdt), jnp.asarray(vtab, cdt)]
        in_specs += [whole(a) for a in inputs[-2:]]
    if tuning.lookup == "pair":
        pairs = [pair_table(t) if b == 4 else np.zeros(256, np.int32) for t, b in ((ktab, cfg.key_bits), (vtab, cfg.value_bits))]
        inputs += [jnp.asarray(t) for t in pairs]
        in_specs += [whole(a) for a in inputs[-2:]]
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, ns, rp), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, ns, rp), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, ns, gv, rp, wv), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, rt), lambda b, h, s: (b, h, s % ns, s // ns)),
        pl.BlockSpec((None, None, None, rt), lambda b, h, s: (b, h, s % ns, s // ns)),
        pl.BlockSpec((None, None, None, gv, rt, wv), lambda b, h, s: (b, h, s % ns, 0, s // ns, 0)),
    ]
    kw = {} if interpret else dict(compiler_params=compiler_params(tuning.num_warps, tuning.num_stages))
    m, l, acc = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid=(batch, heads, n_rt * ns),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name=f"tq_decode_k{cfg.key_bits}v{cfg.value_bits}{'_bf16' if bf16 else ''}",
        **kw,
    )(*inputs)

    # merge the splits' states (flash-decoding's last step), then drop the padded rows
    top = jnp.max(m, axis=2)
    top_safe = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp(m - top_safe[:, :, None])  # [B, H, ns, Rp]; 0 for a split that saw nothing
    l = jnp.sum(w * l, axis=2)
    acc = jnp.sum(w[:, :, :, None, :, None] * acc, axis=2)  # [B, H, gv, Rp, Wv]
    acc = acc.transpose(0, 1, 3, 2, 4).reshape(batch, heads, rp, dim)  # planar value order
    if bf16:
        acc = acc * np.float32(1.0 / v_scale)
    return top[..., :rows], l[..., :rows], acc[:, :, :rows]


def attend(cache: KVCache, q, *, interpret: bool, tuning: Tuning = DEFAULT_TUNING):
    """:func:`tq_jax._src.kvcache.attend` with the coded part in this kernel (traceable; shapes
    checked by the caller)."""
    query = _scoring.query(cache, q)
    m, l, acc = partial(cache, query, interpret=interpret, tuning=tuning)
    return _exact.finish(cache, q, query, m, l, acc)
