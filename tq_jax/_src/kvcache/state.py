"""The cache's state: its static configuration, its array leaves, and :func:`init`.

The leaves are a pool of code pages plus per-sequence bookkeeping (lengths, page table);
everything static is in :class:`CacheConfig`, the pytree's aux data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import codec as _codec
from tq_jax._src import options as _options
from tq_jax._src import packing as _packing
from tq_jax._src import wire as _wire

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float, Int32, UInt8

__all__ = ["CacheConfig", "Codecs", "KVCache", "init", "nbytes", "BLOCK_BYTES", "BLOCK_TOKENS", "MIN_BLOCK_TOKENS",
           "DEFAULT_WINDOW", "DEFAULT_SINKS", "LOW_BITS_WINDOW",
           "default_window", "default_block_tokens", "positive_int", "power_of_two", "token_count", "resolve_options",
           "check_layout", "WINDOW_WHY", "SINKS_WHY"]

# attend's default block: the power of two of tokens whose dequantized keys (batch x kv_heads
# x block x head_dim float32) fill about BLOCK_BYTES (a CPU core's L2), at most BLOCK_TOKENS
# and at least MIN_BLOCK_TOKENS. Blocks that spill the L2 cost more than the extra loop steps
# save (benchmarks/results/kvcache.md has the block sweep behind BLOCK_BYTES).
BLOCK_BYTES = 1 << 20
BLOCK_TOKENS = 1024
MIN_BLOCK_TOKENS = 16

# The exact window init gives a cache by default: local attention leans hardest on the
# most recent tokens, and reading them exactly brings a model generating on 4/4-bit codes
# close to a bf16 cache's perplexity (benchmarks/studies/serving-smollm2.md measures it in the loop).
# KIVI, SKVQ and transformers' QuantizedCache keep 128 recent tokens exact too.
DEFAULT_WINDOW = 128
# Codes of 2 bits (turbo-2.5's values) err more per token, so they need twice the window
# to come as close to bf16 as 3- and 4-bit codes do with 128 (the same in-loop protocol,
# benchmarks/studies/serving-smollm2.md).
LOW_BITS_WINDOW = 256
# ... and its first 4 tokens (attention sinks: the tokens every head leans on most), read
# exactly beside the window; they lower the in-loop KL of every setting measured
# (benchmarks/studies/serving-smollm2.md).
DEFAULT_SINKS = 4
WINDOW_WHY = ("the most recent tokens of each sequence that attend reads exactly; 0 reads every token from "
              "its codes, and a window holds at most max_len tokens.")


def default_window(key_bits: int, value_bits: int) -> int:
    """The window :func:`init` gives when none is asked for: :data:`DEFAULT_WINDOW`, or
    :data:`LOW_BITS_WINDOW` when keys or values are coded with 2 bits or fewer."""
    return LOW_BITS_WINDOW if min(int(key_bits), int(value_bits)) <= 2 else DEFAULT_WINDOW


SINKS_WHY = "the first tokens of each sequence that attend reads exactly; at most max_len."


class Codecs:
    """The codec configs of a cache's keys and values, for any config with ``head_dim``,
    ``key_bits``, ``value_bits``, ``seed``, ``rotation`` and ``trellis`` (:class:`CacheConfig`,
    :class:`tq_jax._src.kvcache.pool.PoolConfig`)."""

    @property
    def key_codec(self) -> _codec.CodecConfig:
        return _codec.CodecConfig(self.head_dim, self.key_bits, self.seed, self.rotation, trellis=self.trellis)

    @property
    def value_codec(self) -> _codec.CodecConfig:
        return _codec.CodecConfig(self.head_dim, self.value_bits, self.seed, self.rotation, trellis=self.trellis)


@dataclasses.dataclass(frozen=True)
class CacheConfig(Codecs):
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
        window: the most recent tokens of each sequence that :func:`attend` reads
            exactly (in ``dtype``), besides their codes; 0: every token from codes.
        sinks: the first tokens of each sequence read exactly likewise.
        norm_correction: the stored norm of each vector is ``|x| / |c|`` (``c`` its
            centroid vector), so decoding ``norm * R^T c`` gives TQ01 v2's
            norm-corrected reconstruction.
        trellis: the codes are trellis codes (TQ01 v2 ``TRELLIS``): a coordinate's level
            depends on the three before it, so only the XLA loop reads them.
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
    window: int = 0
    sinks: int = 0
    norm_correction: bool = False
    trellis: bool = False

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def pages_per_seq(self) -> int:
        """Columns of the page table: pages one sequence may own."""
        return -(-self.max_len // self.page_tokens)

    @property
    def exact(self) -> bool:
        """Whether some tokens are also held exactly (a window or sinks)."""
        return self.window > 0 or self.sinks > 0


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
        k_window: ``dtype`` ``(batch, window, kv_heads, head_dim)``: a ring of the last
            ``window`` keys of each sequence, position ``p`` in slot ``p % window``.
        v_window: the values' ring, likewise.
        k_sinks: ``dtype`` ``(batch, sinks, kv_heads, head_dim)``: the first ``sinks``
            keys of each sequence.
        v_sinks: the values, likewise.
        exact_from: int32 ``(batch,)``: positions below it have no exact copy (tokens
            that :func:`load` brought in as codes); 0 for tokens appended.
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
    k_window: "Array"
    v_window: "Array"
    k_sinks: "Array"
    v_sinks: "Array"
    exact_from: "Int32[Array, ' B']"


jax.tree_util.register_dataclass(
    KVCache,
    data_fields=["k_codes", "k_norms", "v_codes", "v_norms", "lengths", "page_table", "next_page", "overflow",
                 "k_window", "v_window", "k_sinks", "v_sinks", "exact_from"],
    meta_fields=["config"],
)


def _config_json(aux) -> bytes:
    (config,) = aux
    return json.dumps(dataclasses.asdict(config), sort_keys=True).encode()


def _config_from_json(data: bytes):
    return (CacheConfig(**json.loads(data)),)


# An exported program (jax.export) that takes or returns a cache records its pytree; this
# lets Exported.serialize() write it (and deserialize() read it back).
if hasattr(jax, "export") and hasattr(jax.export, "register_pytree_node_serialization"):
    jax.export.register_pytree_node_serialization(
        KVCache, serialized_name="tq_jax._src.kvcache.KVCache", serialize_auxdata=_config_json,
        deserialize_auxdata=_config_from_json,
    )


# --------------------------------------------------------------------------- init


def positive_int(value, name: str, why: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value!r}: {why}")
    return int(value)


def power_of_two(value, name: str, why: str) -> int:
    value = positive_int(value, name, why)
    if value & (value - 1):
        raise ValueError(f"`{name}` must be a power of two, got {value}: {why}")
    return value


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def resolve_options(options, overrides: dict) -> _options.Options:
    """The cache's codec settings as one validated :class:`tq_jax.Options`."""
    given = {k: v for k, v in overrides.items() if v is not None}
    # The settings front door every API shares (validated by Options, with its messages);
    # no options: 4/4 bits, TQ01 v1's settings.
    opts = _options.encode_options(options, None if options is not None else 4, **given)
    if opts.skip_first_layers or opts.skip_last_layers:
        raise ValueError(
            f"skip_first_layers={opts.skip_first_layers}, skip_last_layers={opts.skip_last_layers}: raw layers "
            f"are a property of multi-layer blobs; a cache holds one layer. Keep a layer exact by not compressing "
            f"it (a dense cache for that layer), or drop the raw-layer settings."
        )
    return opts


