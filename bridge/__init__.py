"""LMCache bridge for tq_jax: the only place torch and lmcache are imported.

Modules:
    :mod:`~tq_jax.bridge.dlpack`: torch <-> JAX arrays (zero-copy where possible).
    :mod:`~tq_jax.bridge.serde`: LMCache v1 ``Serializer`` / ``Deserializer`` emitting TQ01.
    :mod:`~tq_jax.bridge.registry`: option table and ``register``.
    :mod:`~tq_jax.bridge.launch`: ``python -m tq_jax.bridge.launch server ...``.
    :mod:`~tq_jax.bridge.plugin`: the ``plugin`` L2 adapter loader (config-only).

``tq_jax.bridge.register(name="tq_jax")`` is :func:`tq_jax.bridge.registry.register`.
"""

from tq_jax.bridge.registry import register as register

__all__ = ("register",)
