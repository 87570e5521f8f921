"""The public :func:`attend`: checks the query, then runs the chosen kernel."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from tq_jax.kvcache import exact as _exact
from tq_jax.kvcache import scoring as _scoring
from tq_jax.kvcache import xla as _xla
from tq_jax.kvcache.state import KVCache

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float

__all__ = ["attend", "IMPLS"]

IMPLS = ("xla", "pallas")


def _attend_impl(cache: KVCache, q, impl: str = "xla"):
    query = _scoring.query(cache, q)
    if impl == "pallas":
        from tq_jax.kvcache import pallas_tpu  # Pallas loads only when asked for

        m, l, acc = pallas_tpu.partial(cache, query, interpret=jax.default_backend() == "cpu")
    else:
        m, l, acc = _xla.partial(cache, query)
    exact = _exact.partial(cache, q, query) if cache.config.exact else None
    return _scoring.finish(cache, q, acc, l, m, exact)


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
            or ``"pallas"`` (one Pallas kernel over the pages, ``tq_jax.kvcache.pallas_tpu``;
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

