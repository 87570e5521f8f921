"""Engine adapters: thin, version-pinned glue between a serving engine and
:mod:`tq_jax._src.kvcache`'s engine-facing form (:mod:`tq_jax._src.kvcache.ragged`).

Each adapter is a module of its own, imported only when asked for (``import tq_jax``
imports none of them, nor their engines), installed with its engine by an extra:

* :mod:`tq_jax.adapters.easydel` — EasyDeL's eSurge (``pip install -e ".[easydel]"``).
"""
