"""Registers the tq_jax serde with LMCache under a type name, with validated options.

After :func:`register`, an L2 adapter config can say::

    {"type": "fs", "base_path": "/cache",
     "serde": {"type": "tq_jax", "head_dim": 128, "bits": 4}}

The factory LMCache calls with the ``serde`` dict (minus ``"type"``) validates every
key against :data:`OPTIONS`, a table: an unknown key is an error that lists the valid
ones, a value of the wrong type or range is an error that says what is allowed, and the
options reserved for TQ01 version 2 are refused with "needs TQ01 version 2". Adding a
v2 option later means giving its row a checker and raising :data:`WIRE_VERSION`.

LMCache 0.5.6 has no serde discovery: the type must be registered in the process that
builds the ``StorageManager``, before it is built. See :mod:`tq_jax.bridge.launch` (a
launcher for ``lmcache server``) and :mod:`tq_jax.bridge.plugin` (a config-only loader).

Note: ``tq_jax.bridge.register`` is this module's :func:`register` *function* (the
package re-exports it); reach the module itself with
``importlib.import_module("tq_jax.bridge.register")``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from lmcache.v1.distributed.serde import factory as _lmc_factory
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor

from tq_jax import wire as _wire
from tq_jax.bridge import serde as _serde

__all__ = [
    "ALIASES",
    "DEFAULT_NAME",
    "OPTIONS",
    "WIRE_VERSION",
    "Option",
    "SerdeOptions",
    "make_serde_processor",
    "parse_options",
    "register",
    "registered_names",
]

logger = logging.getLogger(__name__)

DEFAULT_NAME = "tq_jax"
ALIASES = ("tqai",)  # the reference plugin's type name: its configs work unchanged
WIRE_VERSION = 1  # the TQ01 version this bridge writes; options above it are refused
MAX_WORKERS = 256


# ----------------------------------------------------------------------------- checkers


def _int_in(lo: int, hi: int) -> Callable[[str, object], int]:
    def check(name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"serde option `{name}` must be an int, got {type(value).__name__} {value!r}.")
        if not lo <= value <= hi:
            raise ValueError(f"serde option `{name}` must be in {lo}..{hi}, got {value}.")
        return value

    return check


def _bits(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"serde option `{name}` must be an int, got {type(value).__name__} {value!r}.")
    if value not in _wire.READ_BITS_V1:
        raise ValueError(
            f"serde option `{name}` must be one of {_wire.READ_BITS_V1} (the widths TQ01 version 1 "
            f"can record), got {value}: bits sets the codebook size 2**bits; 4 keeps ~0.995 cosine "
            f"at ~26 % of bf16."
        )
    return value


def _device(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"serde option `{name}` must be a string, got {type(value).__name__} {value!r}.")
    _serde.resolve_device(value)  # fails now, at factory time, if the platform is missing
    return value


def _use_qjl(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"serde option `{name}` must be a bool, got {type(value).__name__} {value!r}.")
    if value:
        raise ValueError(
            "serde option `use_qjl` = true is not supported: tq_jax decodes QJL blobs but does not "
            "write them, because the QJL residual hurts softmax attention and costs m extra bytes "
            "per vector. Remove `use_qjl` (or set it to false)."
        )
    return value


def _v2_only(name: str, value: object) -> object:
    raise ValueError(
        f"serde option `{name}` needs TQ01 version 2, not implemented yet: version 1 can only "
        f"record one bit width, a dense Haar rotation and float16 norms for the whole blob. "
        f"Remove `{name}` from the serde config for now."
    )


class Option(NamedTuple):
    """One row of the serde option table."""

    name: str
    default: Any
    check: Callable[[str, object], object]  # validates and canonicalises; raises Type/ValueError
    help: str
    version: int = 1  # the TQ01 version that can express the option


OPTIONS: tuple[Option, ...] = (
    Option("head_dim", 128, _int_in(2, _wire.MAX_DIM), "vector length; the KV hidden axis is split into heads of this size (MLA: the latent width, e.g. 576)"),
    Option("bits", 4, _bits, "bits per coordinate: 2, 3, 4, 6 or 8"),
    Option("seed", 42, _int_in(-(2**31), 2**31 - 1), "rotation seed (int32), recorded in every blob"),
    Option("max_workers", 1, _int_in(1, MAX_WORKERS), "AsyncSerdeProcessor thread-pool size"),
    Option("device", "cpu", _device, "where the codec runs: cpu, gpu, tpu or auto, optionally :index"),
    # Accepted so that configs written for the reference plugin work unchanged.
    Option("use_qjl", False, _use_qjl, "reference-plugin option; only false is supported"),
    Option("qjl_sketch_size", 64, _int_in(1, _wire.MAX_QJL_SKETCH), "reference-plugin option; ignored while use_qjl is false"),
    # Reserved for TQ01 version 2 (refused until it lands).
    Option("key_bits", None, _v2_only, "bits for keys (slot 0)", version=2),
    Option("value_bits", None, _v2_only, "bits for values (slot 1)", version=2),
    Option("skip_first_layers", None, _v2_only, "leading layers stored raw", version=2),
    Option("skip_last_layers", None, _v2_only, "trailing layers stored raw", version=2),
    Option("rotation", None, _v2_only, "rotation kind", version=2),
    Option("norm_dtype", None, _v2_only, "dtype of stored norms", version=2),
    Option("norm_correction", None, _v2_only, "norm correction on decode", version=2),
    Option("checksum", None, _v2_only, "blob checksum", version=2),
)
_BY_NAME = {o.name: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class SerdeOptions:
    """Validated serde options (the v1 subset of :data:`OPTIONS`)."""

    head_dim: int = 128
    bits: int = 4
    seed: int = 42
    max_workers: int = 1
    device: str = "cpu"
    use_qjl: bool = False
    qjl_sketch_size: int = 64


def parse_options(kwargs: Mapping[str, object]) -> SerdeOptions:
    """Validates an LMCache serde dict (without ``"type"``) against :data:`OPTIONS`.

    Raises:
        ValueError: an unknown key (the message lists the valid ones), a value out of
            range, a missing device platform, or a TQ01-version-2 option.
        TypeError: a value of the wrong type.

    Examples:
        >>> parse_options({"bits": 3}).bits
        3
    """
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"serde options must be a dict, got {type(kwargs).__name__}.")
    unknown = sorted(k for k in kwargs if k not in _BY_NAME)
    if unknown:
        valid = ", ".join(o.name for o in OPTIONS if o.version <= WIRE_VERSION)
        reserved = ", ".join(o.name for o in OPTIONS if o.version > WIRE_VERSION)
        raise ValueError(
            f"unknown tq_jax serde option(s) {', '.join(map(repr, unknown))}. Valid options: "
            f"{valid} (reserved for TQ01 version 2: {reserved}). Check the spelling in the "
            f"L2 adapter's \"serde\" dict."
        )
    values = {}
    for key, value in kwargs.items():
        opt = _BY_NAME[key]
        checked = opt.check(key, value)  # v2 rows raise here
        if opt.version <= WIRE_VERSION:
            values[key] = checked
    return SerdeOptions(**values)


def make_serde_processor(kwargs: Mapping[str, object]) -> AsyncSerdeProcessor:
    """The factory LMCache calls: validated options → ``AsyncSerdeProcessor``.

    Raises:
        ValueError, TypeError: as :func:`parse_options`.
    """
    o = parse_options(kwargs)
    device = _serde.resolve_device(o.device)
    return AsyncSerdeProcessor(
        _serde.TQJaxSerializer(head_dim=o.head_dim, bits=o.bits, seed=o.seed, device=device),
        _serde.TQJaxDeserializer(device=device),
        max_workers=o.max_workers,
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
    declared ``SerdeSizeContract.EXACT``: its estimate is its output size.

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
