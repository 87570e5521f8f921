"""The cache's state: its static configuration, its array leaves, and :func:`init`.

The leaves are a pool of code pages plus per-sequence bookkeeping (lengths, page table);
everything static is in :class:`CacheConfig`, the pytree's aux data.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax import codec as _codec
from tq_jax import packing as _packing
from tq_jax import wire as _wire

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float, Int32, UInt8

__all__ = ["CacheConfig", "KVCache", "init", "nbytes", "BLOCK_BYTES", "BLOCK_TOKENS", "MIN_BLOCK_TOKENS",
           "positive_int"]

# attend's default block: the power of two of tokens whose dequantized keys (batch x kv_heads
# x block x head_dim float32) fill about BLOCK_BYTES (a CPU core's L2), at most BLOCK_TOKENS
# and at least MIN_BLOCK_TOKENS. Blocks that spill the L2 cost more than the extra loop steps
# save (benchmarks/results/kvcache.md: batch 4, 8 heads, head_dim 128 -> 64 tokens).
BLOCK_BYTES = 1 << 20
BLOCK_TOKENS = 1024
MIN_BLOCK_TOKENS = 16


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


# --------------------------------------------------------------------------- init


def positive_int(value, name: str, why: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value!r}: {why}")
    return int(value)


def _power_of_two(value, name: str, why: str) -> int:
    value = positive_int(value, name, why)
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
    batch = positive_int(batch, "batch", "the number of sequences the cache holds.")
    max_len = positive_int(max_len, "max_len", "the most tokens one sequence may hold.")
    kv_heads = positive_int(kv_heads, "kv_heads", "the number of key/value heads.")
    head_dim = positive_int(head_dim, "head_dim", "the length of each key/value vector.")
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
        num_pages = positive_int(num_pages, "num_pages", "pages in the shared pool.")
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
