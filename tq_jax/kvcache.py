"""A TurboQuant-compressed KV cache that attention reads directly.

The cache keeps, per token and KV head, exactly what a TQ01 blob keeps: the packed
Lloyd–Max codes of the key and of the value (uint8 rows, as :func:`tq_jax.encode`
packs them) and one float16 norm each. Nothing is decompressed into a
``(tokens, head_dim)`` float tensor: :func:`attend` rotates each query once, scores
the codes block by block with an online softmax (flash-decoding), accumulates the
values in the rotated domain and un-rotates once per query.

::

    cache = kvcache.init(batch=2, max_len=4096, kv_heads=8, head_dim=128,
                         key_bits=4, value_bits=4, rotation="haar", seed=42)
    cache = kvcache.append(cache, k, v)                 # k, v: [batch, new, kv_heads, head_dim]
    cache = kvcache.append(cache, k, v, new_lengths=n)  # ragged: n[b] valid tokens of sequence b
    out = kvcache.attend(cache, q)                      # q: [batch, q_len, q_heads, head_dim]
    blob = kvcache.export(cache, seq=0)                 # TQ01 bytes of [2, 1, T, kv_heads, head_dim]
    cache = kvcache.load(cache, blob, seq=0)            # codes copied in, nothing re-quantized

Storage is a pool of pages ``[num_pages, page_size, kv_heads, row_bytes]`` plus a
per-sequence page table (vLLM's paged KV cache, tpu-inference's ragged paged
attention). Without ``page_size`` each sequence owns one page of its whole capacity;
with it, pages are taken from the pool in order as sequences grow.

A vector appended gets the codes and float16 norm that :func:`tq_jax.dumps` gives it
(the same encoder, and norms rounded to float16 as ``numpy.astype`` does), so
:func:`export` writes the bytes ``dumps`` writes for that sequence's K/V, and
:func:`load` copies a blob's codes in without re-quantizing.

References:
    Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal
    Distortion Rate", arXiv:2504.19874 (2025).
    Dao et al., "Flash-Decoding for long-context inference" (2023).
    Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention",
    SOSP 2023.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tq_jax import blob as _blob
from tq_jax import codec as _codec
from tq_jax import options as _options
from tq_jax import packing as _packing
from tq_jax import wire as _wire

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float, Int32, UInt8

__all__ = ["CacheConfig", "KVCache", "init", "append", "attend", "export", "load", "nbytes", "BLOCK_TOKENS", "BLOCK_BYTES"]

# attend's default block: the power of two of tokens whose dequantized keys (batch x kv_heads
# x block x head_dim float32) fill about BLOCK_BYTES (a CPU core's L2), at most BLOCK_TOKENS
# and at least MIN_BLOCK_TOKENS. Blocks that spill the L2 cost more than the extra loop steps
# save (benchmarks/results/kvcache.md: batch 4, 8 heads, head_dim 128 -> 64 tokens).
BLOCK_BYTES = 1 << 20
BLOCK_TOKENS = 1024
MIN_BLOCK_TOKENS = 16
IMPLS = ("xla", "pallas")
_HI = lax.Precision.HIGHEST

# --------------------------------------------------------------------------- messages

MAX_LEN_EXCEEDED = (
    "append would grow sequence {seq} past max_len={max_len}: it holds {length} tokens and "
    "{new} more were given ({total} in all). The cache is unchanged. Append fewer tokens "
    "(new_lengths=...), or init the cache with a larger max_len."
)
POOL_EXHAUSTED = (
    "{what} needs {need} new page(s) of {page_size} tokens but only {free} of the pool's "
    "{num_pages} are free (pages are never returned). The cache is unchanged. Init the cache "
    "with more pages (num_pages=...) or leave num_pages at its default, batch * "
    "ceil(max_len / page_size), which always suffices."
)
NORM_OVERFLOW = (
    "{count} appended vector(s) have an L2 norm that float16 cannot hold (float16 tops out "
    "at 65504). The cache stores norms as float16, as TQ01 version 1 does, so these vectors "
    "would attend as inf/NaN. The cache is unchanged. Scale the keys/values down before "
    "appending."
)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Everything static about a cache: plain hashable scalars (pytree aux data).

    Attributes:
        batch: sequences in the cache.
        max_len: most tokens one sequence may hold.
        kv_heads: key/value heads.
        head_dim: vector length; ``head_dim * bits % 8 == 0`` for both widths, so each
            vector packs into whole bytes (the TQ01 stream is then the rows end to end).
        key_bits: bits per key coordinate, 1..8.
        value_bits: bits per value coordinate, 1..8.
        rotation: ``"haar"`` or ``"hadamard"`` (both K and V).
        seed: rotation seed (both K and V, as in a TQ01 blob).
        dtype: the K/V dtype name; appended K/V are cast to it first, and exported
            blobs record it as the original dtype.
        page_size: tokens per page, or None for one page per sequence.
        num_pages: pages in the pool.
        page_tokens: tokens per page of the pool (``page_size``, or the per-sequence
            capacity when unpaged).
        block_tokens: tokens per step of :func:`attend`'s online softmax.
    """

    batch: int
    max_len: int
    kv_heads: int
    head_dim: int
    key_bits: int
    value_bits: int
    rotation: str
    seed: int
    dtype: str
    page_size: int | None
    num_pages: int
    page_tokens: int
    block_tokens: int

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def pages_per_seq(self) -> int:
        """Columns of the page table: pages one sequence may own."""
        return -(-self.max_len // self.page_tokens)

    @property
    def key_codec(self) -> _codec.CodecConfig:
        return _codec.CodecConfig(self.head_dim, self.key_bits, self.seed, self.rotation)

    @property
    def value_codec(self) -> _codec.CodecConfig:
        return _codec.CodecConfig(self.head_dim, self.value_bits, self.seed, self.rotation)


@dataclasses.dataclass(frozen=True)
class KVCache:
    """The cache: a pytree whose leaves are arrays and whose aux data is :class:`CacheConfig`.

    Attributes:
        config: static configuration.
        k_codes: uint8 ``(num_pages, page_tokens, kv_heads, head_dim*key_bits/8)``.
        k_norms: float16 ``(num_pages, page_tokens, kv_heads)``.
        v_codes: uint8 ``(num_pages, page_tokens, kv_heads, head_dim*value_bits/8)``.
        v_norms: float16 ``(num_pages, page_tokens, kv_heads)``.
        lengths: int32 ``(batch,)`` tokens held per sequence.
        page_table: int32 ``(batch, pages_per_seq)``: pool page of each sequence page,
            -1 while unallocated (allocated pages form a prefix of each row).
        next_page: int32 ``()``: the next free page of the pool (pages go out in order).
        overflow: bool ``(num_pages, kv_heads)``: the page holds a vector whose finite
            norm overflowed float16 (it is stored as inf); :func:`export` refuses such pages.
    """

    config: CacheConfig
    k_codes: "UInt8[Array, 'P S H rk']"
    k_norms: "Float[Array, 'P S H']"
    v_codes: "UInt8[Array, 'P S H rv']"
    v_norms: "Float[Array, 'P S H']"
    lengths: "Int32[Array, ' B']"
    page_table: "Int32[Array, 'B pages']"
    next_page: "Int32[Array, '']"
    overflow: "Array"


jax.tree_util.register_dataclass(
    KVCache,
    data_fields=["k_codes", "k_norms", "v_codes", "v_norms", "lengths", "page_table", "next_page", "overflow"],
    meta_fields=["config"],
)


# --------------------------------------------------------------------------- init


def _positive_int(value, name: str, why: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value!r}: {why}")
    return int(value)


def _power_of_two(value, name: str, why: str) -> int:
    value = _positive_int(value, name, why)
    if value & (value - 1):
        raise ValueError(f"`{name}` must be a power of two, got {value}: {why}")
    return value


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def init(
    batch: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    key_bits: int = 4,
    value_bits: int = 4,
    rotation: str = "haar",
    seed: int = 42,
    *,
    page_size: int | None = None,
    num_pages: int | None = None,
    dtype=jnp.bfloat16,
    block_tokens: int | None = None,
) -> KVCache:
    """An empty cache.

    Args:
        batch: sequences.
        max_len: most tokens per sequence.
        kv_heads: key/value heads.
        head_dim: vector length (``head_dim * bits`` a multiple of 8 for both widths).
        key_bits: bits per key coordinate, 1..8.
        value_bits: bits per value coordinate, 1..8.
        rotation: ``"haar"`` (TQ01 v1's) or ``"hadamard"`` (v2's fast one).
        seed: rotation seed.
        page_size: tokens per page (a power of two) for a paged cache; None: one
            page of the whole capacity per sequence.
        num_pages: pages in the pool (paged only); default ``batch * ceil(max_len /
            page_size)``, enough for every sequence to reach ``max_len``.
        dtype: the model's K/V dtype (bfloat16, float16 or float32).
        block_tokens: tokens per step of :func:`attend` (a power of two; default: the
            power of two whose float32 keys, ``batch * kv_heads * block * head_dim * 4``
            bytes, fill about ``BLOCK_BYTES``, within ``16..BLOCK_TOKENS``).

    Returns:
        :class:`KVCache` with every sequence empty.

    Raises:
        ValueError: a non-positive size, unsupported bits/rotation/dtype, or a
            ``head_dim`` whose rows do not pack into whole bytes.

    Examples:
        >>> cache = init(batch=1, max_len=64, kv_heads=2, head_dim=64)
        >>> cache.k_codes.shape, cache.k_norms.dtype
        ((1, 64, 2, 32), dtype('float16'))
    """
    batch = _positive_int(batch, "batch", "the number of sequences the cache holds.")
    max_len = _positive_int(max_len, "max_len", "the most tokens one sequence may hold.")
    kv_heads = _positive_int(kv_heads, "kv_heads", "the number of key/value heads.")
    head_dim = _positive_int(head_dim, "head_dim", "the length of each key/value vector.")
    for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
        if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 1 <= bits <= 8:
            raise ValueError(f"`{name}` must be an int in 1..8, got {bits!r}: it sets the codebook size 2**bits.")
        g = _packing.plane_count(int(bits))
        if head_dim % g:
            raise ValueError(
                f"head_dim={head_dim} at {name}={bits} packs into {head_dim * bits} bits, not whole bytes: "
                f"the cache stores one byte-aligned row per vector, so head_dim must be a multiple of {g} "
                f"at {bits} bits (any multiple of 8 works for every width)."
            )
    # CodecConfig validates rotation and seed with its own messages
    _codec.CodecConfig(head_dim, int(key_bits), seed, rotation)
    if _wire.dense_dim(head_dim, rotation) > _wire.MAX_DENSE_DIM:
        raise ValueError(
            f"head_dim={head_dim} with rotation={rotation!r} needs a dense rotation of side "
            f"{_wire.dense_dim(head_dim, rotation)}, above the MAX_DENSE_DIM={_wire.MAX_DENSE_DIM} TQ01 readers "
            f"accept; use rotation='hadamard'."
        )
    try:
        dtype_name = jnp.dtype(dtype).name
    except TypeError:
        dtype_name = str(dtype)
    if dtype_name not in _wire.DTYPES:
        raise ValueError(f"`dtype` must be one of {_wire.DTYPES}, got {dtype!r}: the K/V dtype a TQ01 blob records.")
    if block_tokens is not None:
        block_tokens = _power_of_two(block_tokens, "block_tokens", "tokens per step of attend's online softmax.")
    per_token = batch * kv_heads * head_dim * 4  # bytes of one token's float32 keys, all sequences and heads
    fit = 1 << max(BLOCK_BYTES // per_token, 1).bit_length() - 1
    default_block = min(max(fit, MIN_BLOCK_TOKENS), BLOCK_TOKENS)
    if page_size is None:
        if num_pages is not None:
            raise ValueError("`num_pages` applies to a paged cache only: pass page_size=... as well, or drop num_pages.")
        block = min(block_tokens or default_block, _next_pow2(max_len))
        page_tokens = -(-max_len // block) * block  # capacity, a whole number of blocks
        num_pages = batch
    else:
        page_size = _power_of_two(page_size, "page_size", "tokens per page of the pool.")
        page_tokens = page_size
        block = block_tokens or default_block
        if num_pages is None:
            num_pages = batch * -(-max_len // page_size)
        num_pages = _positive_int(num_pages, "num_pages", "pages in the shared pool.")
    config = CacheConfig(
        batch=batch,
        max_len=max_len,
        kv_heads=kv_heads,
        head_dim=head_dim,
        key_bits=int(key_bits),
        value_bits=int(value_bits),
        rotation=rotation,
        seed=int(seed),
        dtype=dtype_name,
        page_size=page_size,
        num_pages=int(num_pages),
        page_tokens=page_tokens,
        block_tokens=block,
    )
    rk = config.key_codec.row_nbytes
    rv = config.value_codec.row_nbytes
    pool = (config.num_pages, page_tokens, kv_heads)
    if config.paged:
        table = jnp.full((batch, config.pages_per_seq), -1, jnp.int32)
        next_page = jnp.zeros((), jnp.int32)
    else:
        table = jnp.arange(batch, dtype=jnp.int32)[:, None]
        next_page = jnp.asarray(batch, jnp.int32)
    return KVCache(
        config=config,
        k_codes=jnp.zeros(pool + (rk,), jnp.uint8),
        k_norms=jnp.zeros(pool, jnp.float16),
        v_codes=jnp.zeros(pool + (rv,), jnp.uint8),
        v_norms=jnp.zeros(pool, jnp.float16),
        lengths=jnp.zeros((batch,), jnp.int32),
        page_table=table,
        next_page=next_page,
        overflow=jnp.zeros((config.num_pages, kv_heads), jnp.bool_),
    )


def nbytes(cache: KVCache) -> int:
    """Bytes held by the cache's array leaves (codes, norms, lengths, page table, flags)."""
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(cache))


# --------------------------------------------------------------------------- write


def _write(cache: KVCache, seqs, starts, counts, kc, kn, vc, vn, over):
    """Store ``counts[i]`` tokens of rows ``i`` at positions ``starts[i]...`` of sequence
    ``seqs[i]``, taking pages from the pool in order (row by row, page by page).

    Tokens past ``max_len``, or past the pages left in the pool, are dropped; each
    sequence's length becomes ``starts + tokens stored``. Shapes: ``seqs/starts/counts``
    int32 ``(S,)``; ``kc`` ``(S, N, H, rk)``, ``kn`` float16 ``(S, N, H)``, likewise
    ``vc``/``vn``; ``over`` bool ``(S, N, H)``. Returns the new cache and the number of
    stored vectors flagged in ``over``.
    """
    cfg = cache.config
    ps, n_pages = cfg.page_tokens, cfg.num_pages
    n_tok = kc.shape[1]
    table = cache.page_table[seqs]  # (S, pages)
    pps = table.shape[1]
    have = jnp.sum(table >= 0, axis=1, dtype=jnp.int32)
    want_end = jnp.minimum(starts + counts, cfg.max_len)
    need = (want_end + ps - 1) // ps
    req = jnp.maximum(need - have, 0)
    before = jnp.cumsum(req) - req  # pages requested by earlier rows
    alloc = jnp.clip(n_pages - cache.next_page - before, 0, req)
    col = jnp.arange(pps, dtype=jnp.int32)[None, :]
    fresh = (col >= have[:, None]) & (col < (have + alloc)[:, None])
    table = jnp.where(fresh, cache.next_page + before[:, None] + col - have[:, None], table)
    cap = jnp.minimum(cfg.max_len, (have + alloc) * ps)
    stored = jnp.clip(jnp.minimum(want_end, cap) - starts, 0, counts)

    pos = starts[:, None] + jnp.arange(n_tok, dtype=jnp.int32)[None, :]  # (S, N)
    valid = jnp.arange(n_tok, dtype=jnp.int32)[None, :] < stored[:, None]
    page = jnp.take_along_axis(table, jnp.clip(pos // ps, 0, pps - 1), axis=1)
    page = jnp.where(valid, page, n_pages)  # out of bounds: the scatter drops it
    off = pos % ps
    flagged = over & valid[..., None]
    return (
        dataclasses.replace(
            cache,
            k_codes=cache.k_codes.at[page, off].set(kc, mode="drop"),
            k_norms=cache.k_norms.at[page, off].set(kn, mode="drop"),
            v_codes=cache.v_codes.at[page, off].set(vc, mode="drop"),
            v_norms=cache.v_norms.at[page, off].set(vn, mode="drop"),
            lengths=cache.lengths.at[seqs].set(starts + stored),
            page_table=cache.page_table.at[seqs].set(table),
            next_page=cache.next_page + jnp.sum(alloc, dtype=jnp.int32),
            overflow=cache.overflow.at[page].max(flagged, mode="drop"),
        ),
        jnp.sum(flagged, dtype=jnp.int32),
    )


def _f16_norms(norms):
    """float32 norms as the float16 TQ01 v1 stores (round to nearest even, like
    ``numpy.astype`` in :func:`tq_jax.dumps`), and where a finite norm became inf."""
    n16 = norms.astype(jnp.float16)
    return n16, jnp.isfinite(norms) & jnp.isinf(n16)


def _append_impl(cache: KVCache, k, v, new_lengths):
    cfg = cache.config
    dt = jnp.dtype(cfg.dtype)
    k = k if k.dtype == dt else k.astype(dt)
    v = v if v.dtype == dt else v.astype(dt)
    ek = _codec.encode(k, cfg.key_codec)
    ev = _codec.encode(v, cfg.value_codec)
    kn, k_over = _f16_norms(ek.norms)
    vn, v_over = _f16_norms(ev.norms)
    batch = k.shape[0]
    counts = jnp.clip(new_lengths, 0, k.shape[1])
    seqs = jnp.arange(batch, dtype=jnp.int32)
    return _write(cache, seqs, cache.lengths, counts, ek.packed, kn, ev.packed, vn, k_over | v_over)


_append_jit = jax.jit(_append_impl)


def _concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_kv(cache: KVCache, k, v):
    cfg = cache.config
    k = jnp.asarray(k) if not isinstance(k, jax.Array) else k
    v = jnp.asarray(v) if not isinstance(v, jax.Array) else v
    batch, heads = cache.lengths.shape[0], cache.k_codes.shape[2]
    want = f"[batch={batch}, new_tokens, kv_heads={heads}, head_dim={cfg.head_dim}]"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[0] != batch or x.shape[2] != heads or x.shape[3] != cfg.head_dim:
            raise ValueError(
                f"`{name}` must be {want}, got shape {tuple(x.shape)}: one row per sequence of the "
                f"cache, new tokens on axis 1, the cache's kv_heads and head_dim on the last two."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"`{name}` must be floating (bfloat16, float16 or float32), got {x.dtype}.")
    if k.shape != v.shape:
        raise ValueError(f"`k` and `v` must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    return k, v


def append(cache: KVCache, k, v, new_lengths=None) -> KVCache:
    """Quantize and store new tokens at the end of each sequence.

    Args:
        cache: the cache.
        k: keys ``[batch, new_tokens, kv_heads, head_dim]`` (any float dtype; cast to
            the cache's dtype first).
        v: values, same shape.
        new_lengths: int ``[batch]`` (or a scalar for all): ``new_lengths[b] <=
            new_tokens`` tokens of row ``b`` are valid and stored; the rest are ignored.
            Default: all ``new_tokens``.

    Returns:
        The cache with each sequence's length advanced by its ``new_lengths``.

    Raises:
        ValueError: shapes that do not match the cache; ``new_lengths`` outside
            ``0..new_tokens``; a sequence growing past ``max_len``; a paged pool
            without enough free pages.
        NormOverflowError: a finite vector's norm exceeds float16 (above 65504).

    The checks that need values (lengths, ``new_lengths``, norms) run when those are
    concrete, i.e. when ``append`` is called eagerly; they wait for the device. Under
    ``jit``/``vmap``/``shard_map`` they cannot raise, and the cache instead stays
    safe: ``new_lengths`` is clipped to ``0..new_tokens``, tokens beyond ``max_len``
    (or beyond the free pages of the pool) are dropped and the length stops there,
    and an overflowing norm is stored as inf and flags its page, which
    :func:`export` then refuses. NaN/inf inputs are stored as :func:`tq_jax.dumps`
    stores them (a non-finite norm): attention over such a token is non-finite for
    every query that sees it, as dense attention over the decoded blob would be.

    ``jax.jit(append, donate_argnums=0)`` updates the cache in place and compiles
    once per input shape: lengths are array leaves, the capacity is fixed.
    """
    k, v = _check_kv(cache, k, v)
    batch, n_new = k.shape[:2]
    if new_lengths is None:
        new_lengths = jnp.full((batch,), n_new, jnp.int32)
    else:
        new_lengths = jnp.asarray(new_lengths)
        if not jnp.issubdtype(new_lengths.dtype, jnp.integer) or new_lengths.ndim > 1 or (
            new_lengths.ndim == 1 and new_lengths.shape[0] != batch
        ):
            raise ValueError(
                f"`new_lengths` must be an int array of shape ({batch},) (or a scalar), got "
                f"{new_lengths.dtype} {tuple(new_lengths.shape)}: the count of valid tokens per sequence."
            )
        new_lengths = jnp.broadcast_to(new_lengths.astype(jnp.int32), (batch,))
    eager = _concrete(cache.lengths, new_lengths, cache.page_table, cache.next_page)
    if eager:
        _check_room(cache, np.asarray(new_lengths), n_new)
    new, overflowed = _append_jit(cache, k, v, new_lengths)
    if _concrete(overflowed) and int(overflowed):
        raise _blob.NormOverflowError(NORM_OVERFLOW.format(count=int(overflowed)))
    return new


def _check_room(cache: KVCache, n: np.ndarray, n_new: int) -> None:
    cfg = cache.config
    lengths = np.asarray(cache.lengths)
    for b in range(len(lengths)):
        if not 0 <= n[b] <= n_new:
            raise ValueError(
                f"new_lengths[{b}] = {int(n[b])} is outside 0..{n_new}: it counts the valid tokens of "
                f"sequence {b} among the {n_new} given."
            )
        if int(lengths[b]) + int(n[b]) > cfg.max_len:
            raise ValueError(
                MAX_LEN_EXCEEDED.format(
                    seq=b, max_len=cfg.max_len, length=int(lengths[b]), new=int(n[b]), total=int(lengths[b]) + int(n[b])
                )
            )
    if cfg.paged:
        have = (np.asarray(cache.page_table) >= 0).sum(axis=1)
        need = np.maximum(-(-(lengths + n) // cfg.page_tokens) - have, 0).sum()
        free = cfg.num_pages - int(cache.next_page)
        if need > free:
            raise ValueError(
                POOL_EXHAUSTED.format(
                    what="append", need=int(need), page_size=cfg.page_tokens, free=free, num_pages=cfg.num_pages
                )
            )


# --------------------------------------------------------------------------- attend


def _planes(codes, bits: int, dim: int, parts: int) -> list:
    """uint8 rows ``(..., dim*bits/8)`` -> ``parts`` uint8 index arrays ``(..., dim/parts)``
    that together hold the ``dim`` indices in planar order (:func:`tq_jax.packing.plane_order`:
    lane 0 of every group, then lane 1, ...).

    Lane ``i`` of a group of ``G = plane_count(bits)`` indices starts at bit ``i*bits`` of
    the group's bytes (LSB first) and spans at most two bytes; it is shifted out of them
    in uint8, so the unpacking stays one element-wise pass with no interleave. Part ``p``
    is lanes ``p*G/parts ...`` side by side.
    """
    g = _packing.plane_count(bits)
    per_group = g * bits // 8
    v = codes.reshape(*codes.shape[:-1], dim // g, per_group)
    lanes = []
    for i in range(g):
        first, shift = divmod(i * bits, 8)
        x = v[..., first] >> np.uint8(shift) if shift else v[..., first]
        if shift + bits > 8:  # the lane runs into the next byte
            x = x | (v[..., first + 1] << np.uint8(8 - shift))
        lanes.append(x & np.uint8((1 << bits) - 1) if bits < 8 else x)
    k = g // parts
    return [lanes[p * k] if k == 1 else jnp.concatenate(lanes[p * k : (p + 1) * k], axis=-1) for p in range(parts)]


def _parts(bits: int) -> int:
    """How many planar parts :func:`attend` keeps apart (one lookup and one dot each):
    two when a group holds two or more lanes, else one. Each part is a contiguous slice of
    the planar order, so the unpacked lanes are never concatenated into one index tensor
    (docs/kvcache.md has the measured effect)."""
    return min(_packing.plane_count(bits), 2)


def _lookup(centroids, idx):
    """``centroids[idx]`` for uint8 indices below the table's length."""
    return centroids.at[idx.astype(jnp.uint32)].get(mode="promise_in_bounds")


class _Query(NamedTuple):
    """What both attention kernels read: the queries rotated, scaled and in planar order."""

    parts: tuple  # key planes' query slices, float32 (B, H, G*Q, D/parts_k) each
    last: "Int32[Array, 'B GQ']"  # the last position row r of sequence b sees
    rows: int  # G*Q; row r = g*q_len + i (query head h*G + g, query i)


def _query(cache: KVCache, q) -> _Query:
    cfg = cache.config
    batch, q_len, q_heads, dim = q.shape
    heads = cache.k_codes.shape[2]  # local heads under shard_map
    group = q_heads // heads
    ktab = _codec.device_tables(cfg.key_codec)
    qf = q.astype(jnp.float32).reshape(batch, q_len, heads, group, dim)
    qr = _codec.rotate(qf, ktab.rotation) * np.float32(1.0 / math.sqrt(dim))  # q' = R q / sqrt(d)
    qr = qr[..., _packing.plane_order(dim, cfg.key_bits)]  # planar, like the unpacked codes
    qr = qr.transpose(0, 2, 3, 1, 4).reshape(batch, heads, group * q_len, dim)
    n = _parts(cfg.key_bits)
    parts = tuple(qr[..., p * dim // n : (p + 1) * dim // n] for p in range(n))
    pos = jnp.tile(jnp.arange(q_len, dtype=jnp.int32), group)
    last = cache.lengths[:, None] - q_len + pos[None, :]
    return _Query(parts, last, group * q_len)


def _finish(cache: KVCache, q, acc, l):
    """Output ``[B, Q, q_heads, D]`` from the accumulator (planar value order, rotated
    domain) and the softmax sum: divide, back to natural order, un-rotate once."""
    cfg = cache.config
    batch, q_len, q_heads, dim = q.shape
    heads = acc.shape[1]
    vtab = _codec.device_tables(cfg.value_codec)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # a query that sees no token: zeros
    out = out[..., np.argsort(_packing.plane_order(dim, cfg.value_bits))]
    out = _codec.unrotate(out, vtab.rotation)  # once per query, value rotation
    out = out.reshape(batch, heads, q_heads // heads, q_len, dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, q_heads, dim).astype(q.dtype)


def _attend_xla(cache: KVCache, q):
    cfg = cache.config
    batch, _, _, dim = q.shape
    heads = cache.k_codes.shape[2]
    kc = jnp.asarray(_codec.device_tables(cfg.key_codec).centroids)
    vc = jnp.asarray(_codec.device_tables(cfg.value_codec).centroids)
    query = _query(cache, q)
    nv = _parts(cfg.value_bits)
    lengths = cache.lengths

    ps, blk = cfg.page_tokens, cfg.block_tokens
    unit = min(ps, blk)  # pool rows gathered at once: a page, or a block inside one
    per_block, per_page = blk // unit, ps // unit
    n_units = cfg.num_pages * per_page
    kpool = cache.k_codes.reshape(n_units, unit, heads, -1)
    vpool = cache.v_codes.reshape(n_units, unit, heads, -1)
    knorm = cache.k_norms.reshape(n_units, unit, heads)
    vnorm = cache.v_norms.reshape(n_units, unit, heads)
    table = cache.page_table
    pps = table.shape[1]
    max_blocks = -(-pps * ps // blk)
    n_blocks = jnp.minimum((jnp.max(lengths) + blk - 1) // blk, max_blocks)
    scores = (((3,), (3,)), ((0, 1), (0, 1)))  # [B,H,R,d] x [B,H,T,d] -> [B,H,R,T]
    values = (((3,), (2,)), ((0, 1), (0, 1)))  # [B,H,R,T] x [B,H,T,d] -> [B,H,R,d]

    def gather(pool, uidx, j):
        """The block's rows, head-major: [B, H, T, ...]. The uint8 codes are transposed,
        never the float32 centroids they select (1/4 to 1/32 of the bytes moved; docs/
        kvcache.md has the measured effect). Unpaged, sequence b owns page b (init's
        table never changes), so the block is one slice of the pool."""
        if cfg.paged:
            g = pool[uidx]  # [B, per_block, unit, H, ...]
        else:
            g = pool.reshape(batch, per_page, *pool.shape[1:])
            g = lax.dynamic_slice_in_dim(g, j * per_block, per_block, axis=1)
        return jnp.swapaxes(g.reshape(batch, blk, *g.shape[3:]), 1, 2)

    def body(j, carry):
        m, l, acc = carry
        t0 = j * blk
        starts = t0 + jnp.arange(per_block, dtype=jnp.int32) * unit
        page = table[:, jnp.clip(starts // ps, 0, pps - 1)]  # [B, per_block]
        uidx = jnp.maximum(page, 0) * per_page + (starts % ps)[None, :] // unit
        tok = t0 + jnp.arange(blk, dtype=jnp.int32)
        present = (tok[None, :] < lengths[:, None])[:, None, :]  # [B, 1, T]
        kn = jnp.where(present, gather(knorm, uidx, j).astype(jnp.float32), 0.0)  # [B, H, T]
        vn = jnp.where(present, gather(vnorm, uidx, j).astype(jnp.float32), 0.0)
        kidx = _planes(gather(kpool, uidx, j), cfg.key_bits, dim, len(query.parts))
        # q'.c[idx] per plane, then the norm: a [T] multiply, not a [T, D] one
        s = sum(lax.dot_general(qp, _lookup(kc, ip), scores, precision=_HI) for qp, ip in zip(query.parts, kidx))
        s = s * kn[:, :, None, :]
        mask = (tok[None, None, :] <= query.last[:, :, None])[:, None]  # [B, 1, R, T]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no token seen yet
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1)
        pv = p * vn[:, :, None, :]
        vidx = _planes(gather(vpool, uidx, j), cfg.value_bits, dim, nv)
        acc = tuple(
            alpha[..., None] * a + lax.dot_general(pv, _lookup(vc, ip), values, precision=_HI)
            for a, ip in zip(acc, vidx)
        )
        return m_new, l, acc

    # The carry starts from the query (zeros_like keeps its sharding type: under shard_map
    # a fresh constant would be replicated while the loop's outputs vary by device).
    q0 = query.parts[0]
    zeros = jnp.broadcast_to(jnp.zeros_like(q0[..., :1]), q0.shape[:-1] + (dim // nv,))
    init_carry = (zeros[..., 0] - jnp.inf, zeros[..., 0], (zeros,) * nv)
    _, l, acc = lax.fori_loop(0, n_blocks, body, init_carry)
    return _finish(cache, q, jnp.concatenate(acc, axis=-1), l)


def _attend_impl(cache: KVCache, q, impl: str = "xla"):
    if impl == "pallas":
        from tq_jax import _kvcache_pallas  # Pallas loads only when asked for

        return _kvcache_pallas.attend(cache, q, interpret=jax.default_backend() == "cpu")
    return _attend_xla(cache, q)


_attend_jit = jax.jit(_attend_impl, static_argnames="impl")


def attend(cache: KVCache, q, *, impl: str = "xla") -> "Float[Array, 'batch q_len q_heads head_dim']":
    """Causal attention of ``q`` over the cache, computed on the codes.

    Query ``i`` of sequence ``b`` sits at position ``lengths[b] - q_len + i`` (the
    queries are the sequence's last ``q_len`` tokens, already appended) and sees the
    tokens up to and including that position. Query head ``h`` reads KV head
    ``h // (q_heads // kv_heads)`` (grouped-query attention).

    For each query ``q′ = R q / sqrt(head_dim)`` (``R`` the codec's rotation); token
    ``t`` scores ``n_t · Σ_j q′_j c_K[idx_tj]``; an online softmax over blocks of
    ``block_tokens`` tokens accumulates ``Σ_t p_t n'_t c_V[idx'_t]`` in the rotated
    domain, un-rotated once at the end. Memory is O(block), never O(tokens · head_dim).
    The codes are unpacked into planar order (lane ``i`` of every byte group side by
    side, :func:`tq_jax.packing.plane_order`), with ``q′`` permuted to match, so no
    interleave is ever built. The result equals dense attention over the decoded K/V (``loads(export(...))``)
    up to float32 rounding. A query that sees no token (``lengths[b] < q_len``)
    returns zeros. Norm correction (TQ01 v2's ``norm_correction``) is not applied.

    Args:
        cache: the cache.
        q: ``[batch, q_len, q_heads, head_dim]``, ``q_heads`` a multiple of kv_heads.
        impl: ``"xla"`` (the default everywhere: a ``fori_loop`` over blocks of XLA ops)
            or ``"pallas"`` (one Pallas kernel over the pages, ``tq_jax._kvcache_pallas``;
            run by the Pallas interpreter on CPU, which is correct but slow; it has not
            been timed on an accelerator, so it is not the default there either).

    Returns:
        ``[batch, q_len, q_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: a shape that does not fit the cache, or an unknown ``impl``.
    """
    cfg = cache.config
    if impl not in IMPLS:
        raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}: the XLA loop or the Pallas kernel.")
    q = jnp.asarray(q) if not isinstance(q, jax.Array) else q
    batch, heads = cache.lengths.shape[0], cache.k_codes.shape[2]
    if q.ndim != 4 or q.shape[0] != batch or q.shape[1] < 1:
        raise ValueError(
            f"`q` must be [batch={batch}, q_len >= 1, q_heads, head_dim={cfg.head_dim}], got shape "
            f"{tuple(q.shape)}: one row per sequence of the cache."
        )
    if q.shape[3] != cfg.head_dim:
        raise ValueError(
            f"`q` has head_dim {q.shape[3]} but the cache holds head_dim={cfg.head_dim}: queries and "
            f"keys must have the same length (check the model's head_dim and the cache's init)."
        )
    if q.shape[2] % heads:
        raise ValueError(
            f"`q` has {q.shape[2]} heads, not a multiple of the cache's kv_heads={heads}: grouped-query "
            f"attention maps each group of q_heads // kv_heads query heads to one KV head."
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"`q` must be floating, got {q.dtype}.")
    return _attend_jit(cache, q, impl=impl)


# --------------------------------------------------------------------------- export / load


def _check_seq(cache: KVCache, seq) -> int:
    batch = cache.config.batch
    if not isinstance(seq, (int, np.integer)) or isinstance(seq, bool) or not 0 <= seq < batch:
        raise ValueError(f"`seq` must be an int in 0..{batch - 1} (a sequence of the cache), got {seq!r}.")
    return int(seq)


def _span(cache: KVCache, seq: int, page, length: int) -> tuple[int, int]:
    """Token range ``[lo, hi)`` of sequence ``seq`` that ``page`` (None: all) covers."""
    cfg = cache.config
    if page is None:
        return 0, length
    if not cfg.paged:
        raise ValueError("`page=` needs a paged cache: init(..., page_size=...). Omit page to export the whole sequence.")
    if not isinstance(page, (int, np.integer)) or isinstance(page, bool) or not 0 <= page < cfg.pages_per_seq:
        raise ValueError(f"`page` must be an int in 0..{cfg.pages_per_seq - 1}, got {page!r}.")
    return int(page) * cfg.page_tokens, min(length, (int(page) + 1) * cfg.page_tokens)


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _writer_options(cfg: CacheConfig) -> _options.Options:
    return _options.Options(
        key_bits=cfg.key_bits, value_bits=cfg.value_bits, seed=cfg.seed, rotation=cfg.rotation, norm_dtype="float16"
    )


def _gather_impl(cache: KVCache, seq, lo, hi, *, slots: int):
    """Codes and norms of tokens ``lo...lo+slots`` of ``seq`` (one program per ``slots``),
    and whether a page holding one of the tokens ``lo...hi`` has an overflowed norm."""
    cfg = cache.config
    table = cache.page_table[seq]
    pos = lo + jnp.arange(slots, dtype=jnp.int32)
    page = jnp.maximum(table[jnp.clip(pos // cfg.page_tokens, 0, table.shape[0] - 1)], 0)
    off = pos % cfg.page_tokens
    rows = [a[page, off] for a in (cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms)]
    overflowed = jnp.any(cache.overflow[page] & (pos < hi)[:, None])
    return (*rows, overflowed)


_gather_jit = jax.jit(_gather_impl, static_argnames="slots")


def export(cache: KVCache, seq: int = 0, page: int | None = None) -> bytes:
    """TQ01 bytes of one sequence's K/V (or of one page of it), from the stored codes.

    The blob holds a tensor ``[2 (K, V), 1, T, kv_heads, head_dim]`` of the cache's
    dtype, written as :func:`tq_jax.dumps` writes it with the cache's settings
    (``key_bits``, ``value_bits``, ``rotation``, ``seed``; float16 norms): version 1
    when those are the reference's (one width of 2/3/4/6/8, Haar), version 2 otherwise.

    Args:
        cache: the cache (concrete: call outside ``jit``).
        seq: the sequence.
        page: a page of a paged cache (its tokens ``page*page_size...``), or None for
            the whole sequence.

    Returns:
        The blob.

    Raises:
        ValueError: ``seq``/``page`` out of range, or a page holding no tokens.
        NormOverflowError: a stored vector's norm overflowed float16 (appended under
            ``jit``, where :func:`append` cannot raise).
    """
    cfg = cache.config
    seq = _check_seq(cache, seq)
    length = int(_host(cache.lengths)[seq])
    lo, hi = _span(cache, seq, page, length)
    if page is not None and hi <= lo:
        raise ValueError(
            f"page {page} of sequence {seq} holds no tokens: the sequence has {length} tokens, "
            f"{cfg.page_tokens} per page."
        )
    t = hi - lo
    slots = cfg.page_tokens if page is not None else cfg.pages_per_seq * cfg.page_tokens
    *parts, overflowed = _gather_jit(cache, np.int32(seq), np.int32(lo), np.int32(hi), slots=slots)
    if bool(overflowed):
        raise _blob.NormOverflowError(
            f"sequence {seq} holds vectors whose norm overflowed float16 when appended (stored as inf): "
            f"TQ01 with float16 norms cannot represent them. Re-append them scaled down."
        )
    kc, kn, vc, vn = (_host(a)[:t] for a in parts)
    header = _writer_options(cfg).header((2, 1, t, cfg.kv_heads, cfg.head_dim), cfg.dtype)
    kn, vn = kn.reshape(-1).astype(np.float16), vn.reshape(-1).astype(np.float16)
    if len(header.segments()) == 1:  # one stream: K's vectors then V's
        sections = _wire.Sections([[kc, vc]], [np.concatenate([kn, vn])])
    else:  # a segment per group; no raw layers
        sections = _wire.Sections([[kc], [vc]], [kn, vn])
    return b"".join(_wire.pieces(header, sections))  # every section length checked against the header


def _check_blob(cfg: CacheConfig, h: _wire.Header, limit: int, where: str) -> int:
    """Tokens of a blob that matches ``cfg``; a ValueError naming the mismatch otherwise."""
    want = (2, 1, "T", cfg.kv_heads, cfg.head_dim)
    fix = (
        "export it from a cache with the same settings, or build it with tq_jax.dumps(np.stack([K, V])[:, None], "
        "key_bits=..., value_bits=..., seed=..., rotation=...) using this cache's settings"
    )
    if len(h.shape) != 5 or h.shape[:2] != (2, 1):
        raise ValueError(f"blob holds shape {h.shape}, not the K/V of one sequence {want}: {fix}.")
    value_bits = h.bits if h.value_bits is None else h.value_bits
    checks = [
        ("head_dim", h.shape[4], cfg.head_dim),
        ("kv_heads", h.shape[3], cfg.kv_heads),
        ("key bits", h.bits, cfg.key_bits),
        ("value bits", value_bits, cfg.value_bits),
        ("rotation", h.rotation, cfg.rotation),
        ("seed", h.seed, _wire.seed32(cfg.seed)),
    ]
    for name, got, expect in checks:
        if got != expect:
            raise ValueError(f"blob has {name} {got!r} but the cache uses {expect!r}: its codes mean something else; {fix}.")
    unsupported = [
        ("a QJL residual", h.use_qjl),
        ("raw layers", h.skip_first or h.skip_last),
    ]
    for what, present in unsupported:
        if present:
            raise ValueError(f"blob uses {what}, which the cache (codes and one norm per vector) cannot hold: {fix}.")
    t = h.shape[2]
    if t > limit:
        raise ValueError(f"blob holds {t} tokens but {where} holds at most {limit}.")
    return t


def _float_norms(norms) -> np.ndarray:
    """One segment's norms as floats: float16/float32 as stored, log codes decoded."""
    if isinstance(norms, _wire.NormCodes):
        return _codec.decode_log_norms(norms.ranges, norms.codes, norms.bits, norms.count)
    return norms


def _centroid_norms(codes: np.ndarray, config: _codec.CodecConfig) -> np.ndarray:
    """float32 ``|c|`` of each stored centroid vector (rows ``(..., row)``): the factor
    a norm-corrected blob's decoder divides by. The rotation keeps lengths, so decoding
    with unit norms and taking the length gives it."""
    unit = _codec.decode(_codec.Encoded(codes, np.ones(codes.shape[:-1], np.float32)), config, jnp.float32)
    return np.asarray(jnp.sqrt(jnp.sum(jnp.square(unit), axis=-1)))


def _cache_norms(norms: np.ndarray, codes: np.ndarray, config: _codec.CodecConfig, corrected: bool) -> np.ndarray:
    """The cache's float16 norms for a blob's norms (float16 kept as they are).

    A norm-corrected blob decodes ``norm * R^T c / |c|``; the cache decodes
    ``norm * R^T c``, so ``norm / |c|`` is stored (one float16 rounding).
    """
    if norms.dtype == np.float16 and not corrected:
        return norms
    n = norms.astype(np.float32)
    if corrected:
        c = _centroid_norms(codes, config)
        with np.errstate(divide="ignore", invalid="ignore"):
            n = np.where(c > 0, n / c, n)  # an all-zero centroid vector decodes as 0 either way
    n16 = n.astype(np.float16)
    over = np.isfinite(n) & np.isinf(n16)
    if over.any():
        raise _blob.NormOverflowError(
            f"{int(over.sum())} of the blob's norms exceed float16 (largest {float(n[over].max()):.6g}), "
            f"the cache's norm dtype: they cannot be loaded. Decode the blob with tq_jax.loads instead."
        )
    return n16


def _rows(p: _wire.Parsed, cfg: CacheConfig, t: int):
    """(kc, kn, vc, vn) host arrays ``(t, H, row)`` / ``(t, H)`` of a parsed blob, norms
    as the cache stores them (float16, norm correction folded in)."""
    rk, rv = cfg.key_codec.row_nbytes, cfg.value_codec.row_nbytes
    h = cfg.kv_heads
    norms = [_float_norms(n) for n in p.norms]
    if len(p.indices) == 1:
        stream, norms = p.indices[0], norms[0]
        kc, vc = stream[: t * h * rk], stream[t * h * rk :]
        kn, vn = norms[: t * h], norms[t * h :]
    else:
        (kc, vc), (kn, vn) = p.indices, norms
    kc, vc = kc.reshape(t, h, rk), vc.reshape(t, h, rv)
    nc = p.header.norm_correction
    kn = _cache_norms(kn.reshape(t, h), kc, cfg.key_codec, nc)
    vn = _cache_norms(vn.reshape(t, h), vc, cfg.value_codec, nc)
    return kc, kn, vc, vn


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((1, n) + a.shape[1:], a.dtype)
    out[0, : a.shape[0]] = a
    return out


def _load_impl(cache: KVCache, seq, start, count, final, clear_page, kc, kn, vc, vn):
    """Write ``count`` tokens at ``start`` of ``seq``, after clearing the overflow flags
    of the sequence's pages (``clear_page`` < 0: all of them; else that column), then
    set its length to ``final``."""
    table = cache.page_table[seq]
    cols = jnp.arange(table.shape[0])
    clear = (table >= 0) & ((clear_page < 0) | (cols == clear_page))
    pages = jnp.where(clear, table, cache.config.num_pages)
    cache = dataclasses.replace(cache, overflow=cache.overflow.at[pages].set(False, mode="drop"))
    seqs = jnp.reshape(seq, (1,))
    over = jnp.zeros(kn.shape, jnp.bool_)
    cache, _ = _write(cache, seqs, jnp.reshape(start, (1,)), jnp.reshape(count, (1,)), kc, kn, vc, vn, over)
    # pages taken by _write are fresh: nothing to clear there
    return dataclasses.replace(cache, lengths=cache.lengths.at[seq].set(final))


_load_jit = jax.jit(_load_impl)


def load(cache: KVCache, blob, seq: int = 0, page: int | None = None) -> KVCache:
    """Copy a TQ01 blob's codes and norms into one sequence (or one page of it).

    The codes are copied, never re-quantized. A blob with float16 norms (what
    :func:`export` and v1 writers produce) is held exactly, so :func:`export` gives it
    back (when it records the cache's dtype) and :func:`attend` reads what its writer
    stored. Other norm encodings become the cache's float16 norms with one rounding:
    float32 norms, log-coded norms (``norm_bits``, the ``turbo-*`` presets) decoded,
    and norm correction folded into the norm (``norm / |c|``: the cache then decodes
    what the blob's decoder does). Such a sequence exports as float16 norms.

    Args:
        cache: the cache (concrete: call outside ``jit``).
        blob: TQ01 bytes of ``[2, 1, T, kv_heads, head_dim]`` written with the cache's
            ``key_bits``, ``value_bits``, ``rotation`` and ``seed`` (what :func:`export`
            writes, or ``tq_jax.dumps`` with a ``turbo-*`` preset whose bits and
            rotation the cache shares). Its recorded dtype is not checked: the codes
            do not depend on it after encoding.
        seq: the sequence.
        page: None: the blob replaces the whole sequence (its length becomes T).
            A page index of a paged cache: the blob's ``T <= page_size`` tokens go to
            positions ``page*page_size...``; the sequence must already hold every
            token before the page. Loading its last page (or the next one) sets the
            length to ``page*page_size + T``; replacing an interior page needs a
            full page and keeps the length.

    Returns:
        The updated cache.

    Raises:
        WireError: the blob is malformed.
        NormOverflowError: a float32 norm (or folded norm) exceeds float16.
        ValueError: a blob of another shape/head_dim/kv_heads/bits/rotation/seed, with
            QJL or raw layers; longer than
            ``max_len`` (or than a page); a page that would leave a gap; a pool
            without enough free pages.
    """
    cfg = cache.config
    seq = _check_seq(cache, seq)
    p = _wire.parse(blob)
    length = int(_host(cache.lengths)[seq])
    table = _host(cache.page_table)[seq]
    have = int((table >= 0).sum())
    if page is None:
        t = _check_blob(cfg, p.header, cfg.max_len, f"a sequence (max_len={cfg.max_len})")
        start, final, clear_page, slots = 0, t, -1, cfg.pages_per_seq * cfg.page_tokens
    else:
        lo, _ = _span(cache, seq, page, length)
        room = min(cfg.page_tokens, cfg.max_len - lo)
        t = _check_blob(cfg, p.header, room, f"page {page} (page_size={cfg.page_tokens}, max_len={cfg.max_len})")
        if lo > length:
            raise ValueError(
                f"page {page} of sequence {seq} starts at token {lo} but the sequence holds {length} tokens: "
                f"loading it would leave a gap. Load pages in order (or the whole sequence with page=None)."
            )
        interior = length > lo + cfg.page_tokens
        if interior and t != cfg.page_tokens:
            raise ValueError(
                f"page {page} of sequence {seq} is followed by more tokens (length {length}), so it must be "
                f"replaced by a full page of {cfg.page_tokens} tokens, got {t}."
            )
        start, final, clear_page, slots = lo, (length if interior else lo + t), int(page), cfg.page_tokens
    need = max(-(-(start + t) // cfg.page_tokens) - have, 0)
    free = cfg.num_pages - int(cache.next_page)
    if cfg.paged and need > free:
        raise ValueError(
            POOL_EXHAUSTED.format(what="load", need=need, page_size=cfg.page_tokens, free=free, num_pages=cfg.num_pages)
        )
    kc, kn, vc, vn = (_pad(a, slots) for a in _rows(p, cfg, t))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return _load_jit(cache, i32(seq), i32(start), i32(t), i32(final), i32(clear_page), kc, kn, vc, vn)
