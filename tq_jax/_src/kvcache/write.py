"""Writing tokens: :func:`append` quantizes new K/V into the pool's pages.

A vector appended gets the codes and float16 norm that :func:`tq_jax.dumps` gives it
(the same encoder, and norms rounded to float16 as ``numpy.astype`` does).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import codec as _codec
from tq_jax._src import wire as _wire
from tq_jax._src.kvcache import scoring as _scoring
from tq_jax._src.kvcache.state import KVCache

__all__ = ["append", "write_rows", "quantize", "MAX_LEN_EXCEEDED", "POOL_EXHAUSTED", "NORM_OVERFLOW"]

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


def write_rows(cache: KVCache, seqs, starts, counts, kc, kn, vc, vn, over):
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


def quantize(config, k, v):
    """What the cache stores for new K/V ``[..., head_dim]``: ``(k, v, k_codes, k_norms,
    v_codes, v_norms, overflow)``, with ``k``/``v`` cast to the cache's dtype (what an
    exact copy holds), uint8 code rows and float16 norms as :func:`tq_jax.dumps` writes
    them (``|x| / |c|`` with norm correction), and where a finite norm overflowed float16.

    ``config`` is a :class:`~tq_jax._src.kvcache.CacheConfig` or any config with its
    ``dtype``, ``key_codec``, ``value_codec`` and ``norm_correction``
    (:class:`tq_jax._src.kvcache.pool.PoolConfig`).
    """
    dt = jnp.dtype(config.dtype)
    k = k if k.dtype == dt else k.astype(dt)
    v = v if v.dtype == dt else v.astype(dt)
    ek = _codec.encode(k, config.key_codec)
    ev = _codec.encode(v, config.value_codec)
    kn, k_over = _f16_norms(_stored_norms(ek, config.key_codec, config.norm_correction))
    vn, v_over = _f16_norms(_stored_norms(ev, config.value_codec, config.norm_correction))
    return k, v, ek.packed, kn, ev.packed, vn, k_over | v_over


def _append_impl(cache: KVCache, k, v, new_lengths):
    k, v, kc, kn, vc, vn, over = quantize(cache.config, k, v)
    batch = k.shape[0]
    counts = jnp.clip(new_lengths, 0, k.shape[1])
    seqs = jnp.arange(batch, dtype=jnp.int32)
    start = cache.lengths
    new, flagged = write_rows(cache, seqs, start, counts, kc, kn, vc, vn, over)
    cfg = cache.config
    if cfg.exact:
        new = _write_exact(new, k, v, start, new.lengths)
    return new, flagged


def _stored_norms(enc: _codec.Encoded, config: _codec.CodecConfig, corrected: bool):
    """The norm the cache stores: ``|x|``, or ``|x| / |c|`` with norm correction (an
    all-zero centroid vector keeps ``|x|``: it decodes as 0 either way)."""
    if not corrected:
        return enc.norms
    c = _scoring.centroid_norms(enc.packed, config)
    return jnp.where(c > 0, enc.norms / jnp.where(c > 0, c, 1.0), enc.norms)


def _write_exact(cache: KVCache, k, v, start, end):
    """Copy the appended tokens that land in the window ring (the last ``window`` before
    ``end``) or among the first ``sinks`` positions into the exact buffers. ``k``/``v``
    ``[B, N, H, D]`` hold positions ``start...``; ``end`` is each sequence's new length."""
    cfg = cache.config
    n = k.shape[1]
    pos = start[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]  # [B, N]
    stored = pos < end[:, None]
    rows = jnp.arange(k.shape[0], dtype=jnp.int32)[:, None]
    if cfg.window:
        keep = stored & (pos >= end[:, None] - cfg.window)
        slot = jnp.where(keep, pos % cfg.window, cfg.window)  # out of range: the scatter drops it
        cache = dataclasses.replace(
            cache,
            k_window=cache.k_window.at[rows, slot].set(k, mode="drop"),
            v_window=cache.v_window.at[rows, slot].set(v, mode="drop"),
        )
    if cfg.sinks:
        slot = jnp.where(stored & (pos < cfg.sinks), pos, cfg.sinks)
        cache = dataclasses.replace(
            cache,
            k_sinks=cache.k_sinks.at[rows, slot].set(k, mode="drop"),
            v_sinks=cache.v_sinks.at[rows, slot].set(v, mode="drop"),
        )
    return cache


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
        raise _wire.NormOverflowError(NORM_OVERFLOW.format(count=int(overflowed)))
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


