"""Config-only loader: LMCache's ``plugin`` L2 adapter type registers the serde for you.

LMCache 0.5.6's ``plugin`` adapter imports ``module_path`` while it builds that adapter,
which is before it builds the adapter's serde. Importing this module registers the
tq_jax serde, and :class:`L2Adapter` builds the *real* adapter described by
``adapter_params`` (any registered type: ``fs``, ``redis``, ...). So this config needs
no launcher and no code::

    {"type": "plugin",
     "module_path": "tq_jax.bridge.plugin",
     "class_name": "L2Adapter",
     "adapter_params": {"type": "fs", "base_path": "/cache"},
     "serde": {"type": "tq_jax", "head_dim": 128}}

``serde`` (and ``eviction``) stay on the outer dict, where LMCache reads them; in
``adapter_params`` they would be ignored, so they are refused there. LMCache then wraps
the real adapter in its serde wrapper exactly as for ``{"type": "fs", ..., "serde": ...}``;
only the adapter's configured type name reads ``plugin``.

Use this where the process that builds the ``StorageManager`` is not started by you
(a spawned worker, a fixed container command); otherwise :mod:`tq_jax.bridge.launch`
is simpler. A second adapter in the same config may then use ``"type": "tq_jax"``
directly, as long as it comes after the plugin entry.
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase, get_l2_adapter_config_class
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

from tq_jax.bridge._src import logs
from tq_jax.bridge._src.registry import register

__all__ = ["L2Adapter", "build_inner_adapter"]

register()  # the point of importing this module: before LMCache builds the serde
logs.show_bridge_logs()  # so that the serde's "created" line reaches the server's log

_OUTER_ONLY = ("serde", "eviction")


def build_inner_adapter(params: dict[str, Any], l1_memory_desc: Any = None) -> L2AdapterInterface:
    """Builds the L2 adapter that ``params`` (a full adapter spec) describes.

    Args:
        params: the ``adapter_params`` dict: ``{"type": "fs", "base_path": ...}``.
        l1_memory_desc: forwarded to the adapter's factory (some adapters need it).

    Raises:
        ValueError: ``params`` is not an adapter spec, names the plugin itself, or holds
            ``serde``/``eviction`` (which belong on the outer dict).
    """
    if not isinstance(params, dict) or not isinstance(params.get("type"), str):
        raise ValueError(
            "tq_jax.bridge.plugin: adapter_params must be the real adapter's spec with a "
            "string 'type', e.g. {\"type\": \"fs\", \"base_path\": \"/cache\"}; got "
            f"{params!r}."
        )
    if params["type"] == "plugin":
        raise ValueError("tq_jax.bridge.plugin: adapter_params cannot itself be a plugin adapter.")
    misplaced = [k for k in _OUTER_ONLY if k in params]
    if misplaced:
        raise ValueError(
            f"tq_jax.bridge.plugin: move {', '.join(map(repr, misplaced))} from adapter_params to "
            f"the outer plugin dict: LMCache reads them there and would silently ignore them here."
        )
    spec = {k: v for k, v in params.items() if k not in ("affinity_tag", "shared")}
    cfg = get_l2_adapter_config_class(params["type"]).from_dict(spec)
    cfg.persist_config = L2AdapterConfigBase._parse_persist_config(params)
    return create_l2_adapter_from_registry(cfg, l1_memory_desc)


class L2Adapter(L2AdapterInterface):
    """A loader in adapter's clothing: constructing it returns the inner adapter.

    LMCache's plugin factory checks that ``class_name`` names an ``L2AdapterInterface``
    subclass and calls it with ``(adapter_params, l1_memory_desc=...)``. ``__new__``
    returns the adapter :func:`build_inner_adapter` makes, so LMCache talks to a real
    ``fs`` (or other) adapter with no delegation layer in between.
    """

    def __new__(cls, params: dict[str, Any], l1_memory_desc: Any = None) -> L2AdapterInterface:  # type: ignore[misc]
        return build_inner_adapter(params, l1_memory_desc)
