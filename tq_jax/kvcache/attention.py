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

__all__ = ["attend", "IMPLS", "resolve_impl"]

IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu")


def resolve_impl(cache: KVCache, impl: str) -> str:
    """The kernel ``impl`` names for this cache on JAX's default backend: ``"auto"`` is
    the GPU kernel on a GPU (measured faster than the XLA loop there:
    benchmarks/results/accelerator_nvidia_h200.md) when ``head_dim`` tiles for Triton,
    else the XLA loop; ``"pallas"`` is the backend's Pallas kernel."""
    backend = jax.default_backend()
    if impl == "auto":
        return "pallas_gpu" if backend == "gpu" and _scoring.lanes_tile(cache.config) else "xla"
    if impl == "pallas":
        return "pallas_gpu" if backend == "gpu" else "pallas_tpu"
    return impl


def _attend_impl(cache: KVCache, q, impl: str = "xla"):
    query = _scoring.query(cache, q)
    interpret = jax.default_backend() == "cpu"  # the Pallas interpreter: correct, slow, for tests
    if impl == "pallas_gpu":
        from tq_jax.kvcache import pallas_gpu  # Pallas loads only when asked for

        m, l, acc = pallas_gpu.partial(cache, query, interpret=interpret)
    elif impl == "pallas_tpu":
        from tq_jax.kvcache import pallas_tpu

        m, l, acc = pallas_tpu.partial(cache, query, interpret=interpret)
    else:
        m, l, acc = _xla.partial(cache, query)
    return _exact.finish(cache, q, query, m, l, acc)


_attend_jit = jax.jit(_attend_impl, static_argnames="impl")


def attend(cache: KVCache, q, *, impl: str = "auto") -> "Float[Array, 'batch q_len q_heads head_dim']":
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
    up to float32 rounding, except that the exact window and sinks (``init``'s ``window``
    and ``sinks``) are read exactly, in the same softmax (:mod:`tq_jax.kvcache.exact`). A
    query that sees no token (``lengths[b] < q_len``) returns zeros. A norm-corrected
    cache stores ``|x| / |c|`` as the norm, so the codes read as the corrected decoder's.

    Args:
        cache: the cache.
        q: ``[batch, q_len, q_heads, head_dim]``, ``q_heads`` a multiple of kv_heads.
        impl: ``"auto"`` (the default: the GPU kernel on a GPU, the XLA loop elsewhere;
            :func:`resolve_impl`), ``"xla"`` (a ``fori_loop`` over blocks of XLA ops),
            ``"pallas_gpu"`` (one Pallas/Triton kernel, ``tq_jax.kvcache.pallas_gpu``),
            ``"pallas_tpu"`` (one Pallas kernel with a TPU grid spec,
            ``tq_jax.kvcache.pallas_tpu``) or ``"pallas"`` (the GPU kernel on a GPU, the TPU
            one elsewhere). On CPU the Pallas kernels run in the Pallas interpreter
            (correct but slow). docs/accelerator.md says which runs where and why.

    Returns:
        ``[batch, q_len, q_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: a shape that does not fit the cache, or an unknown ``impl``.
    """
    cfg = cache.config
    if impl not in IMPLS:
        raise ValueError(
            f"`impl` must be one of {IMPLS}, got {impl!r}: the XLA loop, or a Pallas kernel (docs/accelerator.md)."
        )
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
    return _attend_jit(cache, q, impl=resolve_impl(cache, impl))


# --------------------------------------------------------------------------- export / load

