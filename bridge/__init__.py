"""LMCache bridge for tq_jax: the only place torch and lmcache are imported.

Modules:
    :mod:`~tq_jax.bridge._src.dlpack`: torch <-> JAX arrays (zero-copy where possible).
    :mod:`~tq_jax.bridge._src.serde`: LMCache v1 ``Serializer`` / ``Deserializer`` emitting TQ01.
    :mod:`~tq_jax.bridge._src.device`: the ``device`` option -> a JAX device.
    :mod:`~tq_jax.bridge._src.schema`: the serde option table (generated from ``tq_jax.Options``).
    :mod:`~tq_jax.bridge._src.seal`: AES-GCM under a key per tenant and value around the serde's values (``encrypt``).
    :mod:`~tq_jax.bridge._src.processor`: LMCache's ``AsyncSerdeProcessor`` running a batch's chunks in parallel.
    :mod:`~tq_jax.bridge._src.registry`: builds the serde from a config, ``register``.
    :mod:`~tq_jax.bridge._src.reconnect`: the ``resp_reconnect`` L2 adapter (RESP that reconnects).
    :mod:`~tq_jax.bridge.launch`: ``python -m tq_jax.bridge.launch server ...``.
    :mod:`~tq_jax.bridge.plugin`: the ``plugin`` L2 adapter loader (config-only).
    :mod:`~tq_jax.bridge.smoke`: ``python -m tq_jax.bridge.smoke --l2-adapter JSON``.

``tq_jax.bridge.register(name="tq_jax")`` is :func:`tq_jax.bridge._src.registry.register`.
It is imported on first use, so that ``python -m tq_jax.bridge.launch --help`` (which
imports this package first) answers without loading torch and LMCache, and quietly:
LMCache's import-time INFO lines show only when the application has configured logging
(or set ``LMCACHE_LOG_LEVEL``). Without the ``lmcache`` extra, reading it raises an
``ImportError`` whose one line names the missing module and :data:`INSTALL`; the launcher
and the smoke test print that line and exit (:func:`missing_extra`).
"""

__all__ = ("register",)

from tq_jax.bridge._src.extra import INSTALL, missing_extra  # noqa: F401 (read by the commands)


def __getattr__(name: str):
    if name == "register":
        import logging

        from tq_jax.bridge._src import logs

        # LMCache logs INFO lines while it is imported; they show when the application
        # has configured logging (or LMCACHE_LOG_LEVEL is set), as a library's should.
        try:
            with logs.quiet_lmcache(verbose=bool(logging.getLogger().handlers)):
                from tq_jax.bridge._src.registry import register
        except ImportError as e:
            line = missing_extra(e)
            if line is None:
                raise
            raise ImportError(line, name=e.name) from None
        return register
    raise AttributeError(f"module 'tq_jax.bridge' has no attribute {name!r}")
