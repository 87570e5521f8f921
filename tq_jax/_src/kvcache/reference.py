"""Float64 references for the cache's attention: what each kernel computes, in plain numpy.

Like jax's ``ref_ragged_paged_attention`` beside its kernel, these functions share no
code with the kernels they describe, so tests hold the kernels to them. They take each
token twice: as appended (the exact copy the cache keeps for its window and sinks) and
as its codes decode (``tq_jax.loads`` of the blob :func:`tq_jax._src.kvcache.export` writes
holds the cache's codes). Attention reads a token exactly when it is among its
sequence's last ``window`` tokens or first ``sinks``, and decoded otherwise; everything
is computed in float64.

* :func:`dense_attention`: causal grouped-query softmax attention.
* :func:`read_kv`: one sequence's K/V as the cache's attention reads them.
* :func:`attend`: one sequence's rows of :func:`tq_jax._src.kvcache.attend`.
* :func:`ragged_attend`: :func:`tq_jax._src.kvcache.ragged.attend` over page arrays.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dense_attention", "read_kv", "attend", "ragged_attend"]


def dense_attention(q, k, v, *, scale: float | None = None, sliding_window: int | None = None) -> np.ndarray:
    """Causal softmax attention with grouped-query heads, in float64.

    The queries are the last ``Q`` positions of the keys: query ``i`` sits at position
    ``T - Q + i`` and sees the positions up to its own and, with ``sliding_window`` ``W``,
    none below ``T - Q + i - W + 1``. Query head ``h`` reads KV head
    ``h // (q_heads // kv_heads)``. A query that sees no position (``T - Q + i < 0``)
    gives zeros.

    Args:
        q: ``[Q, q_heads, head_dim]``, ``q_heads`` a multiple of ``kv_heads``.
        k: ``[T, kv_heads, head_dim]``.
        v: ``[T, kv_heads, head_dim]``.
        scale: the softmax scale; None: ``1 / sqrt(head_dim)``.
        sliding_window: how many positions, its own included, a query sees at most;
            None: no bound.

    Returns:
        ``[Q, q_heads, head_dim]`` float64.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n_q, q_heads, dim = q.shape
    t, heads = k.shape[:2]
    group = q_heads // heads
    scale = 1 / np.sqrt(dim) if scale is None else scale
    s = np.einsum("qhgd,thd->hgqt", q.reshape(n_q, heads, group, dim), k) * scale
    qpos = (t - n_q + np.arange(n_q))[:, None]
    allowed = np.arange(t)[None, :] <= qpos  # [Q, T]
    if sliding_window is not None:
        allowed &= np.arange(t)[None, :] > qpos - sliding_window
    s = np.where(allowed, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # T = 0 too
    p = np.where(allowed, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
    l = p.sum(-1, keepdims=True)
    out = np.einsum("hgqt,thd->qhgd", p / np.where(l == 0, 1, l), v)  # no key visible: zeros
    return out.reshape(n_q, q_heads, dim)


def read_kv(kv, decoded_kv, *, window: int, sinks: int, exact_from: int = 0) -> np.ndarray:
    """One sequence's K/V as the cache's attention reads them, float64 ``[2, T, kv_heads, head_dim]``.

    Position ``p`` of ``T`` is read from ``kv`` (its exact copy) when ``p >= T - window``
    or ``p < sinks``, and ``p >= exact_from``; from ``decoded_kv`` otherwise.

    Args:
        kv: ``[2, T, kv_heads, head_dim]``: keys then values, as appended.
        decoded_kv: the same tokens as their codes decode.
        window: the cache's exact window (its last tokens read exactly).
        sinks: the cache's sinks (its first tokens read exactly).
        exact_from: the first position the cache holds an exact copy of: a sequence
            brought in by :func:`tq_jax._src.kvcache.load` has codes only, and exact copies
            from the tokens appended after it.
    """
    kv, decoded_kv = np.asarray(kv, np.float64), np.asarray(decoded_kv, np.float64)
    t = kv.shape[1]
    pos = np.arange(t)
    exact = ((pos >= t - window) | (pos < sinks)) & (pos >= exact_from)
    return np.where(exact[None, :, None, None], kv, decoded_kv)


def attend(q, kv, decoded_kv, *, window: int, sinks: int, exact_from: int = 0) -> np.ndarray:
    """One sequence's rows of :func:`tq_jax._src.kvcache.attend`, float64 ``[q_len, q_heads, head_dim]``.

    The queries are the sequence's last ``q_len`` tokens (already appended); each attends
    causally over the K/V :func:`read_kv` gives (:func:`dense_attention`, scale
    ``1 / sqrt(head_dim)``).

    Args:
        q: ``[q_len, q_heads, head_dim]``: row ``b`` of ``attend``'s ``q``.
        kv: ``[2, T, kv_heads, head_dim]``: the sequence's keys then values, as appended.
        decoded_kv: the same tokens as their codes decode.
        window, sinks, exact_from: as in :func:`read_kv`.
    """
    k, v = read_kv(kv, decoded_kv, window=window, sinks=sinks, exact_from=exact_from)
    return dense_attention(q, k, v)


def ragged_attend(q, pages, decoded_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, window: int,
                  sinks: int, sm_scale: float | None = None, sliding_window: int | None = None) -> np.ndarray:
    """:func:`tq_jax._src.kvcache.ragged.attend` over page arrays, float64 ``[T, q_heads, head_dim]``.

    Sequence ``s < num_seqs`` holds ``kv_lens[s]`` tokens, position ``p`` at offset
    ``p % page_size`` of page ``page_indices[s, p // page_size]``; its queries, rows
    ``cu_q_lens[s]..cu_q_lens[s+1]`` of ``q``, are its last tokens and attend as
    :func:`attend`'s do (exact window and sinks, the rest decoded), with ``sm_scale`` and
    ``sliding_window`` as in :func:`dense_attention`. Rows of no sequence are zeros.

    Args:
        q: ``[T, q_heads, head_dim]``: every sequence's queries, flat.
        pages: ``[2, num_pages, page_size, kv_heads, head_dim]``: keys then values, as written.
        decoded_pages: the same tokens as their codes decode.
        kv_lens: ``[max_seqs]``: each sequence's KV length, its queries included.
        page_indices: ``[max_seqs, pages_per_seq]``: each sequence's pages in position order.
        cu_q_lens: ``[max_seqs + 1]``: where each sequence's queries start in ``q``.
        num_seqs: ``[1]`` or a scalar: the sequences in use (the first ones).
        window: the pool's exact window.
        sinks: the pool's sinks.
        sm_scale: the softmax scale; None: ``1 / sqrt(head_dim)``.
        sliding_window: as in :func:`dense_attention`.
    """
    q, pages, decoded_pages = (np.asarray(a, np.float64) for a in (q, pages, decoded_pages))
    kv_lens, page_indices, cu_q_lens = (np.asarray(a) for a in (kv_lens, page_indices, cu_q_lens))
    page_size = pages.shape[2]
    out = np.zeros(q.shape, np.float64)
    for s in range(int(np.asarray(num_seqs).reshape(-1)[0])):
        pos = np.arange(kv_lens[s])
        page, offset = page_indices[s, pos // page_size], pos % page_size
        k, v = read_kv(pages[:, page, offset], decoded_pages[:, page, offset], window=window, sinks=sinks)
        rows = slice(cu_q_lens[s], cu_q_lens[s + 1])
        out[rows] = dense_attention(q[rows], k, v, scale=sm_scale, sliding_window=sliding_window)
    return out
