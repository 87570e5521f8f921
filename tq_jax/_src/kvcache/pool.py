"""The pool a serving engine owns for :mod:`tq_jax._src.kvcache.ragged`: its configuration, its
leaves, :func:`init_pool` and :func:`write`.

Pages of code rows and float16 norms, ``[num_pages, page_size, kv_heads, ...]``, exactly
:class:`~tq_jax._src.kvcache.KVCache`'s pool: slot ``page * page_size + offset``. :func:`write`
quantizes each new vector once (the codes and norm :func:`tq_jax._src.kvcache.append` and
:func:`tq_jax.dumps` give it) and stores it at its slot; a negative slot is padding.
Nothing in the pool knows sequences: the engine's page table, given to
:func:`tq_jax._src.kvcache.ragged.attend`, is the only map from sequences to pages.

**The exact window and sinks, kept by page.** As in the per-sequence cache, each
sequence's most recent ``window`` tokens and first ``sinks`` are read exactly (in the
model's dtype), every other token from codes. Because only the page table knows
sequences, exact copies are kept per *pool page*, in two small pools:

* window pages: ``exact_pages`` pages of exact K/V, lent to pool pages as they are
  written (a ring: the oldest loan is taken back first). With ``positions`` given, a
  page is lent one only when a token written to it is within ``window`` of the end of its
  run of consecutive positions in that write (so a long prefill takes the pages of its
  last ``window`` tokens, not all of them); without, every page written is.
* sink entries: ``sink_slots`` rows of ``sinks`` exact tokens, lent to the page where a
  token at position ``< sinks`` is written (``positions`` needed; the sinks are then a
  sequence's first page, offsets ``0..sinks-1``). An entry is free again once every row
  is overwritten by a non-sink token (the page reused); when none is free, new sinks are
  not kept.

A copy counts only while it is current: every write to a slot whose page holds a copy
updates it, a freshly lent page or entry starts with no current row, and a page whose
loan was taken back reads from codes. Attention reads exactly the longest current suffix
of each sequence's last ``window`` positions and of its sink rows, so an undersized
exact pool costs exactness, never correctness.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from tq_jax._src import wire as _wire
from tq_jax._src.kvcache import state as _state
from tq_jax._src.kvcache import write as _write

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Float, Int32, UInt8

__all__ = ["PoolConfig", "Pool", "init_pool", "write", "nbytes", "window_pages", "DEFAULT_MAX_SEQS", "NORM_OVERFLOW"]

DEFAULT_MAX_SEQS = 16  # the exact pools' default room: this many sequences at once
NORM_OVERFLOW = (
    "{count} written vector(s) have an L2 norm that float16 cannot hold (float16 tops out at 65504). The pool "
    "stores norms as float16, as TQ01 version 1 does, so these vectors would attend as inf/NaN. The pool is "
    "unchanged. Scale the keys/values down before writing."
)
MAX_SEQS_WHY = "the most sequences whose exact window and sinks the pool keeps at once (it sizes the exact pools)."


# --------------------------------------------------------------------------- state


def window_pages(window: int, page_size: int) -> int:
    """Pages the last ``window`` positions of a sequence span at most (0 without a window)."""
    return -(-(window - 1) // page_size) + 1 if window else 0


@dataclasses.dataclass(frozen=True)
class PoolConfig(_state.Codecs):
    """Everything static about a pool (pytree aux data; plain hashable scalars).

    Attributes:
        num_pages, page_size, kv_heads, head_dim: the pool's shape.
        key_bits, value_bits, rotation, seed, norm_correction, trellis: the codec settings
            (:class:`tq_jax.Options`'), as in :class:`~tq_jax._src.kvcache.CacheConfig`.
        dtype: the model's K/V dtype name (new K/V are cast to it; exact copies hold it).
        window: each sequence's most recent tokens read exactly; 0: none.
        sinks: each sequence's first tokens read exactly (at most ``page_size``); 0: none.
        exact_pages: pages of exact K/V lent to pool pages for the window.
        sink_slots: sink entries (``sinks`` exact tokens each).
    """

    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    key_bits: int
    value_bits: int
    rotation: str
    seed: int
    dtype: str
    norm_correction: bool
    window: int
    sinks: int
    exact_pages: int
    sink_slots: int
    trellis: bool = False

    @property
    def window_pages(self) -> int:
        """Pages the last ``window`` positions of a sequence span at most."""
        return window_pages(self.window, self.page_size)

    def view(self, batch: int, pages_per_seq: int, block_tokens: int) -> _state.CacheConfig:
        """The :class:`~tq_jax._src.kvcache.CacheConfig` of ``batch`` rows (query tiles) over this
        pool, each owning ``pages_per_seq`` pages: what the coded kernels read."""
        return _state.CacheConfig(
            batch=batch, max_len=pages_per_seq * self.page_size, kv_heads=self.kv_heads, head_dim=self.head_dim,
            key_bits=self.key_bits, value_bits=self.value_bits, rotation=self.rotation, seed=self.seed,
            dtype=self.dtype, page_size=self.page_size, num_pages=self.num_pages, page_tokens=self.page_size,
            block_tokens=block_tokens, window=0, sinks=self.sinks, norm_correction=self.norm_correction,
            trellis=self.trellis,
        )


@dataclasses.dataclass(frozen=True)
class Pool:
    """The pool: a pytree whose leaves are arrays and whose aux data is :class:`PoolConfig`.

    Attributes:
        config: static configuration.
        k_codes: uint8 ``(num_pages, page_size, kv_heads, head_dim*key_bits/8)``.
        k_norms: float16 ``(num_pages, page_size, kv_heads)``.
        v_codes, v_norms: the values', likewise.
        exact_k, exact_v: ``dtype`` ``(exact_pages, page_size, kv_heads, head_dim)``.
        exact_valid: bool ``(exact_pages, page_size)``: the slot's copy is current.
        exact_of: int32 ``(num_pages,)``: the window page lent to each pool page, or -1.
        exact_owner: int32 ``(exact_pages,)``: the pool page each window page serves, or -1.
        exact_next: int32 ``()``: the next window page to lend (a ring).
        sink_k, sink_v: ``dtype`` ``(sink_slots, sinks, kv_heads, head_dim)``.
        sink_valid: bool ``(sink_slots, sinks)``.
        sink_of: int32 ``(num_pages,)``: the sink entry of each pool page, or -1.
        sink_owner: int32 ``(sink_slots,)``: the pool page each entry serves, or -1.
    """

    config: PoolConfig
    k_codes: "UInt8[Array, 'P S H rk']"
    k_norms: "Float[Array, 'P S H']"
    v_codes: "UInt8[Array, 'P S H rv']"
    v_norms: "Float[Array, 'P S H']"
    exact_k: "Array"
    exact_v: "Array"
    exact_valid: "Bool[Array, 'E S']"
    exact_of: "Int32[Array, ' P']"
    exact_owner: "Int32[Array, ' E']"
    exact_next: "Int32[Array, '']"
    sink_k: "Array"
    sink_v: "Array"
    sink_valid: "Bool[Array, 'M sinks']"
    sink_of: "Int32[Array, ' P']"
    sink_owner: "Int32[Array, ' M']"


_LEAVES = [f.name for f in dataclasses.fields(Pool) if f.name != "config"]
jax.tree_util.register_dataclass(Pool, data_fields=_LEAVES, meta_fields=["config"])


def init_pool(
    num_pages: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    options=None,
    dtype=jnp.bfloat16,
    *,
    key_bits: int | None = None,
    value_bits: int | None = None,
    rotation: str | None = None,
    seed: int | None = None,
    norm_correction: bool | None = None,
    window: int | None = None,
    sinks: int | None = None,
    max_seqs: int = DEFAULT_MAX_SEQS,
    exact_pages: int | None = None,
    sink_slots: int | None = None,
) -> Pool:
    """An empty pool.

    Args:
        num_pages: pages in the pool (the engine's page indices address them).
        page_size: tokens per page (a power of two).
        kv_heads, head_dim: as the model's K/V (``head_dim * bits`` a multiple of 8).
        options: the codec settings, as :func:`tq_jax._src.kvcache.init` takes them: None (4-bit
            keys and values, Haar, seed 42), a preset name (``"turbo-4"``, ``"turbo-3.5"``,
            ...) or a :class:`tq_jax.Options`.
        dtype: the model's K/V dtype (bfloat16, float16 or float32).
        key_bits, value_bits, rotation, seed, norm_correction: override those fields of
            ``options``, as :func:`tq_jax._src.kvcache.init`'s do.
        window: each sequence's most recent tokens read exactly; default
            :func:`tq_jax._src.kvcache.default_window` (128, or 256 at 2 bits or fewer); 0: none.
        sinks: each sequence's first tokens read exactly; default
            ``min(DEFAULT_SINKS, page_size)``; at most ``page_size``; 0: none. Kept only
            for writes given ``positions``.
        max_seqs: the most sequences whose window and sinks are kept at once: sizes the
            exact pools' defaults below.
        exact_pages: window pages; default ``max_seqs * (window_pages + 1)`` (a window
            spans at most ``window_pages = ceil((window - 1) / page_size) + 1`` pages; the
            extra page per sequence leaves room for sequences that start pages out of step).
            A chunked prefill of a long prompt also borrows pages for its earlier chunks,
            which the ring takes back first: more pages keep other windows whole through it.
        sink_slots: sink entries; default ``2 * max_seqs``.

    Returns:
        :class:`Pool` with nothing written: every exact copy invalid.

    Raises:
        ValueError: a non-positive size, a page size that is not a power of two, sinks
            beyond a page, and what :func:`tq_jax._src.kvcache.init` refuses (bits, rotation,
            head_dim, dtype, preset).

    Examples:
        >>> pool = init_pool(64, 16, 2, 64, window=32, sinks=4, max_seqs=2)
        >>> pool.k_codes.shape, pool.exact_k.shape, pool.sink_k.shape
        ((64, 16, 2, 32), (8, 16, 2, 64), (4, 4, 2, 64))
    """
    num_pages = _state.positive_int(num_pages, "num_pages", "pages in the pool the engine's page indices address.")
    page_size = _state.power_of_two(page_size, "page_size", "tokens per page; attention's blocks tile pages.")
    kv_heads = _state.positive_int(kv_heads, "kv_heads", "the number of key/value heads.")
    head_dim = _state.positive_int(head_dim, "head_dim", "the length of each key/value vector.")
    opts = _state.resolve_options(
        options,
        dict(key_bits=key_bits, value_bits=value_bits, rotation=rotation, seed=seed, norm_correction=norm_correction),
    )
    dtype_name = _state.check_layout(head_dim, opts, dtype)
    big = num_pages * page_size
    window = (min(_state.default_window(opts.key_bits, opts.value_bits), big) if window is None
              else _state.token_count(window, "window", big, _state.WINDOW_WHY))
    sinks = (min(_state.DEFAULT_SINKS, page_size) if sinks is None
             else _state.token_count(sinks, "sinks", page_size, _state.SINKS_WHY + " A pool keeps them in a "
                                     "sequence's first page, so at most page_size."))
    max_seqs = _state.positive_int(max_seqs, "max_seqs", MAX_SEQS_WHY)
    if exact_pages is None:
        exact_pages = max_seqs * (window_pages(window, page_size) + 1)
    elif window:
        exact_pages = _state.positive_int(exact_pages, "exact_pages", "window pages lent to pool pages.")
    if sink_slots is None:
        sink_slots = 2 * max_seqs if sinks else 0
    elif sinks:
        sink_slots = _state.positive_int(sink_slots, "sink_slots", "sink entries lent to sequences' first pages.")
    config = PoolConfig(
        num_pages=num_pages, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim, key_bits=opts.key_bits,
        value_bits=opts.value_bits, rotation=opts.rotation, seed=opts.seed, dtype=dtype_name,
        norm_correction=opts.norm_correction, window=window, sinks=sinks,
        exact_pages=int(exact_pages) if window else 0, sink_slots=int(sink_slots) if sinks else 0,
        trellis=opts.trellis,
    )
    return Pool(config=config, **_empty_leaves(config))


@functools.partial(jax.jit, static_argnums=0)
def _empty_leaves(cfg: PoolConfig) -> dict:
    """Every leaf of an empty pool, from one compiled program per configuration."""
    p, s, h, d, e, m = cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim, cfg.exact_pages, cfg.sink_slots
    dt = jnp.dtype(cfg.dtype)
    return dict(
        k_codes=jnp.zeros((p, s, h, cfg.key_codec.row_nbytes), jnp.uint8),
        k_norms=jnp.zeros((p, s, h), jnp.float16),
        v_codes=jnp.zeros((p, s, h, cfg.value_codec.row_nbytes), jnp.uint8),
        v_norms=jnp.zeros((p, s, h), jnp.float16),
        exact_k=jnp.zeros((e, s, h, d), dt),
        exact_v=jnp.zeros((e, s, h, d), dt),
        exact_valid=jnp.zeros((e, s), jnp.bool_),
        exact_of=jnp.full((p,), -1, jnp.int32),
        exact_owner=jnp.full((e,), -1, jnp.int32),
        exact_next=jnp.zeros((), jnp.int32),
        sink_k=jnp.zeros((m, cfg.sinks, h, d), dt),
        sink_v=jnp.zeros((m, cfg.sinks, h, d), dt),
        sink_valid=jnp.zeros((m, cfg.sinks), jnp.bool_),
        sink_of=jnp.full((p,), -1, jnp.int32),
        sink_owner=jnp.full((m,), -1, jnp.int32),
    )


def nbytes(pool: Pool) -> int:
    """Bytes held by the pool's array leaves (codes, norms, the exact pools, their maps)."""
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(pool))


# --------------------------------------------------------------------------- write


def _first_of_page(page, want, sentinel: int):
    """bool ``[T]``: token ``i`` is the first (lowest index) token of its page among the
    tokens in ``want`` (a stable sort: ``O(T log T)``, nothing of the pool's size)."""
    key = jnp.where(want, page, sentinel)
    order = jnp.argsort(key, stable=True)
    ranked = key[order]
    head = jnp.concatenate([jnp.ones((1,), jnp.bool_), ranked[1:] != ranked[:-1]]) & (ranked < sentinel)
    return jnp.zeros_like(want).at[order].set(head)


def _in_window(positions, valid, window: int):
    """bool ``[T]``: the token is within ``window`` of the end of its run of consecutive
    positions (the last token of a run is where a sequence's new tokens end)."""
    n = positions.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    follows = jnp.concatenate([(positions[1:] == positions[:-1] + 1) & valid[1:], jnp.zeros((1,), jnp.bool_)])
    end = lax.cummin(jnp.where(follows, n - 1, idx), axis=0, reverse=True)  # the first run end at or after i
    return positions[end] - positions < window


def _lend_window_pages(pool: Pool, page, valid, eligible):
    """Lend window pages (a ring) to the eligible pages written that have none; returns
    ``(exact_of, exact_owner, exact_valid, exact_next)``."""
    cfg = pool.config
    n_pages, n_exact = cfg.num_pages, cfg.exact_pages
    pc = jnp.clip(page, 0, n_pages - 1)
    need = valid & eligible & (pool.exact_of[pc] < 0)
    new = _first_of_page(page, need, n_pages)
    rank = jnp.cumsum(new, dtype=jnp.int32) - 1
    n_new = jnp.sum(new, dtype=jnp.int32)
    skip = jnp.maximum(n_new - n_exact, 0)  # more new pages than the ring: the last ones win
    keep = new & (rank >= skip)
    e = jnp.mod(pool.exact_next + rank - skip, n_exact)
    e_k = jnp.where(keep, e, n_exact)  # out of range: the scatters drop it
    old = pool.exact_owner[jnp.minimum(e_k, n_exact - 1)]
    exact_of = pool.exact_of.at[jnp.where(keep & (old >= 0), old, n_pages)].set(-1, mode="drop")
    exact_of = exact_of.at[jnp.where(keep, page, n_pages)].set(e, mode="drop")
    owner = pool.exact_owner.at[e_k].set(page, mode="drop")
    fresh = pool.exact_valid.at[e_k].set(False, mode="drop")
    return exact_of, owner, fresh, jnp.mod(pool.exact_next + jnp.minimum(n_new, n_exact), n_exact)


def _lend_sink_slots(pool: Pool, page, is_sink):
    """Lend free sink entries (no current row) to pages written a sink token that have
    none, in token order; pages beyond the free entries get none. Returns
    ``(sink_of, sink_owner, sink_valid)``."""
    cfg = pool.config
    n_pages, n_slots = cfg.num_pages, cfg.sink_slots
    pc = jnp.clip(page, 0, n_pages - 1)
    new = _first_of_page(page, is_sink & (pool.sink_of[pc] < 0), n_pages)
    rank = jnp.cumsum(new, dtype=jnp.int32) - 1
    free = ~jnp.any(pool.sink_valid, axis=1)
    free_rank = jnp.cumsum(free, dtype=jnp.int32) - 1
    slot_of_rank = jnp.zeros((n_slots,), jnp.int32).at[jnp.where(free, free_rank, n_slots)].set(
        jnp.arange(n_slots, dtype=jnp.int32), mode="drop")
    keep = new & (rank < jnp.sum(free, dtype=jnp.int32))
    j = slot_of_rank[jnp.clip(rank, 0, n_slots - 1)]
    j_k = jnp.where(keep, j, n_slots)
    old = pool.sink_owner[jnp.minimum(j_k, n_slots - 1)]
    sink_of = pool.sink_of.at[jnp.where(keep & (old >= 0), old, n_pages)].set(-1, mode="drop")
    sink_of = sink_of.at[jnp.where(keep, page, n_pages)].set(j, mode="drop")
    owner = pool.sink_owner.at[j_k].set(page, mode="drop")
    return sink_of, owner, pool.sink_valid.at[j_k].set(False, mode="drop")


def _write_impl(pool: Pool, k, v, slot_mapping, positions):
    cfg = pool.config
    ps, n_pages = cfg.page_size, cfg.num_pages
    k, v, kc, kn, vc, vn, over = _write.quantize(cfg, k, v)
    slot = slot_mapping.astype(jnp.int32)
    valid = (slot >= 0) & (slot < n_pages * ps)
    page = jnp.where(valid, slot // ps, n_pages)  # out of range: the scatters drop it
    off = jnp.where(valid, slot % ps, 0)
    new = dict(
        k_codes=pool.k_codes.at[page, off].set(kc, mode="drop"),
        k_norms=pool.k_norms.at[page, off].set(kn, mode="drop"),
        v_codes=pool.v_codes.at[page, off].set(vc, mode="drop"),
        v_norms=pool.v_norms.at[page, off].set(vn, mode="drop"),
    )
    if cfg.window:
        eligible = jnp.ones_like(valid) if positions is None else _in_window(positions, valid, cfg.window)
        exact_of, owner, ev, nxt = _lend_window_pages(pool, page, valid, eligible)
        e = exact_of[jnp.clip(page, 0, n_pages - 1)]
        tgt = jnp.where(valid & (e >= 0), e, cfg.exact_pages)
        new.update(
            exact_of=exact_of, exact_owner=owner, exact_next=nxt,
            exact_k=pool.exact_k.at[tgt, off].set(k, mode="drop"),
            exact_v=pool.exact_v.at[tgt, off].set(v, mode="drop"),
            exact_valid=ev.at[tgt, off].set(True, mode="drop"),
        )
    if cfg.sinks:
        # a sink token: position < sinks, at the offset of that position (a sequence's first page)
        is_sink = (valid & (positions < cfg.sinks) & (off == positions)) if positions is not None else jnp.zeros_like(valid)
        sink_of, owner, sv = _lend_sink_slots(pool, page, is_sink)
        j = sink_of[jnp.clip(page, 0, n_pages - 1)]
        row = jnp.minimum(off, cfg.sinks - 1)
        touched = jnp.where(valid & (off < cfg.sinks) & (j >= 0), j, cfg.sink_slots)  # every write there updates the row
        stored = jnp.where(is_sink & (j >= 0), j, cfg.sink_slots)
        new.update(
            sink_of=sink_of, sink_owner=owner,
            sink_valid=sv.at[touched, row].set(is_sink, mode="drop"),
            sink_k=pool.sink_k.at[stored, row].set(k, mode="drop"),
            sink_v=pool.sink_v.at[stored, row].set(v, mode="drop"),
        )
    return dataclasses.replace(pool, **new), jnp.sum(over & valid[:, None], dtype=jnp.int32)


_write_jit = jax.jit(_write_impl)


def write(pool: Pool, k, v, slot_mapping, *, positions=None) -> Pool:
    """Quantize new K/V once and store them at the slots the engine chose.

    Args:
        pool: the pool.
        k, v: ``[T, kv_heads, head_dim]`` (any float dtype; cast to the pool's dtype first).
        slot_mapping: int32 ``[T]``: token ``i`` goes to slot ``page * page_size +
            offset``; a negative slot (or one past the pool) is padding, skipped.
        positions: int32 ``[T]``, optional: each token's position in its sequence. With
            it, the sinks are kept (tokens at positions ``< sinks``) and only pages near
            the end of each run of consecutive positions are lent window pages; without
            it, no sinks are kept and every page written is lent one.

    Returns:
        The pool with the tokens stored: codes and float16 norms as
        :func:`tq_jax._src.kvcache.append` stores them (:func:`tq_jax.dumps`' codes), and their
        exact copies where their page holds one.

    Raises:
        ValueError: shapes that do not match the pool.
        NormOverflowError: called eagerly, a finite vector's norm exceeds float16 (under
            ``jit`` it is stored as inf and attention over it is non-finite, as
            :func:`tq_jax._src.kvcache.append` under ``jit``).

    A slot should appear at most once per call. ``jax.jit(write, donate_argnums=0)``
    updates the pool in place and compiles once per ``T``.
    """
    cfg = pool.config
    k = jnp.asarray(k) if not isinstance(k, jax.Array) else k
    v = jnp.asarray(v) if not isinstance(v, jax.Array) else v
    heads = pool.k_codes.shape[2]  # local heads under shard_map
    want = f"[T, kv_heads={heads}, head_dim={cfg.head_dim}]"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 3 or x.shape[1:] != (heads, cfg.head_dim):
            raise ValueError(f"`{name}` must be {want}, got shape {tuple(x.shape)}: one row per new token (flat over "
                             f"sequences), the pool's kv_heads and head_dim on the last two axes.")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"`{name}` must be floating (bfloat16, float16 or float32), got {x.dtype}.")
    if k.shape != v.shape:
        raise ValueError(f"`k` and `v` must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    slot_mapping = _int_vector(slot_mapping, "slot_mapping", k.shape[0], "the slot (page * page_size + offset) of each new token")
    if positions is not None:
        positions = _int_vector(positions, "positions", k.shape[0], "each new token's position in its sequence")
    new, overflowed = _write_jit(pool, k, v, slot_mapping, positions)
    if not isinstance(overflowed, jax.core.Tracer) and int(overflowed):
        raise _wire.NormOverflowError(NORM_OVERFLOW.format(count=int(overflowed)))
    return new


def _int_vector(x, name: str, n: int, what: str):
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if x.ndim != 1 or x.shape[0] != n or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"`{name}` must be an int array of shape ({n},), got {x.dtype} {tuple(x.shape)}: {what}.")
    return x.astype(jnp.int32)