def default_block_tokens(batch: int, kv_heads: int, head_dim: int) -> int:
    """Tokens per step of attention's online softmax when none is asked for: the power of
    two whose float32 keys, ``batch * kv_heads * block * head_dim * 4`` bytes, fill about
    :data:`BLOCK_BYTES`, within ``MIN_BLOCK_TOKENS..BLOCK_TOKENS``."""
    per_token = batch * kv_heads * head_dim * 4  # bytes of one token's float32 keys, all sequences and heads
    fit = 1 << max(BLOCK_BYTES // per_token, 1).bit_length() - 1
    return min(max(fit, MIN_BLOCK_TOKENS), BLOCK_TOKENS)


def check_layout(head_dim: int, opts: _options.Options, dtype) -> str:
    """Check that ``head_dim`` vectors of ``opts``' widths and rotation can be stored as
    byte-aligned code rows, and that ``dtype`` is a K/V dtype; returns the dtype's name.

    Raises:
        ValueError: rows that do not pack into whole bytes, a dense rotation beyond what
            TQ01 readers accept, or an unsupported dtype.
    """
    for name, bits in (("key_bits", opts.key_bits), ("value_bits", opts.value_bits)):
        g = _packing.plane_count(int(bits))
        if head_dim % g:
            raise ValueError(
                f"head_dim={head_dim} at {name}={bits} packs into {head_dim * bits} bits, not whole bytes: "
                f"the cache stores one byte-aligned row per vector, so head_dim must be a multiple of {g} "
                f"at {bits} bits (any multiple of 8 works for every width)."
            )
    if _wire.dense_dim(head_dim, opts.rotation) > _wire.MAX_DENSE_DIM:
        raise ValueError(
            f"head_dim={head_dim} with rotation={opts.rotation!r} needs a dense rotation of side "
            f"{_wire.dense_dim(head_dim, opts.rotation)}, above the MAX_DENSE_DIM={_wire.MAX_DENSE_DIM} TQ01 "
            f"readers accept; use rotation='hadamard'."
        )
    try:
        dtype_name = jnp.dtype(dtype).name
    except TypeError:
        dtype_name = str(dtype)
    if dtype_name not in _wire.DTYPES:
        raise ValueError(f"`dtype` must be one of {_wire.DTYPES}, got {dtype!r}: the K/V dtype a TQ01 blob records.")
    return dtype_name


def init(
    batch: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    *,
    options=None,
    key_bits: int | None = None,
    value_bits: int | None = None,
    rotation: str | None = None,
    seed: int | None = None,
    norm_correction: bool | None = None,
    window: int | None = None,
    sinks: int | None = None,
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
        options: the codec settings: None (4-bit keys and values, Haar rotation, seed
            42: TQ01 v1's), a preset name of :data:`tq_jax.PRESETS` (``"turbo-3.5"``:
            K4V3, ``"turbo-2.5"``: K3V2, both Hadamard with norm correction), or a
            :class:`tq_jax.Options`. The cache uses its ``key_bits``, ``value_bits``,
            ``rotation``, ``seed``, ``norm_correction`` and ``trellis`` (trellis codes,
            ``"turbo-4t"``: :func:`attend` then runs the XLA loop); norms are float16 in the
            cache whatever ``norm_dtype``/``norm_bits`` say (log-coded norms and
            checksums are storage formats of blobs, not of the cache).
        key_bits, value_bits, rotation, seed, norm_correction: override those fields
            of ``options``.
        window: the most recent tokens of each sequence held exactly as well (in
            ``dtype``), which :func:`attend` reads instead of their codes; default
            :func:`default_window`: :data:`DEFAULT_WINDOW` (128), or
            :data:`LOW_BITS_WINDOW` (256) when keys or values have 2 bits or fewer (as in
            ``"turbo-2.5"``), at most ``max_len``; 0 reads every token from codes.
        sinks: the first tokens of each sequence held exactly as well (attention
            sinks); default :data:`DEFAULT_SINKS` (at most ``max_len``); 0..max_len.
        page_size: tokens per page (a power of two) for a paged cache; None: one
            page of the whole capacity per sequence.
        num_pages: pages in the pool (paged only); default ``batch * ceil(max_len /
            page_size)``, enough for every sequence to reach ``max_len``.
        dtype: the model's K/V dtype (bfloat16, float16 or float32).
        block_tokens: tokens per step of :func:`attend` (a power of two; default: the
            power of two whose float32 keys, ``batch * kv_heads * block * head_dim * 4``
            bytes, fill about ``BLOCK_BYTES``, within ``16..BLOCK_TOKENS``).

    Every token is quantized once, when it is appended, so its codes never change and
    :func:`export` writes the same bytes whatever the window; the window costs
    ``window + sinks`` tokens of ``dtype`` K/V per sequence and nothing else per token.

    Returns:
        :class:`KVCache` with every sequence empty.

    Raises:
        ValueError: a non-positive size, unsupported bits/rotation/dtype, a
            ``head_dim`` whose rows do not pack into whole bytes, a window or sink
            count outside ``0..max_len``, an unknown preset.

    Examples:
        >>> cache = init(batch=1, max_len=64, kv_heads=2, head_dim=64, window=16)
        >>> cache.k_codes.shape, cache.k_norms.dtype, cache.k_window.shape
        ((1, 64, 2, 32), dtype('float16'), (1, 16, 2, 64))
    """
    batch = positive_int(batch, "batch", "the number of sequences the cache holds.")
    max_len = positive_int(max_len, "max_len", "the most tokens one sequence may hold.")
    kv_heads = positive_int(kv_heads, "kv_heads", "the number of key/value heads.")
    head_dim = positive_int(head_dim, "head_dim", "the length of each key/value vector.")
    opts = resolve_options(
        options,
        dict(key_bits=key_bits, value_bits=value_bits, rotation=rotation, seed=seed, norm_correction=norm_correction),
    )
    window = min(default_window(opts.key_bits, opts.value_bits), max_len) if window is None else token_count(window, "window", max_len, WINDOW_WHY)
    sinks = min(DEFAULT_SINKS, max_len) if sinks is None else token_count(sinks, "sinks", max_len, SINKS_WHY)
    dtype_name = check_layout(head_dim, opts, dtype)
    if block_tokens is not None:
        block_tokens = power_of_two(block_tokens, "block_tokens", "tokens per step of attend's online softmax.")
    default_block = default_block_tokens(batch, kv_heads, head_dim)
    if page_size is None:
        if num_pages is not None:
            raise ValueError("`num_pages` applies to a paged cache only: pass page_size=... as well, or drop num_pages.")
        block = min(block_tokens or default_block, _next_pow2(max_len))
        page_tokens = -(-max_len // block) * block  # capacity, a whole number of blocks
        num_pages = batch
    else:
        page_size = power_of_two(page_size, "page_size", "tokens per page of the pool.")
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
        key_bits=opts.key_bits,
        value_bits=opts.value_bits,
        rotation=opts.rotation,
        seed=opts.seed,
        dtype=dtype_name,
        page_size=page_size,
        num_pages=int(num_pages),
        page_tokens=page_tokens,
        block_tokens=block,
        window=window,
        sinks=sinks,
        norm_correction=opts.norm_correction,
        trellis=opts.trellis,
    )
    return KVCache(config=config, **_empty_leaves(config))


@functools.partial(jax.jit, static_argnums=0)
def _empty_leaves(config: CacheConfig) -> dict:
    """The leaves of an empty cache of ``config``, made by one compiled program per
    configuration rather than one per zero array of a new shape (about a dozen for an
    init; benchmarks/results/kvcache_init.md)."""
    batch, kv_heads, head_dim, dtype = config.batch, config.kv_heads, config.head_dim, config.dtype
    pool = (config.num_pages, config.page_tokens, kv_heads)
    if config.paged:
        table = jnp.full((batch, config.pages_per_seq), -1, jnp.int32)
        next_page = jnp.zeros((), jnp.int32)
    else:
        table = jnp.arange(batch, dtype=jnp.int32)[:, None]
        next_page = jnp.asarray(batch, jnp.int32)
    exact = lambda n: jnp.zeros((batch, n, kv_heads, head_dim), dtype)  # noqa: E731
    return dict(
        k_codes=jnp.zeros(pool + (config.key_codec.row_nbytes,), jnp.uint8),
        k_norms=jnp.zeros(pool, jnp.float16),
        v_codes=jnp.zeros(pool + (config.value_codec.row_nbytes,), jnp.uint8),
        v_norms=jnp.zeros(pool, jnp.float16),
        lengths=jnp.zeros((batch,), jnp.int32),
        page_table=table,
        next_page=next_page,
        overflow=jnp.zeros((config.num_pages, kv_heads), jnp.bool_),
        k_window=exact(config.window),
        v_window=exact(config.window),
        k_sinks=exact(config.sinks),
        v_sinks=exact(config.sinks),
        exact_from=jnp.zeros((batch,), jnp.int32),
    )


def token_count(value, name: str, max_len: int, why: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value <= max_len:
        raise ValueError(f"`{name}` must be an int in 0..max_len={max_len}, got {value!r}: {why}")
    return int(value)


def nbytes(cache: KVCache) -> int:
    """Bytes held by the cache's array leaves (codes, norms, lengths, page table, flags)."""
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(cache))
