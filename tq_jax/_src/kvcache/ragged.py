"""Ragged paged attention over packed codes: the cache in the form a serving engine drives.

JAX serving engines (tpu-inference, EasyDeL's eSurge) own a pool of KV pages and each
sequence's page indices, write new K/V to slots they choose, and run one attention call
over a flat batch of query tokens that mixes prefill chunks and decode steps (the
argument form of tpu-inference's ragged paged attention, "RPA v3"). This module gives
them :mod:`tq_jax._src.kvcache`'s codes in that form::

    pool = ragged.init_pool(num_pages, page_size, kv_heads, head_dim)        # 4/4 bits, window 128, 4 sinks
    pool = ragged.write(pool, k, v, slot_mapping, positions=positions)      # k, v: [T, kv_heads, head_dim]
    out = ragged.attend(pool, q, kv_lens, page_indices, cu_q_lens, num_seqs)  # q: [T, q_heads, head_dim]

**Pool** (:mod:`tq_jax._src.kvcache.pool`). Pages of code rows and float16 norms that the
engine addresses by slot (``page * page_size + offset``), written by :func:`write`, which
quantizes each new vector once (:func:`tq_jax.dumps`' codes); the engine's page table is
the only map from sequences to pages.

**Attention.** Query ``i`` of sequence ``s`` (rows ``cu_q_lens[s]..cu_q_lens[s+1]`` of
``q``) sits at position ``kv_lens[s] - q_len_s + i`` and sees the positions up to its own
(causal), and, with ``sliding_window=W``, none below ``position - W + 1``. The flat batch
is cut into tiles of ``q_block`` queries of one sequence (:func:`tiles`: a static count,
enough for any split of the batch); each tile runs the cache's coded kernels
(:mod:`~tq_jax._src.kvcache.xla`, :mod:`~tq_jax._src.kvcache.pallas_gpu`,
:mod:`~tq_jax._src.kvcache.pallas_tpu`) over its sequence's pages, which read the codes
directly (no bf16 page is ever built), and dense attention over its exact tokens
(:func:`tq_jax._src.kvcache.exact.dense`), merged in one softmax
(:func:`tq_jax._src.kvcache.scoring.finish`).

**The exact window and sinks.** Each sequence's last ``window`` tokens and first
``sinks`` are read from exact copies the pool keeps per page (:mod:`tq_jax._src.kvcache.pool`
says how): the longest current suffix of the window and of the sink rows; the rest from
codes. With enough room (``max_seqs`` sequences at the default sizes) and ``positions``
given to :func:`write`, that is exactly what :func:`tq_jax._src.kvcache.attend` reads exactly
for the same tokens, and the two agree to float32 rounding (tested).

References:
    Zandieh et al., "TurboQuant", arXiv:2504.19874 (2025); Kwon et al., "PagedAttention",
    SOSP 2023; tpu-inference's ``ragged_paged_attention`` (v3) argument form.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src.kvcache import attention as _attention
from tq_jax._src.kvcache import exact as _exact
from tq_jax._src.kvcache import scoring as _scoring
from tq_jax._src.kvcache import state as _state
from tq_jax._src.kvcache import target as _target
from tq_jax._src.kvcache.pool import DEFAULT_MAX_SEQS, Pool, PoolConfig, init_pool, nbytes, write

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float

__all__ = ["PoolConfig", "Pool", "init_pool", "write", "attend", "nbytes", "IMPLS", "DEFAULT_MAX_SEQS",
           "MAX_Q_BLOCK", "tiles", "forms"]

IMPLS = _attention.IMPLS
MAX_Q_BLOCK = 64  # queries per tile at most (a tile's rows are G * q_block)


# --------------------------------------------------------------------------- attend


def forms(config, impl: str) -> tuple:
    """``((platform, (kernel, interpreted)), ...)``: what ``impl`` runs on each platform a
    program can be lowered for, as :func:`tq_jax._src.kvcache.attend` resolves it
    (:func:`tq_jax._src.kvcache.attention.forms`, on :mod:`tq_jax._src.kvcache.target`'s rule: the
    compiled kernel on its accelerator, the Pallas interpreter on the CPU)."""
    return _attention.forms(_ConfigOnly(config.view(1, 1, 16)), impl)


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
    Everything else is read from codes: :func:`tq_jax._src.kvcache.scoring.coded_mask` with
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
        ks.append(pool.exact_k[e].reshape(n, -1, *pool.exact_k.shape[2:]))
        vs.append(pool.exact_v[e].reshape(n, -1, *pool.exact_v.shape[2:]))
        cols = col0[seq][:, None] + jnp.arange(cfg.window_pages, dtype=jnp.int32)[None, :]
        pos = (cols[:, :, None] * ps + jnp.arange(ps, dtype=jnp.int32)).reshape(n, -1)
        poss.append(pos)
        valids.append((pos >= hi[:, None]) & (pos < kv_len[:, None]) & ~_in_sinks(pos, sink_lo[seq][:, None], cfg.sinks))
    cat = lambda xs: jnp.concatenate(xs, axis=1) if len(xs) > 1 else xs[0]  # noqa: E731
    return cat(ks), cat(vs), cat(poss), cat(valids)


def _attend_impl(pool: Pool, q, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, *, forms: tuple,
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
    heads = pool.k_codes.shape[2]  # local heads under shard_map
    none = jnp.zeros((n_tiles, 0, heads, dim), jnp.dtype(cfg.dtype))
    # the tiles as the batch rows of a KVCache over the pool: row r of tile j sits at
    # lengths[j] - q_block + r (what pallas_tpu derives; the others read query.last)
    view = _state.KVCache(
        config=view_cfg, k_codes=pool.k_codes, k_norms=pool.k_norms, v_codes=pool.v_codes, v_norms=pool.v_norms,
        lengths=jnp.where(count > 0, pos0 + q_block, 0), page_table=pages[seq], next_page=jnp.zeros((), jnp.int32),
        overflow=jnp.zeros((0, heads), jnp.bool_), k_window=none, v_window=none, k_sinks=none, v_sinks=none,
        exact_from=jnp.zeros((n_tiles,), jnp.int32),
    )
    group = q_heads // heads
    last = jnp.tile(jnp.where(live, pos0[:, None] + rows[None, :], -1), (1, group))  # row g*q_block + i
    query = _scoring.query(view, q_tiles)._replace(
        hi=jnp.where(count > 0, hi[seq], 0), sink_lo=sink_lo[seq], last=last, sliding_window=sliding_window)
    # the program holds the form of the platform it is lowered for (tq_jax._src.kvcache.target)
    m, l, acc = _target.staged(dict(forms), lambda form: _attention.coded_partial(form, view, query, tuning))
    exact = None
    if cfg.window or cfg.sinks:
        k, v, pos, valid = _exact_tokens(pool, seq, kv_len, query.hi, sink_lo, entry, col0, wpages)
        exact = _exact.dense(q_tiles, k, v, pos, valid, last, sliding_window)
    out = _scoring.finish(view, q_tiles, acc, l, m, exact)  # [N, q_block, q_heads, D]
    dest = jnp.where(live, start[:, None] + rows[None, :], n_tok)  # rows past the batch: dropped
    return jnp.zeros((n_tok, q_heads, dim), out_dtype).at[dest].set(out.astype(out_dtype), mode="drop")


_attend_jit = jax.jit(
    _attend_impl, static_argnames=("forms", "q_block", "block_tokens", "sliding_window", "tuning"))


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
            :func:`tq_jax._src.kvcache.attention.resolve_impl`), ``"xla"``, ``"pallas_gpu"``,
            ``"pallas_tpu"`` or ``"pallas"``.
        q_block: queries per tile (a power of two, at most ``MAX_Q_BLOCK``); default the
            power of two at or below ``T / max_seqs`` (1 for a decode batch).
        block_tokens: tokens per step of the coded loop; default
            :func:`tq_jax._src.kvcache.state.default_block_tokens` for the tiles.
        tuning: the GPU kernel's :class:`~tq_jax._src.kvcache.pallas_gpu.Tuning`.

    Returns:
        ``[T, q_heads, head_dim]`` in ``q``'s dtype; rows of no sequence (past
        ``cu_q_lens[num_seqs]``) and queries that see no token are zeros.

    Raises:
        ValueError: shapes that do not fit the pool or each other, an unknown ``impl``.
    """
    cfg = pool.config
    _attention.check_impl(impl)
    q = jnp.asarray(q) if not isinstance(q, jax.Array) else q
    heads = pool.k_codes.shape[2]  # local heads under shard_map
    if q.ndim != 3 or q.shape[2] != cfg.head_dim or q.shape[1] % heads:
        raise ValueError(
            f"`q` must be [T, q_heads, head_dim={cfg.head_dim}] with q_heads a multiple of kv_heads={heads}, "
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
    if tuning is not None and impl in ("xla", "pallas_tpu"):
        raise ValueError(f"`tuning` is the GPU kernel's (impl='pallas_gpu'), got it with impl={impl!r}, which never "
                         f"runs that kernel: drop `tuning`, or use impl='pallas_gpu' or 'auto'.")
    if n_tok == 0:
        return jnp.zeros(q.shape, q.dtype)
    n_tiles = min(n_tok, -(-n_tok // q_block) + n_seq)
    block = block_tokens or _state.default_block_tokens(n_tiles, heads, cfg.head_dim)
    block = _state.power_of_two(block, "block_tokens", "tokens per step of the coded loop.")
    one_tile = _ConfigOnly(cfg.view(1, 1, 16))
    if jax.default_backend() == "gpu" and _attention.resolve_impl(one_tile, impl) == "pallas_gpu":
        from tq_jax._src.kvcache import pallas_gpu

        if not pallas_gpu.available():
            raise RuntimeError(pallas_gpu.NO_TRITON.format(version=jax.__version__))
    staged = forms(cfg, impl)
    gpu_kernel = any(kernel == "pallas_gpu" for _, (kernel, _) in staged)
    return _attend_jit(pool, q, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, forms=staged, q_block=q_block,
                       block_tokens=block, sliding_window=None if sliding_window is None else int(sliding_window),
                       tuning=tuning if gpu_kernel else None)


class _ConfigOnly:
    """What :func:`tq_jax._src.kvcache.attention.resolve_impl` reads of a cache: its config."""

    def __init__(self, config):
        self.config = config
