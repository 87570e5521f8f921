"""The public :func:`attend`: checks the query, then runs the chosen kernel."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from tq_jax._src.kvcache import exact as _exact
from tq_jax._src.kvcache import scoring as _scoring
from tq_jax._src.kvcache import target as _target
from tq_jax._src.kvcache import xla as _xla
from tq_jax._src.kvcache.state import KVCache

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float

    from tq_jax._src.kvcache.pallas_gpu import Tuning

__all__ = ["attend", "IMPLS", "check_impl", "resolve_impl", "forms", "coded_partial"]

IMPLS = ("auto", "xla", "pallas_tpu", "pallas_gpu")

NO_TRITON_FALLBACK = (
    "kvcache.attend(impl='auto') runs the XLA loop on this GPU: jax {version} has no Pallas Triton backend "
    "(jax.experimental.pallas.triton), which the GPU kernel needs. The XLA loop is correct but about 13x "
    "slower there (docs/accelerator.md); pin a jax with the Triton backend for the kernel."
)
_warned = set()  # the fallbacks already warned about, once per process


def _triton_available() -> bool:
    from tq_jax._src.kvcache import pallas_gpu  # Pallas loads only on a GPU

    return pallas_gpu.available()


def check_impl(impl) -> str:
    """``impl`` if it is one of :data:`IMPLS`; a ValueError naming them otherwise (and the
    kernel to name instead of the removed ``"pallas"``)."""
    if impl == "pallas":
        raise ValueError(
            "impl='pallas' was removed (one name per kernel): write impl='pallas_tpu' for the Mosaic TPU kernel, "
            "impl='pallas_gpu' for the Triton GPU kernel, or impl='auto'."
        )
    if impl not in IMPLS:
        raise ValueError(
            f"`impl` must be one of {IMPLS}, got {impl!r}: the XLA loop, or a Pallas kernel (docs/accelerator.md)."
        )
    return impl


def resolve_impl(cache: KVCache, impl: str, platform: str | None = None) -> str:
    """The kernel ``impl`` names for this cache on ``platform`` (one of
    :data:`tq_jax._src.kvcache.target.PLATFORMS`, or ``"gpu"``; None: JAX's default backend).

    ``"auto"`` is the GPU kernel on a GPU (measured faster than the XLA loop there:
    benchmarks/results/accelerator_nvidia_h200.md) when ``head_dim`` tiles for Triton and
    this jax has Pallas's Triton backend, else the XLA loop (on a GPU host without the
    backend it warns once); on a TPU it is the XLA loop until a TPU measurement says
    otherwise (docs/kvcache.md). ``"auto"`` names the GPU kernel only when traced on a
    GPU host: elsewhere it is the XLA loop for every platform, so a CPU or TPU program
    never traces the GPU kernel (its Pallas call does not trace under every transform a
    user applies, e.g. ``shard_map`` with ``check_vma``); name ``"pallas_gpu"`` to export
    the kernel for a GPU from another host.
    :func:`attend` resolves ``impl`` for every platform and stages the choices out
    (:func:`tq_jax._src.kvcache.target.staged`), so a program lowered for a platform holds
    that platform's kernel, whatever the host that traced it."""
    if cache.config.trellis:
        if impl in ("pallas_tpu", "pallas_gpu"):
            raise ValueError(
                f"impl={impl!r} reads scalar codes, and this cache holds trellis codes (trellis=True), which only "
                f"the XLA loop reads: pass impl='auto' or impl='xla', or build the cache without trellis."
            )
        return "xla"
    if platform is None:
        platform = jax.default_backend()
    gpu = platform == "gpu" or platform in _target.GPU
    if impl == "auto":
        if not gpu or jax.default_backend() != "gpu" or not _scoring.lanes_tile(cache.config):
            return "xla"
        if not _triton_available():
            if "no-triton" not in _warned and jax.default_backend() == "gpu":
                _warned.add("no-triton")
                warnings.warn(NO_TRITON_FALLBACK.format(version=jax.__version__), RuntimeWarning, stacklevel=3)
            return "xla"
        return "pallas_gpu"
    return impl


def forms(cache: KVCache, impl: str) -> tuple:
    """``((platform, (kernel, interpreted)), ...)`` for every platform a program running
    ``impl`` can be lowered for: a Pallas kernel only where it is written for (its
    compiled form) and on the CPU (interpreted, :func:`tq_jax._src.kvcache.target.interpret`)."""
    out = []
    for platform in _target.PLATFORMS:
        kernel = resolve_impl(cache, impl, platform)
        if kernel == "xla":
            out.append((platform, ("xla", False)))
        elif _target.interpret(platform) or platform in {"pallas_tpu": _target.TPU, "pallas_gpu": _target.GPU}[kernel]:
            if kernel == "pallas_gpu" and not _target.interpret(platform) and not _gpu_kernel_builds(cache):
                continue  # lowering for this GPU fails (attend refuses on a GPU host, saying why)
            out.append((platform, (kernel, _target.interpret(platform))))
    return tuple(out)


