"""LMCache bridge for tq_jax: the only place torch and lmcache are imported.

Modules:
    :mod:`~tq_jax.bridge.dlpack`: torch <-> JAX arrays (zero-copy where possible).
    :mod:`~tq_jax.bridge.serde`: LMCache v1 ``Serializer`` / ``Deserializer`` emitting TQ01.
    :mod:`~tq_jax.bridge.device`: the ``device`` option -> a JAX device.
    :mod:`~tq_jax.bridge.schema`: the serde option table (generated from ``tq_jax.Options``).
    :mod:`~tq_jax.bridge.seal`: AES-GCM under a key per tenant and value around the serde's values (``encrypt``).
    :mod:`~tq_jax.bridge.registry`: builds the serde from a config, ``register``.
    :mod:`~tq_jax.bridge.reconnect`: the ``resp_reconnect`` L2 adapter (RESP that reconnects).
    :mod:`~tq_jax.bridge.launch`: ``python -m tq_jax.bridge.launch server ...``.
    :mod:`~tq_jax.bridge.plugin`: the ``plugin`` L2 adapter loader (config-only).
    :mod:`~tq_jax.bridge.smoke`: ``python -m tq_jax.bridge.smoke --l2-adapter JSON``.

``tq_jax.bridge.register(name="tq_jax")`` is :func:`tq_jax.bridge.registry.register`.
It is imported on first use, so that ``python -m tq_jax.bridge.launch --help`` (which
imports this package first) answers without loading torch and LMCache.
"""

__all__ = ("register",)


def __getattr__(name: str):
    if name == "register":
        from tq_jax.bridge.registry import register

        return register
    raise AttributeError(f"module 'tq_jax.bridge' has no attribute {name!r}")
