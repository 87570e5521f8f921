"""A TurboQuant-compressed KV cache that attention reads directly: docs/kvcache.md.

::

    cache = kvcache.init(batch=2, max_len=4096, kv_heads=8, head_dim=128)  # 4/4 bits, window 128, 4 sinks
    cache = kvcache.init(2, 4096, 8, 128, options="turbo-3.5", window=128, sinks=4)
    cache = kvcache.append(cache, k, v)                 # k, v: [batch, new, kv_heads, head_dim]
    out = kvcache.attend(cache, q)                      # q: [batch, q_len, q_heads, head_dim]
    blob = kvcache.export(cache, seq=0)                 # TQ01 bytes of [2, 1, T, kv_heads, head_dim]
    cache = kvcache.load(cache, blob, seq=0)            # codes copied in, nothing re-quantized

The engine-facing form (a page pool the engine addresses by slot, ragged paged
attention) is :mod:`tq_jax.kvcache.ragged`. ``Tuning`` and ``BF16_TUNING`` are the GPU
kernel's static knobs (``attend(..., tuning=kvcache.BF16_TUNING)``: docs/accelerator.md).
"""

from tq_jax._src.kvcache import (
    DEFAULT_SINKS,
    DEFAULT_WINDOW,
    LOW_BITS_WINDOW,
    CacheConfig,
    KVCache,
    append,
    attend,
    default_window,
    export,
    init,
    load,
    nbytes,
)
from tq_jax._src.kvcache.pallas_gpu import BF16_TUNING, Tuning

__all__ = ["CacheConfig", "KVCache", "init", "append", "attend", "export", "load", "nbytes", "DEFAULT_WINDOW",
           "DEFAULT_SINKS", "LOW_BITS_WINDOW", "default_window", "Tuning", "BF16_TUNING"]
