"""What the launcher adds to, or says about, an ``lmcache server`` command line.

Needs no torch or LMCache (``has_cuda`` is passed in), so it is tested without them.

* **The transfer mode.** vLLM's ``LMCacheMPConnector`` on a CPU worker asks the server
  for *engine-driven* transfer (the engine copies KV to shared memory); LMCache 0.5.6's
  server serves only ``lmcache_driven`` (CUDA IPC) unless told otherwise, logs ``No
  handler registered for operation register_kv_cache_engine_driven_context`` and lets
  vLLM's ``register_kv_caches`` wait for ``lmcache.mp.mq_timeout``. On a host without
  CUDA, where no engine can use CUDA IPC, the launcher adds
  ``--supported-transfer-mode auto`` (both paths) unless the command names a mode.
* **The chunk layout.** A CPU vLLM fills LMCache's ``[L, T, H·2·D]`` chunks as
  ``kv_layout "vllm-cpu"``, not as the GPU backends' ``"fused"``. On a host without
  CUDA the serde's ``"auto"`` reads them as ``vllm-cpu`` by itself
  (:func:`tq_jax.bridge._src.registry.build_serde`); a serde set to ``"fused"`` there is
  taken at its word, and the launcher warns when its settings read which vectors are
  keys (per-K/V bits, raw layers): those would apply to the wrong vectors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

__all__ = ["TRANSFER_FLAG", "server_defaults"]

TRANSFER_FLAG = "--supported-transfer-mode"
ADDED_TRANSFER = (
    "no CUDA on this host: adding --supported-transfer-mode auto (vLLM's CPU worker uses engine-driven "
    "transfer, which LMCache's default mode does not serve; name a mode to override)"
)
CPU_LAYOUT = (
    "no CUDA on this host, so the engine is most likely vLLM's CPU backend, whose [L, T, H*2*D] chunks "
    "hold each block's keys and then its values (kv_layout 'vllm-cpu'); the L2 adapter's tq_jax serde has "
    "kv_layout {layout!r}, which reads them as vLLM's GPU layout, so its per-K/V settings "
    "({why}) would apply to the wrong vectors. Remove kv_layout (auto reads them as 'vllm-cpu' on this host) "
    "or set it to \"vllm-cpu\" (docs/vllm.md)."
)


def _serdes(args: Sequence[str]) -> list[dict]:
    """The tq_jax serde dicts of the command's ``--l2-adapter`` JSON values."""
    out = []
    for i, a in enumerate(args):
        value = args[i + 1] if a == "--l2-adapter" and i + 1 < len(args) else a.partition("=")[2] if a.startswith("--l2-adapter=") else None
        if value is None:
            continue
        try:
            spec = json.loads(value)
        except ValueError:
            continue  # LMCache reports its own parse error
        serde = spec.get("serde") if isinstance(spec, dict) else None
        if isinstance(serde, dict) and serde.get("type") in ("tq_jax", "tqai"):
            out.append(serde)
    return out


def _kv_settings(serde: dict) -> str:
    """Why a serde dict reads keys apart from values ('' if it does not)."""
    from tq_jax._src.options import PRESETS  # numpy only, no jax

    from tq_jax.bridge._src.schema import DEFAULT_PRESET, FORMAT_KEYS  # no torch, no LMCache

    preset = serde.get("preset") if any(k in serde for k in FORMAT_KEYS) else DEFAULT_PRESET
    given = dict(PRESETS.get(preset, {}))
    given.update({k: v for k, v in serde.items() if k != "type"})
    bits = given.get("bits", 4)
    why = []
    if given.get("key_bits", bits) != given.get("value_bits", bits):
        why.append(f"key_bits {given.get('key_bits', bits)} / value_bits {given.get('value_bits', bits)}")
    if given.get("skip_first_layers") or given.get("skip_last_layers"):
        why.append("raw edge layers")
    return ", ".join(why)


def server_defaults(args: Sequence[str], has_cuda: bool) -> tuple[list[str], list[str]]:
    """``(args, notes)``: the ``lmcache server ...`` arguments with the launcher's defaults
    added, and one line per default added or doubtful setting seen.

    Only a ``server`` command on a host without CUDA is changed or commented on.

    Examples:
        >>> server_defaults(["server", "--port", "6000"], has_cuda=False)[0]
        ['server', '--port', '6000', '--supported-transfer-mode', 'auto']
        >>> server_defaults(["server"], has_cuda=True)
        (['server'], [])
    """
    args = list(args)
    if not args or args[0] != "server" or has_cuda or any(a in ("-h", "--help") for a in args):
        return args, []
    notes = []
    if not any(a == TRANSFER_FLAG or a.startswith(TRANSFER_FLAG + "=") for a in args):
        args += [TRANSFER_FLAG, "auto"]
        notes.append(ADDED_TRANSFER)
    for serde in _serdes(args):
        layout = serde.get("kv_layout", "auto")
        why = _kv_settings(serde) if layout == "fused" else ""
        if why:
            notes.append(CPU_LAYOUT.format(layout=layout, why=why))
    return args, notes
