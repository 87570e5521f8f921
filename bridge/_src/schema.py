"""The tq_jax serde's option table: every key an L2 adapter's ``"serde"`` dict may hold.

:data:`OPTIONS` is generated (:func:`option_table`): one row per :class:`tq_jax.Options`
field (help, TQ01 version and allowed values from the field's metadata), plus the
bridge-only rows (:data:`BRIDGE_ONLY`: ``head_dim``, the ``bits`` shorthand, the
runtime's ``max_workers`` and ``device``, the reference plugin's ``use_qjl`` and
``qjl_sketch_size``, the engine layout's ``kv_layout`` and ``block_size``, ``preset``,
``format``, ``encrypt`` and ``warmup``). :class:`SerdeOptions` and the keyword arguments
of :class:`~tq_jax.bridge._src.serde.TQJaxSerializer` follow the table, so a new Options
field is a serde option with no edit here.

Safe by default (:func:`parse_options`): a serde dict that names no format option
(:data:`FORMAT_KEYS`) writes :data:`DEFAULT_PRESET`, whose values carry a CRC32 and the
key binding; one that names some writes TQ01 version 2 with ``checksum`` on unless it
says otherwise. The reference plugin's version 1, which has no checksum, is written only
when asked for by name: ``"format": "v1"`` (or the ``compat-4bit`` preset).

This module imports no serde class: :mod:`~tq_jax.bridge._src.serde` checks its keyword
arguments here, and :mod:`~tq_jax.bridge._src.registry` builds the serde from
:func:`parse_options`' result (imports run one way: registry -> serde -> schema).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import tq_jax
from tq_jax._src import codebook as _codebook
from tq_jax._src import options as _options
from tq_jax._src import wire as _wire
from tq_jax.bridge._src.device import resolve_device
from tq_jax.bridge._src.layouts import KV_LAYOUTS
from tq_jax._src.options import PRESETS

__all__ = [
    "AUTO_NORMS",
    "DEFAULT_PRESET",
    "FORMATS",
    "FORMAT_KEYS",
    "EncryptConfig",
    "BRIDGE_ONLY",
    "MAX_WORKERS",
    "NORM_DTYPES",
    "OPTIONS",
    "Option",
    "SerdeOptions",
    "check_values",
    "codec_options_for",
    "option_table",
    "parse_options",
    "serde_options_class",
]

MAX_WORKERS = 256

# What a serde dict with no format option writes. Chosen by measurement (docs/vllm.md,
# "The serde's settings"): a CRC32 and the key binding, no more bytes than v1 4-bit, and
# a smaller error on a loaded prefix.
DEFAULT_PRESET = "turbo-4"
FORMATS = ("v1", "v2")
BAD_V1 = (
    "serde option `format` is 'v1' (TQ01 version 1, the reference plugin's format), which cannot "
    "express {what}: version 1 has one bit width, the Haar rotation, float16 norms and no checksum. "
    "Remove those options to write the reference's format, or remove `format` to write version 2."
)

# The bridge pins the norm dtype (default float16: TQ01 version 1, which the reference
# reads) so that every blob's size is known from the layout alone: the core's
# norm_dtype="auto" would switch a blob with a norm above float16's range to float32 norms,
# 2 bytes per vector longer than the estimate LMCache allocated.
NORM_DTYPES = tuple(_wire.NORM_DTYPES)
AUTO_NORMS = (
    "norm_dtype='auto' is not available in the LMCache serde: it lengthens a blob when a norm "
    "overflows float16, and LMCache needs every blob to be exactly its estimated size. Use "
    "'float16' (TQ01 v1, the reference reads it; an overflowing norm fails the store, which "
    "LMCache treats as a miss) or 'float32' (TQ01 v2, never overflows)."
)

# ----------------------------------------------------------------------------- checkers


def _type_error(name: str, what: str, value: object) -> TypeError:
    return TypeError(f"serde option `{name}` must be {what}, got {type(value).__name__} {value!r}.")


def _int_in(lo: int, hi: int, why: str = "") -> Callable[[str, object], int]:
    def check(name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(name, "an int", value)
        if not lo <= value <= hi:
            raise ValueError(f"serde option `{name}` must be in {lo}..{hi}, got {value}" + (f": {why}" if why else "."))
        return value

    return check


def _choice(*choices: str, why: str = "") -> Callable[[str, object], str]:
    def check(name: str, value: object) -> str:
        if not isinstance(value, str):
            raise _type_error(name, "a string", value)
        if value not in choices:
            raise ValueError(f"serde option `{name}` must be one of {choices}, got {value!r}.{why}")
        return value

    return check


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, "a bool", value)
    return value


def _field_check(f: dataclasses.Field) -> Callable[[str, object], object]:
    """The bridge's check of an :class:`tq_jax.Options` field, from its type and metadata.

    Bridge errors are TypeError (wrong type) or ValueError (outside the field's values),
    prefixed ``serde option``; a field without a default (``key_bits``, ``value_bits``)
    also takes None: ``bits`` fills it.
    """
    kind, m = _options.field_type(f), f.metadata
    values, off = m.get("values"), m.get("off")
    why = f": {m['why']}" if m.get("why") else "."
    optional = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING

    def check(name: str, value: object):
        if value is None and optional:
            return None
        if kind is bool:
            return _flag(name, value)
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise _type_error(name, "an int", value)
            if values is not None and value not in values and not (off is not None and value == off):
                raise ValueError(f"serde option `{name}` must be in {_options.describe_values(values)}, got {value}{why}")
            return value
        if kind is str:
            if not isinstance(value, str):
                raise _type_error(name, "a string", value)
            if values is not None and value not in values:
                raise ValueError(f"serde option `{name}` must be one of {tuple(values)}, got {value!r}{why}")
            return value
        return _options.check_field(f, value, name)

    return check


def _bits(name: str, value: object) -> int:
    """The ``bits`` shorthand (both groups' bits)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an int", value)
    if value not in _codebook.BITS_RANGE:
        raise ValueError(
            f"serde option `{name}` must be in {_options.describe_values(_codebook.BITS_RANGE)}, got {value}: "
            f"bits sets the codebook size 2**bits ({', '.join(map(str, _wire.READ_BITS_V1))} stay TQ01 "
            f"version 1, which the reference plugin reads)."
        )
    return value


def _norm_dtype(name: str, value: object) -> str:
    if value == "auto":
        raise ValueError(AUTO_NORMS)
    return _choice(*NORM_DTYPES)(name, value)


def _preset(name: str, value: object):
    if value is None:
        return None
    return _choice(*sorted(PRESETS), why=" Presets are documented in docs/codec.md.")(name, value)


def _format(name: str, value: object):
    if value is None:
        return None
    return _choice(*FORMATS, why=(" 'v2' (the default) carries a CRC32 and the key binding; 'v1' is the reference "
                                  "plugin's format, without them."))(name, value)


def _checksum(name: str, value: object):
    return None if value is None else _flag(name, value)


def _device(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    resolve_device(value)  # fails now, at factory time, if the platform is missing
    return value


def _use_qjl(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, "a bool", value)
    if value:
        raise ValueError(
            "serde option `use_qjl` = true is not supported: tq_jax decodes QJL blobs but does not "
            "write them, because the QJL residual hurts softmax attention and costs m extra bytes "
            "per vector. Remove `use_qjl` (or set it to false)."
        )
    return value


class EncryptConfig(NamedTuple):
    """The checked ``encrypt`` block: how :mod:`~tq_jax.bridge._src.seal` gets its keys."""

    key_provider: str  # "hkdf": a key per cache_salt derived from each master key
    master_key_paths: tuple[str, ...]  # files holding master keys, newest first: seal with [0], open with any
    aes_bits: int  # 128 or 256
    accept_tqs1: bool = True  # open values in the TQS1 frame (random GCM nonces under the tenant key)


ENCRYPT_KEYS = ("key_provider", "master_key_path", "master_key_paths", "aes_bits", "accept_tqs1")
KEY_PROVIDERS = ("hkdf",)
AES_BITS = (128, 256)
MAX_MASTER_KEYS = 16  # a value under the k-th key costs k tag checks to open
BAD_ENCRYPT = (
    "serde option `encrypt` must be an object like {{\"key_provider\": \"hkdf\", "
    "\"master_key_paths\": [\"/etc/lmcache/master-2.key\", \"/etc/lmcache/master-1.key\"], "
    "\"aes_bits\": 256}} (or one \"master_key_path\"): {why}"
)


def _key_paths(value: Mapping) -> tuple[str, ...]:
    """``master_key_paths`` (newest first) or the single ``master_key_path``: exactly one."""
    one, many = value.get("master_key_path"), value.get("master_key_paths")
    if one is not None and many is not None:
        raise ValueError(BAD_ENCRYPT.format(why="give `master_key_path` or `master_key_paths`, not both (list the current key first)."))
    if many is None:
        if not isinstance(one, str) or not one:
            raise ValueError(BAD_ENCRYPT.format(why=f"`master_key_path` must name the master key's file, got {one!r}."))
        return (one,)
    if isinstance(many, str) or not isinstance(many, list | tuple) or not many:
        raise ValueError(BAD_ENCRYPT.format(why=f"`master_key_paths` must be a non-empty list of files, newest first, got {many!r}."))
    if len(many) > MAX_MASTER_KEYS:
        raise ValueError(BAD_ENCRYPT.format(why=f"`master_key_paths` lists {len(many)} files, more than {MAX_MASTER_KEYS}: drop the keys no stored value uses any more."))
    for p in many:
        if not isinstance(p, str) or not p:
            raise ValueError(BAD_ENCRYPT.format(why=f"every entry of `master_key_paths` must name a file, got {p!r}."))
    if len(set(many)) != len(many):
        raise ValueError(BAD_ENCRYPT.format(why=f"`master_key_paths` names a file twice: {list(many)}."))
    return tuple(many)


def _encrypt(name: str, value: object) -> EncryptConfig | None:
    """The ``encrypt`` block: None (no encryption) or a dict of :data:`ENCRYPT_KEYS`."""
    if value is None or isinstance(value, EncryptConfig):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(BAD_ENCRYPT.format(why=f"got {type(value).__name__}."))
    unknown = sorted(set(value) - set(ENCRYPT_KEYS))
    if unknown:
        raise ValueError(BAD_ENCRYPT.format(why=f"unknown key(s) {', '.join(map(repr, unknown))}; valid: {', '.join(ENCRYPT_KEYS)}."))
    provider = _choice(*KEY_PROVIDERS, why=" 'hkdf' derives a key per cache_salt from one master key.")(
        f"{name}.key_provider", value.get("key_provider", "hkdf")
    )
    paths = _key_paths(value)
    bits = value.get("aes_bits", 256)
    if isinstance(bits, bool) or bits not in AES_BITS:
        raise ValueError(BAD_ENCRYPT.format(why=f"`aes_bits` must be one of {AES_BITS}, got {bits!r}."))
    accept = value.get("accept_tqs1", True)
    if not isinstance(accept, bool):
        raise ValueError(BAD_ENCRYPT.format(why=f"`accept_tqs1` must be true or false, got {accept!r}."))
    return EncryptConfig(provider, paths, bits, accept)


# ----------------------------------------------------------------------------- the option table


class Option(NamedTuple):
    """One row of the serde option table."""

    name: str
    default: Any
    check: Callable[[str, object], object]  # validates and canonicalises; raises Type/ValueError
    help: str
    version: int = 1  # the TQ01 version that can express the option


# Rows that are not tq_jax.Options fields: the layout, the serde's runtime, the
# reference plugin's keys, and shorthands for bundles of fields. The reference's keys
# come first in its order (head_dim, bits, seed, max_workers, ...).
_BRIDGE_FIRST = (
    Option("head_dim", 128, _int_in(2, _wire.MAX_DENSE_DIM), "vector length; the KV hidden axis is split into heads of this size (MLA: the latent width, e.g. 576)"),
    Option("bits", 4, _bits, f"bits per coordinate of keys and values, 1..8 ({', '.join(map(str, _wire.READ_BITS_V1))} stay TQ01 v1)"),
)
_BRIDGE_V1 = (
    Option("max_workers", 1, _int_in(1, MAX_WORKERS), "threads that (de)serialize a batch's chunks in parallel"),
    Option("device", "cpu", _device, "where the codec runs: cpu, gpu, tpu or auto, optionally :index"),
    # Accepted so that configs written for the reference plugin work unchanged.
    Option("use_qjl", False, _use_qjl, "reference-plugin option; only false is supported"),
    Option("qjl_sketch_size", 64, _int_in(1, _wire.MAX_QJL_SKETCH), "reference-plugin option; ignored while use_qjl is false"),
    # The engine's chunk layout (tq_jax's own; the reference treats every vector alike).
    Option("kv_layout", "auto", _choice(*KV_LAYOUTS, why=" docs/bridge.md's 'Engine layouts' says which engine uses which."),
           "how a chunk holds keys and values: auto, split ([2, L, T, H*D]), fused ([L, T, H*2*D], K then V per head: "
           "vLLM's GPU backends), vllm-cpu ([L, T, H*2*D] as vLLM's CPU backend fills it), latent ([L, T, D], MLA)"),
    Option("block_size", 128, _int_in(2, 1 << 16), "vLLM's --block-size, read by kv_layout vllm-cpu (vLLM's CPU default: 128)"),
)
_BRIDGE_LAST = (
    Option("preset", None, _preset, f"a named bundle of the v2 options: {', '.join(sorted(PRESETS))}; explicit keys "
           f"override it; with no format option at all, {DEFAULT_PRESET}", version=2),
    Option("format", None, _format, "the TQ01 version written: v2 (the default: checksum on unless set false) or v1, the "
           "reference plugin's format, which has no checksum (asked for by name only)"),
    Option("encrypt", None, _encrypt, "seal every value with AES-GCM under a key of its own (per tenant and value): "
           "{key_provider: hkdf, master_key_paths: [newest, ...] or master_key_path, aes_bits: 128|256, accept_tqs1: true}"),
    Option("warmup", True, _flag, "compile the codec's programs when the serde is built, so that the first L2 hit "
           "after a start is as fast as the next ones"),
)
# Where the bridge narrows an Options field: blob sizes must be known from the layout
# alone (no norm_dtype "auto"), and LMCache configs give seeds in int32's range.
_BRIDGE_OVERRIDES = {
    "seed": dict(check=_int_in(-(2**31), 2**31 - 1, "TQ01 stores the seed as int32.")),
    "norm_dtype": dict(default="float16", check=_norm_dtype, help="float16 (v1) or float32 (v2, never overflows)"),
    # None: on unless `format` is "v1" (parse_options); the serializer class keeps False.
    "checksum": dict(default=None, check=_checksum, help="CRC32 over each blob, and the key binding; on by default "
                     "(off only with format v1)"),
}
BRIDGE_ONLY = tuple(o.name for o in _BRIDGE_FIRST + _BRIDGE_V1 + _BRIDGE_LAST)
"""Names of the rows that are not :class:`tq_jax.Options` fields."""
FORMAT_KEYS = ("bits", "preset", "format", *(f.name for f in dataclasses.fields(_options.Options) if f.name != "seed"))
"""The keys that choose what is written; a serde dict with none of them writes :data:`DEFAULT_PRESET`."""


def _field_row(f: dataclasses.Field) -> Option:
    default = None if f.default is dataclasses.MISSING else f.default  # None: from `bits`
    row = Option(f.name, default, _field_check(f), f.metadata["help"], f.metadata["version"])
    return row._replace(**_BRIDGE_OVERRIDES.get(f.name, {}))


def option_table(options_cls: type = _options.Options) -> tuple[Option, ...]:
    """The serde option table: one row per field of ``options_cls`` (its metadata gives
    help, TQ01 version and allowed values) plus the bridge-only rows, version-1 rows
    first.

    Args:
        options_cls: :class:`tq_jax.Options`, or a dataclass whose fields carry the same
            metadata (tests pass one with an extra field).
    """
    rows = [_field_row(f) for f in dataclasses.fields(options_cls)]
    return (
        *_BRIDGE_FIRST,
        *(o for o in rows if o.version == 1),
        *_BRIDGE_V1,
        *(o for o in rows if o.version != 1),
        *_BRIDGE_LAST,
    )


def _codec_options(self) -> dict:
    """The :class:`tq_jax.Options` fields beyond ``bits`` and ``seed`` (None: from ``bits``)."""
    return {n: getattr(self, n) for n in self._CODEC_NAMES if getattr(self, n) is not None}


def serde_options_class(table: tuple[Option, ...], options_cls: type = _options.Options) -> type:
    """A frozen dataclass with one field per row of ``table`` (its default), in table order."""
    codec = tuple(f.name for f in dataclasses.fields(options_cls) if f.name != "seed")
    cls = dataclasses.make_dataclass(
        "SerdeOptions",
        [(o.name, Any, dataclasses.field(default=o.default)) for o in table],
        frozen=True,
        namespace={
            "__doc__": "Validated serde options: one field per row of the option table.",
            "_CODEC_NAMES": codec,
            "codec_options": _codec_options,
        },
    )
    cls.__module__ = __name__
    return cls


OPTIONS: tuple[Option, ...] = option_table()
_BY_NAME = {o.name: o for o in OPTIONS}
SerdeOptions = serde_options_class(OPTIONS)
SerdeOptions.__doc__ = """Validated serde options (every row of :data:`OPTIONS`), generated from the table."""


def check_values(kwargs: Mapping[str, object], table: tuple[Option, ...] = OPTIONS) -> dict:
    """Each value of ``kwargs`` checked by its row of ``table``.

    Raises:
        ValueError: an unknown key (the message lists the valid ones, the TQ01 version 2
            options separately) or a value out of range.
        TypeError: a value of the wrong type.
    """
    by_name = {o.name: o for o in table}
    unknown = sorted(k for k in kwargs if k not in by_name)
    if unknown:
        valid = ", ".join(o.name for o in table if o.version == 1)
        v2 = ", ".join(o.name for o in table if o.version == 2)
        raise ValueError(
            f"unknown tq_jax serde option(s) {', '.join(map(repr, unknown))}. Valid options: "
            f"{valid}; TQ01 version 2 options: {v2}. Check the spelling in the L2 adapter's "
            f"\"serde\" dict."
        )
    return {key: by_name[key].check(key, value) for key, value in kwargs.items()}


def codec_options_for(*, head_dim: int, bits: int, seed: int, **options) -> tq_jax.Options:
    """The :class:`tq_jax.Options` of a serializer built with these keyword arguments.

    ``head_dim``, ``bits``, ``seed`` and each of ``options`` (an Options field) are
    checked by their row of :data:`OPTIONS`; Options fields not given take the row's
    default (``norm_dtype`` "float16": the bridge's blob sizes follow from the layout).

    Raises:
        TypeError: an unknown keyword (the message lists the valid ones) or a value of
            the wrong type.
        ValueError: a value out of range or a combination Options refuses.
    """
    codec = SerdeOptions._CODEC_NAMES
    unknown = sorted(k for k in options if k not in codec)
    if unknown:
        raise TypeError(
            f"TQJaxSerializer got unknown keyword argument(s) {', '.join(map(repr, unknown))}; it takes "
            f"head_dim, bits, seed, device and the tq_jax.Options fields {', '.join(codec)}."
        )
    check_values({"head_dim": head_dim, "bits": bits, "seed": seed, **options})
    given = {o.name: o.default for o in OPTIONS if o.name in codec and o.default is not None}
    given.update(options)
    return tq_jax.encode_options(bits=bits, seed=seed, **{k: v for k, v in given.items() if v is not None})


def parse_options(kwargs: Mapping[str, object]) -> SerdeOptions:
    """Validates an LMCache serde dict (without ``"type"``) against :data:`OPTIONS`.

    What is written (safe by default):

    * no key of :data:`FORMAT_KEYS`: :data:`DEFAULT_PRESET`, checksummed and key-bound;
    * ``"format": "v1"``, or a preset of version-1 settings (``compat-4bit``): TQ01
      version 1, the reference plugin's format, with no checksum;
    * anything else: version 2 with ``checksum`` on; ``"checksum": false`` with settings
      version 1 can express writes version 1 (and ``format`` says so).

    The result's ``format`` and ``checksum`` are always resolved (never None).

    Raises:
        ValueError: an unknown key (the message lists the valid ones), a value out of
            range, a missing device platform, a combination :class:`tq_jax.Options`
            refuses (e.g. ``norm_bits`` with ``norm_dtype="float32"``), or ``format``
            "v1" with settings version 1 cannot express.
        TypeError: a value of the wrong type.

    Examples:
        >>> o = parse_options({"head_dim": 64})
        >>> o.preset, o.format, o.checksum
        ('turbo-4', 'v2', True)
        >>> o = parse_options({"bits": 3})
        >>> o.bits, o.format, o.checksum
        (3, 'v2', True)
        >>> parse_options({"bits": 3, "format": "v1"}).checksum
        False
    """
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"serde options must be a dict, got {type(kwargs).__name__}.")
    values = check_values(kwargs)
    if not any(k in values for k in FORMAT_KEYS):
        values["preset"] = DEFAULT_PRESET
    if values.get("preset"):  # a preset fills what the config does not say explicitly
        for key, value in PRESETS[values["preset"]].items():
            values.setdefault(key, value)
        if values.get("format") is None and _is_v1(values):
            values["format"] = "v1"  # a preset of the reference's settings names its format
    fmt = values["format"] = values.get("format") or "v2"
    if fmt == "v1" and (values.get("checksum") or not _is_v1(values)):
        raise ValueError(BAD_V1.format(what=_v2_settings(SerdeOptions(**values))))
    if values.get("checksum") is None:
        values["checksum"] = fmt == "v2"
    if not values["checksum"] and _is_v1(values):
        values["format"] = "v1"  # `checksum: false` with the reference's settings: what is written is v1
    o = SerdeOptions(**values)
    tq_jax.encode_options(bits=o.bits, seed=o.seed, **o.codec_options())  # the combination is valid
    return o


def _is_v1(values: Mapping) -> bool:
    """Whether the codec settings in ``values`` (checksum aside) are version 1's."""
    codec = {k: v for k, v in values.items() if k in SerdeOptions._CODEC_NAMES and v is not None and k != "checksum"}
    return tq_jax.encode_options(bits=values.get("bits", 4), **codec).v1_expressible


def _v2_settings(o) -> str:
    """The options of ``o`` that only version 2 can express, as the config names them."""
    base = SerdeOptions()
    names = [n for n in SerdeOptions._CODEC_NAMES if getattr(o, n) not in (None, False, getattr(base, n))]
    v1_bits = _wire.READ_BITS_V1
    names = [n for n in names if not (n in ("key_bits", "value_bits") and getattr(o, n) == o.bits and o.bits in v1_bits)]
    if o.bits not in v1_bits:
        names.insert(0, "bits")
    said = ", ".join(f"{n}={getattr(o, n)!r}" for n in names) or "these settings"
    return f"preset {o.preset!r} ({said})" if o.preset else said
