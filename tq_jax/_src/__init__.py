"""tq_jax's private core: the codec's layers, executors, kernels and helpers.

Nothing here is public API; its modules import each other freely, in the layers of
docs/architecture.md. The public names are curated in ``tq_jax``, ``tq_jax.wire``,
``tq_jax.kvcache`` (and ``tq_jax.kvcache.ragged``), ``tq_jax.batch``, ``tq_jax.cli``,
``tq_jax.adapters.easydel`` and ``tq_jax.bridge``. Submodules load on first use
(``tq_jax._src.codec``), as the package's own façade does.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
