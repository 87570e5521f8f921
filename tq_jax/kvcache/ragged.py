"""Ragged paged attention over packed codes: the cache in the form a serving engine drives.

JAX serving engines (tpu-inference, EasyDeL's eSurge) own a pool of KV pages and each
sequence's page indices, write new K/V to slots they choose, and run one attention call
over a flat batch of query tokens that mixes prefill chunks and decode steps (the
argument form of tpu-inference's ragged paged attention, "RPA v3"). This module gives
them :mod:`tq_jax.kvcache`'s codes in that form::

    pool = ragged.init_pool(num_pages, page_size, kv_heads, head_dim)        # 4/4 bits, window 128, 4 sinks
    pool = ragged.write(pool, k, v, slot_mapping, positions=positions)      # k, v: [T, kv_heads, head_dim]
    out = ragged.attend(pool, q, kv_lens, page_indices, cu_q_lens, num_seqs)  # q: [T, q_heads, head_dim]

**Pool.** Pages of code rows and float16 norms, ``[num_pages, page_size, kv_heads, ...]``,
exactly :class:`~tq_jax.kvcache.KVCache`'s pool: slot ``page * page_size + offset``.
:func:`write` quantizes each new vector once (the codes and norm
:func:`tq_jax.kvcache.append` and :func:`tq_jax.dumps` give it) and stores it at its slot;
a negative slot is padding. Nothing in the pool knows sequences: the engine's page table,
given to :func:`attend`, is the only map from sequences to pages.

**Attention.** Query ``i`` of sequence ``s`` (tokens ``cu_q_lens[s]..cu_q_lens[s+1]`` of
``q``) sits at position ``kv_lens[s] - q_len_s + i`` and sees the positions up to its own
(causal), and, with ``sliding_window=W``, none below ``position - W + 1``. The flat batch
is cut into tiles of ``q_block`` queries of one sequence (a static count, enough for any
split of the batch); each tile runs the cache's coded kernels (:mod:`~tq_jax.kvcache.xla`,
:mod:`~tq_jax.kvcache.pallas_gpu`, :mod:`~tq_jax.kvcache.pallas_tpu`) over its sequence's
pages, which read the codes directly (no bf16 page is ever built), and dense attention
over its exact tokens (:func:`tq_jax.kvcache.exact.dense`), merged in one softmax
(:func:`tq_jax.kvcache.scoring.finish`).

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
updates it, a freshly lent page starts with no valid row, and a page whose loan was
taken back reads from codes. :func:`attend` reads exactly the positions ``>= hi`` of
the window whose copies are all current (the longest such suffix of the last
``window`` positions) and the sinks from the longest current suffix of the sink rows,
so an undersized exact pool costs exactness, never correctness. With enough room
(``max_seqs`` sequences, the default sizes) and ``positions`` given, :func:`attend`
reads the same tokens exactly as :func:`tq_jax.kvcache.attend` does for the same
tokens (tested).

References:
    Zandieh et al., "TurboQuant", arXiv:2504.19874 (2025); Kwon et al., "PagedAttention",
    SOSP 2023; tpu-inference's ``ragged_paged_attention`` (v3) argument form.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tq_jax import codec as _codec
from tq_jax import wire as _wire
from tq_jax.kvcache import attention as _attention
from tq_jax.kvcache import exact as _exact
from tq_jax.kvcache import scoring as _scoring
from tq_jax.kvcache import state as _state
from tq_jax.kvcache import write as _write
from tq_jax.kvcache import xla as _xla

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Float, Int32, UInt8

__all__ = ["PoolConfig", "Pool", "init_pool", "write", "attend", "nbytes", "IMPLS", "DEFAULT_MAX_SEQS",
           "MAX_Q_BLOCK", "tiles", "interpret"]

IMPLS = _attention.IMPLS
DEFAULT_MAX_SEQS = 16  # the exact pools' default room: this many sequences at once
MAX_Q_BLOCK = 64  # queries per tile at most (a tile's rows are G * q_block)

NORM_OVERFLOW = (
    "{count} written vector(s) have an L2 norm that float16 cannot hold (float16 tops out at 65504). The pool "
    "stores norms as float16, as TQ01 version 1 does, so these vectors would attend as inf/NaN. The pool is "
    "unchanged. Scale the keys/values down before writing."
)
MAX_SEQS_WHY = "the most sequences whose exact window and sinks the pool keeps at once (it sizes the exact pools)."


# --------------------------------------------------------------------------- state


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """Everything static about a pool (pytree aux data; plain hashable scalars).

    Attributes:
        num_pages, page_size, kv_heads, head_dim: the pool's shape.
        key_bits, value_bits, rotation, seed, norm_correction: the codec settings
            (:class:`tq_jax.Options`'), as in :class:`~tq_jax.kvcache.CacheConfig`.
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

    @property
    def key_codec(self) -> _codec.CodecConfig:
        return _codec.CodecConfig(self.head_dim, self.key_bits, self.seed, self.rotation)

    @property
    def value_codec(self) -> _codec.CodecConfig:
        return _codec.CodecConfig(self.head_dim, self.value_bits, self.seed, self.rotation)

    @property
    def window_pages(self) -> int:
        """Pages the last ``window`` positions of a sequence span at most."""
        return -(-(self.window - 1) // self.page_size) + 1 if self.window else 0

    def view(self, batch: int, pages_per_seq: int, block_tokens: int) -> _state.CacheConfig:
        """The :class:`~tq_jax.kvcache.CacheConfig` of ``batch`` rows (query tiles) over this
        pool, each owning ``pages_per_seq`` pages: what the coded kernels read."""
        return _state.CacheConfig(
            batch=batch, max_len=pages_per_seq * self.page_size, kv_heads=self.kv_heads, head_dim=self.head_dim,
            key_bits=self.key_bits, value_bits=self.value_bits, rotation=self.rotation, seed=self.seed,
            dtype=self.dtype, page_size=self.page_size, num_pages=self.num_pages, page_tokens=self.page_size,
            block_tokens=block_tokens, window=0, sinks=self.sinks, norm_correction=self.norm_correction,
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
        options: the codec settings, as :func:`tq_jax.kvcache.init` takes them: None (4-bit
            keys and values, Haar, seed 42), a preset name (``"turbo-4"``, ``"turbo-3.5"``,
            ...) or a :class:`tq_jax.Options`.
        dtype: the model's K/V dtype (bfloat16, float16 or float32).
        window: each sequence's most recent tokens read exactly; default
            :func:`tq_jax.kvcache.default_window` (128, or 256 at 2 bits or fewer); 0: none.
        sinks: each sequence's first tokens read exactly; default
            ``min(DEFAULT_SINKS, page_size)``; at most ``page_size``; 0: none. Kept only
            for writes given ``positions``.
        max_seqs: the most sequences whose window and sinks are kept at once: sizes the
            exact pools' defaults below.
        exact_pages: window pages; default ``2 * max_seqs * window_pages`` (a window spans
            at most ``window_pages = ceil((window - 1) / page_size) + 1`` pages; twice that
            leaves room for pages of finished windows still on loan).
        sink_slots: sink entries; default ``2 * max_seqs``.

    Returns:
        :class:`Pool` with nothing written: every exact copy invalid.

    Raises:
        ValueError: a non-positive size, a page size that is not a power of two, sinks
            beyond a page, and what :func:`tq_jax.kvcache.init` refuses (bits, rotation,
            head_dim, dtype, preset).

    Examples:
        >>> pool = init_pool(64, 16, 2, 64, window=32, sinks=4, max_seqs=2)
        >>> pool.k_codes.shape, pool.exact_k.shape, pool.sink_k.shape
        ((64, 16, 2, 32), (12, 16, 2, 64), (4, 4, 2, 64))
    """
    num_pages = _state.positive_int(num_pages, "num_pages", "pages in the pool the engine's page indices address.")
    page_size = _state.power_of_two(page_size, "page_size", "tokens per page; attention's blocks tile pages.")
    kv_heads = _state.positive_int(kv_heads, "kv_heads", "the number of key/value heads.")
    head_dim = _state.positive_int(head_dim, "head_dim", "the length of each key/value vector.")
    opts = _state.resolve_options(options, {})
    dtype_name = _state.check_layout(head_dim, opts, dtype)
    big = num_pages * page_size
    window = (min(_state.default_window(opts.key_bits, opts.value_bits), big) if window is None
              else _state.token_count(window, "window", big, _state.WINDOW_WHY))
    sinks = (min(_state.DEFAULT_SINKS, page_size) if sinks is None
             else _state.token_count(sinks, "sinks", page_size, _state.SINKS_WHY + " A pool keeps them in a "
                                     "sequence's first page, so at most page_size."))
    max_seqs = _state.positive_int(max_seqs, "max_seqs", MAX_SEQS_WHY)
    window_pages = -(-(window - 1) // page_size) + 1 if window else 0
    if exact_pages is None:
        exact_pages = 2 * max_seqs * window_pages
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
        :func:`tq_jax.kvcache.append` stores them (:func:`tq_jax.dumps`' codes), and their
        exact copies where their page holds one.

    Raises:
        ValueError: shapes that do not match the pool.
        NormOverflowError: called eagerly, a finite vector's norm exceeds float16 (under
            ``jit`` it is stored as inf and attention over it is non-finite, as
            :func:`tq_jax.kvcache.append` under ``jit``).

    A slot should appear at most once per call. ``jax.jit(write, donate_argnums=0)``
    updates the pool in place and compiles once per ``T``.
    """
    cfg = pool.config
    k = jnp.asarray(k) if not isinstance(k, jax.Array) else k
    v = jnp.asarray(v) if not isinstance(v, jax.Array) else v
    want = f"[T, kv_heads={cfg.kv_heads}, head_dim={cfg.head_dim}]"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 3 or x.shape[1:] != (cfg.kv_heads, cfg.head_dim):
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


# --------------------------------------------------------------------------- attend


def interpret() -> bool:
    """Whether the Pallas kernels run in the Pallas interpreter (on a CPU backend) or
    compiled: the one place this module decides it."""
    return jax.default_backend() == "cpu"


def tiles(cu_q_lens, num_seqs, q_block: int, n_tiles: int):
    """Cut the flat query batch into ``n_tiles`` tiles of at most ``q_block`` queries of one
    sequence each, sequence by sequence: ``(seq, first, count, index)`` int32 ``[n_tiles]``:
    the tile's sequence, its first query (a row of the flat batch), its query count (0 for
    a tile past the batch) and its index among its sequence's tiles. ``n_tiles`` must be at
    least ``sum(ceil(q_len_s / q_block))``; ``min(T, ceil(T / q_block) + max_seqs)`` always is."""
    max_seqs = cu_q_lens.shape[0] - 1
    live = jnp.arange(max_seqs, dtype=jnp.int32) < jnp.reshape(num_seqs, (-1,))[0]
    q_lens = jnp.where(live, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)
    per_seq = (q_lens + q_block - 1) // q_block
    ends = jnp.cumsum(per_seq, dtype=jnp.int32)
    j = jnp.arange(n_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, j, side="right").astype(jnp.int32), max_seqs - 1)
    index = j - (ends[seq] - per_seq[seq])
    count = jnp.where(j < ends[-1], jnp.clip(q_lens[seq] - index * q_block, 0, q_block), 0)
    return seq, cu_q_lens[seq] + index * q_block, count, index


def _exact_bounds(pool: Pool, kv_lens, pages):
    """Per sequence: ``sink_lo`` (positions ``sink_lo..sinks-1`` are read from the sink
    entry: the longest current suffix of its rows), ``hi`` (the other positions from it up
    are read from window pages: the longest current suffix of the last ``window``), the
    sink entry, the window's first page column and its window pages ``[S, window_pages]``.
    Everything else is read from codes: :func:`tq_jax.kvcache.scoring.coded_mask` with
    these ``hi`` and ``sink_lo``."""
    cfg = pool.config
    n_seq, pps = pages.shape
    ps, sinks = cfg.page_size, cfg.sinks
    sink_lo = jnp.zeros((n_seq,), jnp.int32)
    entry = jnp.zeros((n_seq,), jnp.int32)
    if sinks:
        j = pool.sink_of[pages[:, 0]]
        entry = jnp.maximum(j, 0)
        row = jnp.arange(sinks, dtype=jnp.int32)[None, :]
        current = (j >= 0)[:, None] & pool.sink_valid[entry]
        bad = (row < jnp.minimum(kv_lens, sinks)[:, None]) & ~current
        sink_lo = jnp.max(jnp.where(bad, row + 1, 0), axis=1)
    if not cfg.window:
        return kv_lens, sink_lo, entry, None, None
    lo = jnp.maximum(kv_lens - cfg.window, 0)
    col0 = lo // ps
    cols = col0[:, None] + jnp.arange(cfg.window_pages, dtype=jnp.int32)[None, :]  # [S, nw]
    e = pool.exact_of[jnp.take_along_axis(pages, jnp.minimum(cols, pps - 1), axis=1)]
    e = jnp.where(cols < pps, e, -1)
    off = jnp.arange(ps, dtype=jnp.int32)
    have = (e >= 0)[:, :, None] & pool.exact_valid[jnp.maximum(e, 0)]  # [S, nw, ps]
    pos = (cols[:, :, None] * ps + off).reshape(n_seq, -1)
    need = (pos >= lo[:, None]) & (pos < kv_lens[:, None]) & ~_in_sinks(pos, sink_lo[:, None], sinks)
    bad = need & ~have.reshape(n_seq, -1)
    w = jnp.maximum(jnp.max(jnp.where(bad, pos + 1, 0), axis=1), lo)
    return jnp.minimum(w, kv_lens), sink_lo, entry, col0, jnp.maximum(e, 0)


def _in_sinks(pos, sink_lo, sinks: int):
    """Whether ``pos`` is read from the sink entry (``sink_lo <= pos < sinks``)."""
    return (pos >= sink_lo) & (pos < sinks)


def _exact_tokens(pool: Pool, seq, kv_len, hi, sink_lo, entry, col0, wpages):
    """Each tile's exact tokens ``(k, v, pos, valid)`` ``[N, sinks + window_pages * page_size, ...]``."""
    cfg = pool.config
    ks, vs, poss, valids = [], [], [], []
    if cfg.sinks:
        row = jnp.arange(cfg.sinks, dtype=jnp.int32)[None, :]
        ks.append(pool.sink_k[entry[seq]])
        vs.append(pool.sink_v[entry[seq]])
        poss.append(jnp.broadcast_to(row, (seq.shape[0], cfg.sinks)))
        valids.append((row >= sink_lo[seq][:, None]) & (row < jnp.minimum(kv_len, cfg.sinks)[:, None]))
    if cfg.window:
        n, ps = seq.shape[0], cfg.page_size
        e = wpages[seq]  # [N, nw]
        ks.append(pool.exact_k[e].reshape(n, -1, cfg.kv_heads, cfg.head_dim))
        vs.append(pool.exact_v[e].reshape(n, -1, cfg.kv_heads, cfg.head_dim))
        cols = col0[seq][:, None] + jnp.arange(cfg.window_pages, dtype=jnp.int32)[None, :]
        pos = (cols[:, :, None] * ps + jnp.arange(ps, dtype=jnp.int32)).reshape(n, -1)
        poss.append(pos)
        valids.append((pos >= hi[:, None]) & (pos < kv_len[:, None]) & ~_in_sinks(pos, sink_lo[seq][:, None], cfg.sinks))
    cat = lambda xs: jnp.concatenate(xs, axis=1) if len(xs) > 1 else xs[0]  # noqa: E731
    return cat(ks), cat(vs), cat(poss), cat(valids)


def _attend_impl(pool: Pool, q, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, *, impl: str, interpret: bool,
                 q_block: int, block_tokens: int, sliding_window: int | None, tuning=None):
    cfg = pool.config
    n_tok, q_heads, dim = q.shape
    n_seq, pps = page_indices.shape
    n_tiles = min(n_tok, -(-n_tok // q_block) + n_seq)
    out_dtype = q.dtype
    if sm_scale is not None:  # the kernels scale by 1/sqrt(head_dim)
        q = q.astype(jnp.float32) * (jnp.asarray(sm_scale, jnp.float32) * np.float32(math.sqrt(dim)))
    kv_lens = jnp.maximum(kv_lens.astype(jnp.int32), 0)
    pages = jnp.clip(page_indices.astype(jnp.int32), 0, cfg.num_pages - 1)
    seq, start, count, index = tiles(cu_q_lens.astype(jnp.int32), num_seqs, q_block, n_tiles)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    kv_len = jnp.where(count > 0, kv_lens[seq], 0)
    pos0 = kv_len - q_len + index * q_block  # position of the tile's first query
    rows = jnp.arange(q_block, dtype=jnp.int32)
    live = rows[None, :] < count[:, None]  # [N, q_block]
    q_tiles = q[jnp.clip(start[:, None] + rows[None, :], 0, n_tok - 1)]  # [N, q_block, q_heads, D]

    hi, sink_lo, entry, col0, wpages = _exact_bounds(pool, kv_lens, pages)
    view_cfg = cfg.view(n_tiles, pps, block_tokens)
    none = jnp.zeros((n_tiles, 0, cfg.kv_heads, dim), jnp.dtype(cfg.dtype))
    view = _state.KVCache(
        config=view_cfg, k_codes=pool.k_codes, k_norms=pool.k_norms, v_codes=pool.v_codes, v_norms=pool.v_norms,
        lengths=jnp.where(count > 0, pos0 + q_block, 0), page_table=pages[seq], next_page=jnp.zeros((), jnp.int32),
        overflow=jnp.zeros((0, cfg.kv_heads), jnp.bool_), k_window=none, v_window=none, k_sinks=none, v_sinks=none,
        exact_from=jnp.zeros((n_tiles,), jnp.int32),
    )
    group = q_heads // cfg.kv_heads
    last = jnp.tile(jnp.where(live, pos0[:, None] + rows[None, :], -1), (1, group))  # row g*q_block + i
    first = None if sliding_window is None else last - (sliding_window - 1)
    query = _scoring.query(view, q_tiles)._replace(
        hi=jnp.where(count > 0, hi[seq], 0), sink_lo=sink_lo[seq], last=last, first=first)
    if impl == "pallas_gpu":
        from tq_jax.kvcache import pallas_gpu  # Pallas loads only when asked for

        m, l, acc = pallas_gpu.partial(view, query, interpret=interpret, tuning=tuning or pallas_gpu.DEFAULT_TUNING)
    elif impl == "pallas_tpu":
        from tq_jax.kvcache import pallas_tpu

        m, l, acc = pallas_tpu.partial(view, query, interpret=interpret)
    else:
        m, l, acc = _xla.partial(view, query)
    exact = None
    if cfg.window or cfg.sinks:
        k, v, pos, valid = _exact_tokens(pool, seq, kv_len, query.hi, sink_lo, entry, col0, wpages)
        exact = _exact.dense(q_tiles, k, v, pos, valid, last, first)
    out = _scoring.finish(view, q_tiles, acc, l, m, exact)  # [N, q_block, q_heads, D]
    dest = jnp.where(live, start[:, None] + rows[None, :], n_tok)  # rows past the batch: dropped
    return jnp.zeros((n_tok, q_heads, dim), out_dtype).at[dest].set(out.astype(out_dtype), mode="drop")


_attend_jit = jax.jit(
    _attend_impl, static_argnames=("impl", "interpret", "q_block", "block_tokens", "sliding_window", "tuning"))


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def attend(pool: Pool, q, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=None, sliding_window=None,
           impl: str = "auto", q_block: int | None = None, block_tokens: int | None = None, tuning=None
           ) -> "Float[Array, 'T q_heads head_dim']":
    """Ragged paged attention of a flat query batch over the pool's codes.

    Args:
        pool: the pool (this step's K/V already written).
        q: ``[T, q_heads, head_dim]``: the queries of every sequence, flat (prefill chunks
            and decode tokens mixed); ``q_heads`` a multiple of ``kv_heads`` (query head
            ``h`` reads KV head ``h // (q_heads // kv_heads)``).
        kv_lens: int32 ``[max_seqs]``: each sequence's KV length, this step's tokens included.
        page_indices: int32 ``[max_seqs, pages_per_seq]``: sequence ``s``'s position ``p``
            lives in slot ``page_indices[s, p // page_size] * page_size + p % page_size``.
        cu_q_lens: int32 ``[max_seqs + 1]``: sequence ``s``'s queries are rows
            ``cu_q_lens[s]..cu_q_lens[s+1]`` of ``q``.
        num_seqs: int32 ``[1]`` (or a scalar): the sequences in use (the first ones).
        sm_scale: the softmax scale; None: ``1 / sqrt(head_dim)``.
        sliding_window: a query at position ``p`` sees no position below ``p -
            sliding_window + 1``; None: no such bound.
        impl: ``"auto"`` (the GPU kernel on a GPU, else the XLA loop:
            :func:`tq_jax.kvcache.attention.resolve_impl`), ``"xla"``, ``"pallas_gpu"``,
            ``"pallas_tpu"`` or ``"pallas"``. The Pallas kernels do not take a sliding window.
        q_block: queries per tile (a power of two, at most ``MAX_Q_BLOCK``); default the
            power of two at or below ``T / max_seqs`` (1 for a decode batch).
        block_tokens: tokens per step of the coded loop; default
            :func:`tq_jax.kvcache.state.default_block_tokens` for the tiles.
        tuning: the GPU kernel's :class:`~tq_jax.kvcache.pallas_gpu.Tuning`.

    Returns:
        ``[T, q_heads, head_dim]`` in ``q``'s dtype; rows of no sequence (past
        ``cu_q_lens[num_seqs]``) and queries that see no token are zeros.

    Raises:
        ValueError: shapes that do not fit the pool or each other, an unknown ``impl``,
            a sliding window with a Pallas kernel.
    """
    cfg = pool.config
    if impl not in IMPLS:
        raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}: the XLA loop, or a Pallas kernel.")
    q = jnp.asarray(q) if not isinstance(q, jax.Array) else q
    if q.ndim != 3 or q.shape[2] != cfg.head_dim or q.shape[1] % cfg.kv_heads:
        raise ValueError(
            f"`q` must be [T, q_heads, head_dim={cfg.head_dim}] with q_heads a multiple of kv_heads={cfg.kv_heads}, "
            f"got shape {tuple(q.shape)}: one row per query token, flat over sequences (grouped-query attention "
            f"maps q_heads // kv_heads query heads to each KV head)."
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"`q` must be floating, got {q.dtype}.")
    arrays = [jnp.asarray(a) if not isinstance(a, jax.Array) else a for a in (kv_lens, page_indices, cu_q_lens, num_seqs)]
    kv_lens, page_indices, cu_q_lens, num_seqs = arrays
    for name, a in zip(("kv_lens", "page_indices", "cu_q_lens", "num_seqs"), arrays):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"`{name}` must be an int32 array, got {a.dtype}.")
    n_seq = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    if n_seq < 1 or page_indices.ndim != 2 or page_indices.shape[0] != n_seq or cu_q_lens.shape != (n_seq + 1,) \
            or num_seqs.size != 1:
        raise ValueError(
            f"RPA arguments must be kv_lens [max_seqs], page_indices [max_seqs, pages_per_seq], cu_q_lens "
            f"[max_seqs + 1] and num_seqs [1], got {tuple(kv_lens.shape)}, {tuple(page_indices.shape)}, "
            f"{tuple(cu_q_lens.shape)} and {tuple(num_seqs.shape)}."
        )
    if sliding_window is not None and (not isinstance(sliding_window, (int, np.integer)) or sliding_window < 1):
        raise ValueError(f"`sliding_window` must be None or an int >= 1, got {sliding_window!r}: the positions a "
                         f"query sees, its own included.")
    n_tok = q.shape[0]
    if q_block is None:
        q_block = min(MAX_Q_BLOCK, _pow2_floor(n_tok // n_seq))
    else:
        q_block = _state.power_of_two(q_block, "q_block", "queries per tile of one sequence.")
    resolved = _attention.resolve_impl(_ConfigOnly(cfg.view(1, 1, 16)), impl)
    if sliding_window is not None and resolved != "xla":
        raise ValueError(
            f"sliding_window={sliding_window} runs on the XLA loop only; impl={impl!r} resolved to {resolved!r}, "
            f"whose kernel bounds each query's tokens from above only: pass impl='xla'."
        )
    if tuning is not None and resolved != "pallas_gpu":
        raise ValueError(f"`tuning` is the GPU kernel's (impl='pallas_gpu'), got it with impl={impl!r} ({resolved!r}).")
    if n_tok == 0:
        return jnp.zeros(q.shape, q.dtype)
    n_tiles = min(n_tok, -(-n_tok // q_block) + n_seq)
    block = block_tokens or _state.default_block_tokens(n_tiles, cfg.kv_heads, cfg.head_dim)
    block = _state.power_of_two(block, "block_tokens", "tokens per step of the coded loop.")
    interp = interpret()
    if resolved == "pallas_gpu" and not interp:
        from tq_jax.kvcache import pallas_gpu

        if not pallas_gpu.available():
            raise RuntimeError(pallas_gpu.NO_TRITON.format(version=jax.__version__))
    return _attend_jit(pool, q, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, impl=resolved,
                       interpret=interp, q_block=q_block, block_tokens=block,
                       sliding_window=None if sliding_window is None else int(sliding_window), tuning=tuning)


class _ConfigOnly:
    """What :func:`tq_jax.kvcache.attention.resolve_impl` reads of a cache: its config."""

    def __init__(self, config):
        self.config = config
