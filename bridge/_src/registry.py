"""Registers the tq_jax serde with LMCache under a type name, with validated options.

After :func:`register`, an L2 adapter config can say::

    {"type": "fs", "base_path": "/cache",
     "serde": {"type": "tq_jax", "head_dim": 128}}

The factory LMCache calls with the ``serde`` dict (minus ``"type"``) validates every
key against :data:`OPTIONS`, a table: an unknown key is an error that lists the valid
ones, and a value of the wrong type or range is an error that says what is allowed.
The table is generated (:func:`option_table`): one row per :class:`tq_jax.Options`
field (help, TQ01 version and allowed values from the field's metadata), plus the
bridge-only rows (:data:`BRIDGE_ONLY`: ``head_dim``, the ``bits`` shorthand, the
runtime's ``max_workers`` and ``device``, the reference plugin's ``use_qjl`` and
``qjl_sketch_size``, the engine layout's ``kv_layout`` and ``block_size``, ``preset`` and ``encrypt``). :class:`SerdeOptions` and the keyword arguments
of :class:`~tq_jax.bridge._src.serde.TQJaxSerializer` follow the table, so a new Options
field is a serde option with no edit here.

Safe by default: a dict with no format option writes ``turbo-4`` (TQ01 version 2, a
CRC32 and the key binding, so a damaged or misplaced value is refused and recomputed);
one that names bits or other codec options writes version 2 with the checksum on; the
reference plugin's version 1, without a checksum, only when asked for by name
(``"format": "v1"``, or the ``compat-4bit`` preset) (:func:`parse_options`). Building
the serde compiles its programs (``warmup``, :mod:`~tq_jax.bridge._src.warmup`), so the
first L2 hit after a start is as fast as the next.

LMCache 0.5.6 has no serde discovery: the type must be registered in the process that
builds the ``StorageManager``, before it is built. See :mod:`tq_jax.bridge.launch` (a
launcher for ``lmcache server``) and :mod:`tq_jax.bridge.plugin` (a config-only loader).

The package re-exports :func:`register` as ``tq_jax.bridge.register``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Mapping

from lmcache.v1.distributed.serde import factory as _lmc_factory

import tq_jax
from tq_jax.bridge._src import processor as _processor
from tq_jax.bridge._src import reconnect as _reconnect
from tq_jax.bridge._src import seal as _seal
from tq_jax.bridge._src import serde as _serde
from tq_jax.bridge._src import warmup as _warmup
from tq_jax.bridge._src.device import resolve_device
from tq_jax.bridge._src.schema import (  # the option table, re-exported: registry.OPTIONS etc.
    BRIDGE_ONLY,
    OPTIONS,
    Option,
    SerdeOptions,
    check_values,
    codec_options_for,
    option_table,
    parse_options,
    serde_options_class,
)

__all__ = [
    "ALIASES",
    "DEFAULT_NAME",
    "OPTIONS",
    "WIRE_VERSION",
    "BRIDGE_ONLY",
    "Option",
    "SerdeOptions",
    "check_values",
    "codec_options_for",
    "option_table",
    "serde_options_class",
    "build_serde",
    "created_message",
    "make_serde_processor",
    "parse_options",
    "register",
    "registered_names",
]

logger = logging.getLogger(__name__)

DEFAULT_NAME = "tq_jax"
ALIASES = ("tqai",)  # the reference plugin's type name: its configs work unchanged
WIRE_VERSION = 2  # the newest TQ01 version this bridge writes


def make_serde_processor(kwargs: Mapping[str, object]) -> _processor.ParallelSerdeProcessor:
    """The factory LMCache calls: validated options → LMCache's ``AsyncSerdeProcessor``
    running each batch's objects over ``max_workers`` threads
    (:class:`~tq_jax.bridge._src.processor.ParallelSerdeProcessor`).

    Raises:
        ValueError, TypeError: as :func:`parse_options`.
    """
    o = parse_options(kwargs)
    serializer, deserializer = build_serde(o)
    inner = getattr(serializer, "inner", serializer)
    proc = _processor.ParallelSerdeProcessor(serializer, deserializer, max_workers=o.max_workers)
    logger.info("%s", created_message(o, inner.options, resolve_device(o.device), paired=inner.paired))
    if o.warmup:
        warm(inner, getattr(deserializer, "inner", deserializer))
    return proc


def warm(serializer: _serde.TQJaxSerializer, deserializer: _serde.TQJaxDeserializer, directory=None) -> None:
    """:func:`tq_jax.bridge._src.warmup.warm_up` for the serde's layout and the chunk shapes
    this setting planned before (remembered in ``directory``, default
    :func:`~tq_jax.bridge._src.warmup.cache_dir`), logged; from then on the serializer
    remembers every new shape it plans. A failure is logged as a warning and leaves the
    programs to compile at first use."""
    layout = serializer.paired if serializer.kv_layout == "auto" else serializer.kv_layout
    setting = (f"{serializer.options!r} kv_layout={serializer.kv_layout} paired={serializer.paired} "
               f"block_size={serializer.block_size} head_dim={serializer.head_dim} {serializer.device.platform}")
    shapes = _warmup.ChunkShapes(setting, directory)
    t0 = time.perf_counter()
    try:
        chunks = _warmup.warm_up(serializer, deserializer, layout, shapes.shapes, forget=shapes.discard)
    except Exception as e:  # noqa: BLE001 (never let a warm-up stop the serde)
        logger.warning("tq_jax serde warm-up failed (%s: %s); its programs compile at the first store or L2 hit instead",
                       type(e).__name__, e)
    else:
        said = ", ".join(f"{list(shape)} {dtype}" for shape, dtype in chunks[1:]) or f"none yet: {_warmup.WHY_TAIL}"
        logger.info("tq_jax serde warmed up in %.2f s: full blocks of kv_layout %s (a synthetic %s chunk) and the chunk "
                    "shapes planned before (%s), remembered in %s", time.perf_counter() - t0, layout,
                    list(chunks[0][0]), said, shapes.path)
    serializer.on_plan = shapes.add


def has_cuda() -> bool:
    """Whether this host has a CUDA device torch can use (where vLLM runs its GPU backends)."""
    import torch

    return bool(torch.cuda.is_available())


def build_serde(o: SerdeOptions, *, cuda: bool | None = None):
    """The (serializer, deserializer) pair of validated options.

    ``kv_layout="auto"`` reads an ``[L, T, H·2·D]`` chunk as vLLM's GPU layout
    (``fused``) on a host with CUDA and as its CPU layout (``vllm-cpu``, with the
    options' ``block_size``) without (``cuda``: None asks torch).

    Without ``encrypt``: :class:`~tq_jax.bridge._src.serde.TQJaxSerializer` and its
    deserializer, key-bound when the options checksum (``bind_key``). With it: both
    wrapped by :mod:`~tq_jax.bridge._src.seal` (AES-GCM, a key per value, the ObjectKey as
    associated data, so no key trailer inside).

    Raises:
        ValueError: a master key file cannot be read or is too short.
    """
    device = resolve_device(o.device)
    sealed = o.encrypt is not None
    bind = False if sealed else None  # None: follow checksum
    paired = "fused" if (has_cuda() if cuda is None else cuda) else "vllm-cpu"
    layout = dict(kv_layout=o.kv_layout, block_size=o.block_size, paired=paired)
    serializer = _serde.TQJaxSerializer(head_dim=o.head_dim, bits=o.bits, seed=o.seed, device=device, bind_key=bind, **layout, **o.codec_options())
    deserializer = _serde.TQJaxDeserializer(device=device, bind_key=serializer.bind_key, **layout)
    if not sealed:
        return serializer, deserializer
    keys = _seal.key_ring(o.encrypt)
    return (
        _seal.SealingSerializer(serializer, keys),
        _seal.OpeningDeserializer(deserializer, keys, serializer.estimate_serialized_size, accept_tqs1=o.encrypt.accept_tqs1),
    )


def created_message(o: SerdeOptions, options: tq_jax.Options, device, *, paired: str = "fused") -> str:
    """The INFO line logged each time LMCache builds the serde: classes, the TQ01
    version written, whether a damaged value is detected, the layout ``auto`` resolves
    to, and every effective option (a preset expanded, bits per K/V group).

    Examples:
        >>> o = parse_options({})
        >>> created_message(o, tq_jax.encode_options(bits=4, norm_dtype="float16"), "cpu:0")[:64]
        'tq_jax serde created: TQJaxSerializer/TQJaxDeserializer writing '
    """
    version = 1 if options.v1_expressible else 2
    readers = "tq_jax and the reference plugin read it" if version == 1 else "tq_jax reads it, the reference plugin cannot"
    names = registered_names()
    where = device if isinstance(device, str) else f"{device.platform}:{device.id}"
    layout = o.kv_layout
    if layout == "auto":
        host = "no CUDA on this host, so vLLM runs its CPU backend" if paired == "vllm-cpu" else "CUDA on this host"
        layout = f"auto ([L, T, H*2*D] chunks read as {paired}: {host}; set kv_layout to override)"
    cpu_blocks = o.kv_layout == "vllm-cpu" or (o.kv_layout == "auto" and paired == "vllm-cpu")
    fields = {"head_dim": o.head_dim, "kv_layout": layout, **({"block_size": o.block_size} if cpu_blocks else {}),
              **dataclasses.asdict(options), "preset": o.preset,
              "max_workers": o.max_workers, "device": where}
    if o.encrypt is not None:
        e = o.encrypt
        readers = "sealed with AES-GCM: only tq_jax with the same master key opens it"
        fields["encrypt"] = (
            f"aes-{e.aes_bits}-gcm/{e.key_provider}, a key per value (frame TQS2), sealing with master key file "
            f"{e.master_key_paths[0]}" + (f", opening with {', '.join(e.master_key_paths[1:])} too" if len(e.master_key_paths) > 1 else "")
            + ("; TQS1 values opened" if e.accept_tqs1 else "; TQS1 values refused")
        )
        detects = "detects damaged values: yes (AES-GCM tag, bound to the key and tenant)"
    else:
        fields["key_binding"] = options.checksum  # a key trailer after checksummed blobs
        detects = ("detects damaged values: yes (CRC32 and key binding)" if options.checksum else
                   "detects damaged values: NO (no checksum: a damaged value is loaded as it is; remove format/checksum "
                   "to write checksummed values)")
    return (
        f"tq_jax serde created: TQJaxSerializer/TQJaxDeserializer writing TQ01 v{version} ({readers}); {detects}; "
        f"registered as {', '.join(map(repr, names)) or '(not registered)'}; "
        + " ".join(f"{k}={v}" for k, v in fields.items())
    )


# ----------------------------------------------------------------------------- registry


def _registered_factory(name: str):
    """The factory LMCache holds for ``name`` (None if unregistered or unknowable)."""
    registry = getattr(_lmc_factory, "_SERDE_FACTORY_REGISTRY", None)  # private in 0.5.6
    if isinstance(registry, Mapping):
        return registry.get(name)
    return _REGISTERED.get(name) if name in _lmc_factory.get_registered_serde_types() else None


_REGISTERED: dict[str, Callable] = {}


def _size_contract_kwargs(register_fn: Callable) -> dict[str, object]:
    """``{"size_contract": EXACT}`` when this LMCache's register_serde_factory takes one."""
    try:
        param = inspect.signature(register_fn).parameters.get("size_contract")
    except (TypeError, ValueError):
        return {}
    if param is None:
        return {}  # LMCache 0.5.6: no size contract; fs requires n == estimate, which we meet
    contract = None
    if param.default is not inspect.Parameter.empty and hasattr(type(param.default), "EXACT"):
        contract = type(param.default).EXACT
    else:
        try:
            from lmcache.v1.distributed.serde import SerdeSizeContract  # newer LMCache
        except ImportError:
            SerdeSizeContract = None  # noqa: N806
        contract = getattr(SerdeSizeContract, "EXACT", None)
    if contract is None:
        raise RuntimeError(
            "this LMCache's register_serde_factory takes `size_contract`, but no "
            "SerdeSizeContract.EXACT was found to pass: tq_jax.bridge needs updating."
        )
    return {"size_contract": contract}


def _register_one(name: str) -> None:
    register_fn = _lmc_factory.register_serde_factory  # looked up per call (tests patch it)
    register_fn(name, make_serde_processor, **_size_contract_kwargs(register_fn))
    _REGISTERED[name] = make_serde_processor


def register(name: str = DEFAULT_NAME, *, aliases: tuple[str, ...] = ALIASES) -> tuple[str, ...]:
    """Registers the tq_jax serde with LMCache as ``name`` (idempotent).

    Each alias (default ``"tqai"``, the reference plugin's name) is registered too when
    no one else holds it; a taken alias is skipped with a log line, so registering the
    reference plugin first keeps the reference under ``"tqai"``. Where LMCache's
    ``register_serde_factory`` accepts a ``size_contract`` (newer LMCache), the serde is
    declared ``SerdeSizeContract.EXACT``: its estimate is its output size. The
    ``resp_reconnect`` L2 adapter type (:mod:`~tq_jax.bridge._src.reconnect`) is registered
    too, once per process.

    Args:
        name: the ``"type"`` an L2 adapter's ``serde`` dict uses.
        aliases: further names to take when they are free.

    Returns:
        The names under which the tq_jax factory is registered after the call.

    Raises:
        ValueError: ``name`` is already registered by another serde.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"serde type name must be a non-empty string, got {name!r}.")
    holder = _registered_factory(name)
    if holder is None:
        _register_one(name)
    elif holder is not make_serde_processor:
        raise ValueError(
            f"serde type {name!r} is already registered by another serde ({holder!r}); register "
            f"tq_jax under another name: tq_jax.bridge.register(name='...')."
        )
    _reconnect.register_adapter()
    for alias in aliases:
        holder = _registered_factory(alias)
        if holder is None:
            _register_one(alias)
        elif holder is not make_serde_processor:
            logger.info("serde type %r is taken by another serde; tq_jax does not alias it", alias)
    return registered_names()


def registered_names() -> tuple[str, ...]:
    """Names under which LMCache currently holds the tq_jax factory."""
    return tuple(n for n in _lmc_factory.get_registered_serde_types() if _registered_factory(n) is make_serde_processor)
