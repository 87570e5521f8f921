"""Registers the tq_jax serde with LMCache under a type name, with validated options.

After :func:`register`, an L2 adapter config can say::

    {"type": "fs", "base_path": "/cache",
     "serde": {"type": "tq_jax", "head_dim": 128, "bits": 4}}

The factory LMCache calls with the ``serde`` dict (minus ``"type"``) validates every
key against :data:`OPTIONS`, a table: an unknown key is an error that lists the valid
ones, and a value of the wrong type or range is an error that says what is allowed.
The defaults write TQ01 version 1 (the reference plugin reads it); the rows marked
version 2 (per-K/V bits, raw edge layers, rotation, norm dtype, norm correction,
checksum, and ``preset``, a named bundle of them) write version 2.

LMCache 0.5.6 has no serde discovery: the type must be registered in the process that
builds the ``StorageManager``, before it is built. See :mod:`tq_jax.bridge.launch` (a
launcher for ``lmcache server``) and :mod:`tq_jax.bridge.plugin` (a config-only loader).

The package re-exports :func:`register` as ``tq_jax.bridge.register``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from lmcache.v1.distributed.serde import factory as _lmc_factory
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor

import tq_jax
from tq_jax import wire as _wire
from tq_jax.bridge import serde as _serde
from tq_jax.options import PRESETS

__all__ = [
    "ALIASES",
    "DEFAULT_NAME",
    "OPTIONS",
    "WIRE_VERSION",
    "Option",
    "SerdeOptions",
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
    if not 1 <= value <= 8:
        raise ValueError(
            f"serde option `{name}` must be in 1..8, got {value}: bits sets the codebook size "
            f"2**bits; 4 keeps ~0.995 cosine at ~26 % of bf16 ({_wire.READ_BITS_V1} stay TQ01 "
            f"version 1, which the reference plugin reads)."
        )
    return value


def _opt_bits(name: str, value: object):
    return None if value is None else _bits(name, value)


def _choice(*choices: str, why: str = "") -> Callable[[str, object], str]:
    def check(name: str, value: object) -> str:
        if not isinstance(value, str):
            raise TypeError(f"serde option `{name}` must be a string, got {type(value).__name__} {value!r}.")
        if value not in choices:
            raise ValueError(f"serde option `{name}` must be one of {choices}, got {value!r}.{why}")
        return value

    return check


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"serde option `{name}` must be a bool, got {type(value).__name__} {value!r}.")
    return value


def _norm_dtype(name: str, value: object) -> str:
    if value == "auto":
        raise ValueError(_serde.AUTO_NORMS)
    return _choice(*_serde.NORM_DTYPES)(name, value)


def _norm_bits(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"serde option `{name}` must be an int, got {type(value).__name__} {value!r}.")
    if value != 0 and not 2 <= value <= 8:
        raise ValueError(
            f"serde option `{name}` must be 0 (float norms) or 2..8 (log-coded norms), got {value}."
        )
    return value


def _preset(name: str, value: object):
    if value is None:
        return None
    return _choice(*sorted(PRESETS), why=" Presets are documented in docs/quality.md.")(name, value)


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


class Option(NamedTuple):
    """One row of the serde option table."""

    name: str
    default: Any
    check: Callable[[str, object], object]  # validates and canonicalises; raises Type/ValueError
    help: str
    version: int = 1  # the TQ01 version that can express the option


OPTIONS: tuple[Option, ...] = (
    Option("head_dim", 128, _int_in(2, _wire.MAX_DENSE_DIM), "vector length; the KV hidden axis is split into heads of this size (MLA: the latent width, e.g. 576)"),
    Option("bits", 4, _bits, "bits per coordinate, 1..8 (2, 3, 4, 6, 8 stay TQ01 v1)"),
    Option("seed", 42, _int_in(-(2**31), 2**31 - 1), "rotation seed (int32), recorded in every blob"),
    Option("max_workers", 1, _int_in(1, MAX_WORKERS), "AsyncSerdeProcessor thread-pool size"),
    Option("device", "cpu", _device, "where the codec runs: cpu, gpu, tpu or auto, optionally :index"),
    # Accepted so that configs written for the reference plugin work unchanged.
    Option("use_qjl", False, _use_qjl, "reference-plugin option; only false is supported"),
    Option("qjl_sketch_size", 64, _int_in(1, _wire.MAX_QJL_SKETCH), "reference-plugin option; ignored while use_qjl is false"),
    # TQ01 version 2 (any non-default value writes version 2).
    Option("key_bits", None, _opt_bits, "bits for keys (slot 0 of [2, L, T, ...]); default: bits", version=2),
    Option("value_bits", None, _opt_bits, "bits for values (slot 1); default: bits", version=2),
    Option("skip_first_layers", 0, _int_in(0, _wire.MAX_SKIP_LAYERS), "leading layers stored as exact bytes", version=2),
    Option("skip_last_layers", 0, _int_in(0, _wire.MAX_SKIP_LAYERS), "trailing layers stored as exact bytes", version=2),
    Option("rotation", "haar", _choice("haar", "hadamard"), "haar (the reference's) or hadamard (fast, structured)", version=2),
    Option("norm_dtype", "float16", _norm_dtype, "float16 (v1) or float32 (never overflows)", version=2),
    Option("norm_correction", False, _flag, "rescale centroid vectors to unit length on decode", version=2),
    Option("checksum", False, _flag, "CRC32 over each blob, verified on load (a corrupt blob is a miss)", version=2),
    Option("norm_bits", 0, _norm_bits, "0: float norms; 2..8: log-coded norms of that many bits per vector", version=2),
    Option("preset", None, _preset, f"a named bundle of the v2 options: {', '.join(sorted(PRESETS))}; explicit keys override it", version=2),
)
_BY_NAME = {o.name: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class SerdeOptions:
    """Validated serde options (every row of :data:`OPTIONS`)."""

    head_dim: int = 128
    bits: int = 4
    seed: int = 42
    max_workers: int = 1
    device: str = "cpu"
    use_qjl: bool = False
    qjl_sketch_size: int = 64
    key_bits: int | None = None
    value_bits: int | None = None
    skip_first_layers: int = 0
    skip_last_layers: int = 0
    rotation: str = "haar"
    norm_dtype: str = "float16"
    norm_correction: bool = False
    checksum: bool = False
    norm_bits: int = 0
    preset: str | None = None

    def codec_options(self) -> dict:
        """The :class:`tq_jax.Options` fields beyond ``bits`` and ``seed``."""
        names = ("key_bits", "value_bits", "skip_first_layers", "skip_last_layers", "rotation",
                 "norm_dtype", "norm_correction", "checksum", "norm_bits")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


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
        valid = ", ".join(o.name for o in OPTIONS if o.version == 1)
        v2 = ", ".join(o.name for o in OPTIONS if o.version == 2)
        raise ValueError(
            f"unknown tq_jax serde option(s) {', '.join(map(repr, unknown))}. Valid options: "
            f"{valid}; TQ01 version 2 options: {v2}. Check the spelling in the L2 adapter's "
            f"\"serde\" dict."
        )
    values = {}
    for key, value in kwargs.items():
        values[key] = _BY_NAME[key].check(key, value)
    if values.get("preset"):  # a preset fills what the config does not say explicitly
        for key, value in PRESETS[values["preset"]].items():
            values.setdefault(key, value)
    o = SerdeOptions(**values)
    tq_jax.Options.make(o.bits, seed=o.seed, **o.codec_options())  # the combination is valid
    return o


def make_serde_processor(kwargs: Mapping[str, object]) -> AsyncSerdeProcessor:
    """The factory LMCache calls: validated options → ``AsyncSerdeProcessor``.

    Raises:
        ValueError, TypeError: as :func:`parse_options`.
    """
    o = parse_options(kwargs)
    device = _serde.resolve_device(o.device)
    serializer = _serde.TQJaxSerializer(head_dim=o.head_dim, bits=o.bits, seed=o.seed, device=device, **o.codec_options())
    proc = AsyncSerdeProcessor(serializer, _serde.TQJaxDeserializer(device=device), max_workers=o.max_workers)
    logger.info("%s", created_message(o, serializer.options, device))
    return proc


def created_message(o: SerdeOptions, options: tq_jax.Options, device) -> str:
    """The INFO line logged each time LMCache builds the serde: classes, the TQ01
    version written, and every effective option (a preset expanded, bits per K/V group).

    Examples:
        >>> o = parse_options({})
        >>> created_message(o, tq_jax.Options.make(4, norm_dtype="float16"), "cpu:0")[:64]
        'tq_jax serde created: TQJaxSerializer/TQJaxDeserializer writing '
    """
    version = 1 if options.v1_expressible else 2
    readers = "tq_jax and the reference plugin read it" if version == 1 else "tq_jax reads it, the reference plugin cannot"
    names = registered_names()
    where = device if isinstance(device, str) else f"{device.platform}:{device.id}"
    fields = {
        "head_dim": o.head_dim,
        "key_bits": options.key_bits,
        "value_bits": options.value_bits,
        "seed": options.seed,
        "rotation": options.rotation,
        "norm_dtype": options.norm_dtype,
        "norm_correction": options.norm_correction,
        "checksum": options.checksum,
        "skip_first_layers": options.skip_first_layers,
        "skip_last_layers": options.skip_last_layers,
        "preset": o.preset,
        "max_workers": o.max_workers,
        "device": where,
    }
    return (
        f"tq_jax serde created: TQJaxSerializer/TQJaxDeserializer writing TQ01 v{version} ({readers}); "
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
