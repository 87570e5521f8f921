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
imports this package first) answers without loading torch and LMCache, and quietly:
LMCache's import-time INFO lines show only when the application has configured logging
(or set ``LMCACHE_LOG_LEVEL``). Without the ``lmcache`` extra, reading it raises an
``ImportError`` whose one line names the missing module and :data:`INSTALL`; the launcher
and the smoke test print that line and exit (:func:`missing_extra`).
"""

__all__ = ("INSTALL", "missing_extra", "register")

INSTALL = 'pip install -e ".[lmcache]"'  # from the tq-jax clone: torch 2.13.0 (CPU) and lmcache 0.5.6
_EXTRA_MODULES = ("torch", "lmcache")


def missing_extra(error: ImportError) -> str | None:
    """One line saying that the ``lmcache`` extra is missing and how to install it, when
    ``error`` is the failed import of torch or lmcache; None for any other import error."""
    name = getattr(error, "name", None) or ""
    if name.partition(".")[0] not in _EXTRA_MODULES:
        return None
    return (f"tq_jax.bridge needs the `lmcache` extra (torch and lmcache), but {name!r} is not installed: "
            f"install it with {INSTALL} (in the tq-jax clone).")


def __getattr__(name: str):
    if name == "register":
        import logging

        from tq_jax.bridge import logs

        # LMCache logs INFO lines while it is imported; they show when the application
        # has configured logging (or LMCACHE_LOG_LEVEL is set), as a library's should.
        try:
            with logs.quiet_lmcache(verbose=bool(logging.getLogger().handlers)):
                from tq_jax.bridge.registry import register
        except ImportError as e:
            line = missing_extra(e)
            if line is None:
                raise
            raise ImportError(line, name=e.name) from None
        return register
    raise AttributeError(f"module 'tq_jax.bridge' has no attribute {name!r}")
