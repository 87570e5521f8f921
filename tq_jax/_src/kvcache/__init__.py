"""A TurboQuant-compressed KV cache that attention reads directly.

The cache keeps, per token and KV head, exactly what a TQ01 blob keeps: the packed
Lloyd–Max codes of the key and of the value (uint8 rows, as :func:`tq_jax.encode`
packs them) and one float16 norm each. Nothing is decompressed into a
``(tokens, head_dim)`` float tensor: :func:`attend` rotates each query once, scores
the codes block by block with an online softmax (flash-decoding), accumulates the
values in the rotated domain and un-rotates once per query.

::

    cache = kvcache.init(batch=2, max_len=4096, kv_heads=8, head_dim=128)  # 4/4 bits, window 128, 4 sinks
    cache = kvcache.init(2, 4096, 8, 128, options="turbo-3.5", window=128, sinks=4)
    cache = kvcache.append(cache, k, v)                 # k, v: [batch, new, kv_heads, head_dim]
    cache = kvcache.append(cache, k, v, new_lengths=n)  # ragged: n[b] valid tokens of sequence b
    out = kvcache.attend(cache, q)                      # q: [batch, q_len, q_heads, head_dim]
    blob = kvcache.export(cache, seq=0)                 # TQ01 bytes of [2, 1, T, kv_heads, head_dim]
    cache = kvcache.load(cache, blob, seq=0)            # codes copied in, nothing re-quantized

An exact window: each sequence's most recent ``window`` tokens (default
:func:`default_window`: 128, or 256 when keys or values have 2 bits or fewer) and its
first ``sinks`` (default :data:`DEFAULT_SINKS`, 4) are also held in the model's dtype, and :func:`attend` reads those exactly, in one online softmax with the
codes of the rest. Local attention leans hardest on the recent tokens; reading them
from codes is what costs a model generating on the cache most of its quality
(benchmarks/studies/serving-smollm2.md). Every token is still quantized once, when appended, so codes
never change and :func:`export` is unaffected; ``window=0, sinks=0`` reads every token from codes.

Storage is a pool of pages ``[num_pages, page_size, kv_heads, row_bytes]`` plus a
per-sequence page table (vLLM's paged KV cache, tpu-inference's ragged paged
attention). Without ``page_size`` each sequence owns one page of its whole capacity;
with it, pages are taken from the pool in order as sequences grow.

A vector appended gets the codes and float16 norm that :func:`tq_jax.dumps` gives it
(the same encoder, and norms rounded to float16 as ``numpy.astype`` does), so
:func:`export` writes the bytes ``dumps`` writes for that sequence's K/V, and
:func:`load` copies a blob's codes in without re-quantizing.

References:
    Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal
    Distortion Rate", arXiv:2504.19874 (2025).
    Dao et al., "Flash-Decoding for long-context inference" (2023).
    Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention",
    SOSP 2023.

Modules, one per seam: :mod:`~tq_jax._src.kvcache.state` (config, leaves, :func:`init`) →
:mod:`~tq_jax._src.kvcache.write` (:func:`append`) → :mod:`~tq_jax._src.kvcache.scoring` (what
every attention kernel shares) → :mod:`~tq_jax._src.kvcache.xla`,
:mod:`~tq_jax._src.kvcache.pallas_tpu` and :mod:`~tq_jax._src.kvcache.pallas_gpu` (the kernels;
:mod:`~tq_jax._src.kvcache.target` picks a Pallas kernel's compiled or interpreted form by
the platform lowered for) → :mod:`~tq_jax._src.kvcache.attention`
(:func:`attend`); :mod:`~tq_jax._src.kvcache.blobs` (:func:`export`, :func:`load`). The
engine-facing form, for serving engines that own the page table and run ragged paged
attention: :mod:`~tq_jax._src.kvcache.pool` (``init_pool``, ``write``) and
:mod:`~tq_jax._src.kvcache.ragged` (``attend``, and the pool's names again). What both forms
compute, in float64 numpy: :mod:`~tq_jax._src.kvcache.reference`.
"""

from tq_jax._src.kvcache.attention import attend
from tq_jax._src.kvcache.blobs import export, load
from tq_jax._src.kvcache.state import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    DEFAULT_SINKS,
    DEFAULT_WINDOW,
    LOW_BITS_WINDOW,
    CacheConfig,
    KVCache,
    default_window,
    init,
    nbytes,
)
from tq_jax._src.kvcache.write import append

__all__ = ["CacheConfig", "KVCache", "init", "append", "attend", "export", "load", "nbytes", "BLOCK_TOKENS", "BLOCK_BYTES",
           "DEFAULT_WINDOW", "DEFAULT_SINKS", "LOW_BITS_WINDOW", "default_window"]