def _gpu_kernel_builds(cache: KVCache) -> bool:
    """Whether the GPU kernel can be compiled for this cache: Pallas's Triton backend is
    there and ``head_dim`` tiles for it."""
    return _triton_available() and _scoring.lanes_tile(cache.config)


def coded_partial(form: tuple, cache: KVCache, query, tuning):
    """The coded part ``(m, l, acc)`` by ``form``'s kernel, compiled or interpreted."""
    kernel, interpret = form
    if kernel == "pallas_gpu":
        from tq_jax._src.kvcache import pallas_gpu  # Pallas loads only when asked for

        return pallas_gpu.partial(cache, query, interpret=interpret, tuning=tuning or pallas_gpu.DEFAULT_TUNING)
    if kernel == "pallas_tpu":
        from tq_jax._src.kvcache import pallas_tpu

        return pallas_tpu.partial(cache, query, interpret=interpret)
    return _xla.partial(cache, query)


def _attend_impl(cache: KVCache, q, forms: tuple = (), tuning=None):
    """``forms``: :func:`forms` (static); the program holds the form of the platform it
    is lowered for."""
    query = _scoring.query(cache, q)
    m, l, acc = _target.staged(dict(forms), lambda form: coded_partial(form, cache, query, tuning))
    return _exact.finish(cache, q, query, m, l, acc)


_attend_jit = jax.jit(_attend_impl, static_argnames=("forms", "tuning"))


def attend(
    cache: KVCache, q, *, impl: str = "auto", tuning: "Tuning | None" = None
) -> "Float[Array, 'batch q_len q_heads head_dim']":
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
    side, :func:`tq_jax._src.packing.plane_order`), with ``q′`` permuted to match, so no
    interleave is ever built. The result equals dense attention over the decoded K/V (``loads(export(...))``)
    up to float32 rounding, except that the exact window and sinks (``init``'s ``window``
    and ``sinks``) are read exactly, in the same softmax (:mod:`tq_jax._src.kvcache.exact`). A
    query that sees no token (``lengths[b] < q_len``) returns zeros. A norm-corrected
    cache stores ``|x| / |c|`` as the norm, so the codes read as the corrected decoder's.

    Args:
        cache: the cache.
        q: ``[batch, q_len, q_heads, head_dim]``, ``q_heads`` a multiple of kv_heads.
        impl: ``"auto"`` (the default: the GPU kernel on a GPU, the XLA loop elsewhere;
            :func:`resolve_impl`), ``"xla"`` (a ``fori_loop`` over blocks of XLA ops),
            ``"pallas_gpu"`` (one Pallas/Triton kernel, ``tq_jax._src.kvcache.pallas_gpu``),
            or ``"pallas_tpu"`` (one Pallas/Mosaic kernel, ``tq_jax._src.kvcache.pallas_tpu``). Each is resolved
            for the platform the program is lowered for, not the host that traces it
            (:mod:`tq_jax._src.kvcache.target`): a Pallas kernel is compiled for its accelerator
            and runs in the Pallas interpreter (correct but slow) on a CPU, and a program
            exported on a CPU for a TPU holds the Mosaic kernel. docs/accelerator.md and
            docs/tpu.md say which runs where and why.
        tuning: the GPU kernel's static knobs (:class:`tq_jax._src.kvcache.pallas_gpu.Tuning`),
            used when the kernel runs (``impl`` ``"pallas_gpu"``, or ``"auto"`` resolving
            to it); None is its default, the float32-level ``mode="exact"``.
            ``pallas_gpu.BF16_TUNING`` (``mode="bf16"``) has dense bf16 attention's
            accuracy instead. Refused with an ``impl`` that can never run the GPU kernel.

    Returns:
        ``[batch, q_len, q_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: a shape that does not fit the cache, an unknown ``impl``, or a
            ``tuning`` with an ``impl`` other than the GPU kernel's.
        RuntimeError: ``impl="pallas_gpu"`` on a GPU whose jax has no Pallas Triton backend.
    """
    cfg = cache.config
    check_impl(impl)
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
    if tuning is not None and impl in ("xla", "pallas_tpu"):
        raise ValueError(
            f"`tuning` is the GPU kernel's (impl='pallas_gpu'), got it with impl={impl!r}, which never runs that "
            "kernel: drop `tuning`, or use impl='pallas_gpu' or 'auto'."
        )
    if jax.default_backend() == "gpu" and resolve_impl(cache, impl) == "pallas_gpu":
        from tq_jax._src.kvcache import pallas_gpu

        if not pallas_gpu.available():
            raise RuntimeError(pallas_gpu.NO_TRITON.format(version=jax.__version__))
        if not _scoring.lanes_tile(cfg):
            raise ValueError(pallas_gpu.NO_TILE.format(dim=cfg.head_dim, kb=cfg.key_bits, vb=cfg.value_bits))
    staged = forms(cache, impl)
    gpu_kernel = any(kernel == "pallas_gpu" for _, (kernel, _) in staged)
    return _attend_jit(cache, q, forms=staged, tuning=tuning if gpu_kernel else None)


# --------------------------------------------------------------------------- export / load

