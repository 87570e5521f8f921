"""LMCache bridge for tq_jax: the only place torch and lmcache are imported.

Modules:
    :mod:`~tq_jax.bridge.dlpack`: torch <-> JAX arrays (zero-copy where possible).
    :mod:`~tq_jax.bridge.serde`: LMCache v1 ``Serializer`` / ``Deserializer`` emitting TQ01.
    :mod:`~tq_jax.bridge.register` (module): option table and ``register``.
    :mod:`~tq_jax.bridge.launch`: ``python -m tq_jax.bridge.launch server ...``.
    :mod:`~tq_jax.bridge.plugin`: the ``plugin`` L2 adapter loader (config-only).

``tq_jax.bridge.register`` is the function (``register(name="tq_jax")``), which shadows
the module of the same name; use ``importlib.import_module("tq_jax.bridge.register")``
for the module.
"""

from tq_jax.bridge.register import register as register

__all__ = ("register",)
