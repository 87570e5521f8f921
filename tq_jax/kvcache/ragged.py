"""The KV cache in the form a serving engine drives: a page pool the engine addresses by
slot (:func:`init_pool`, :func:`write`) and ragged paged attention over it
(:func:`attend`, tpu-inference's argument form). docs/kvcache.md, "The ragged pool"."""

from tq_jax._src.kvcache.ragged import Pool, PoolConfig, attend, init_pool, nbytes, write

__all__ = ["PoolConfig", "Pool", "init_pool", "write", "attend", "nbytes"]
