"""Encoding options: one validated, frozen description of how a tensor becomes a blob.

:class:`Options` carries what a writer chooses (bits per K/V group, raw edge layers,
rotation, norm dtype, norm correction, checksum). From options plus a tensor's
shape and dtype alone it derives the TQ01 header — and so the exact blob size, which
the LMCache bridge reports before it has seen any data. The writer picks the lowest
format version that can say it: version 1 (the reference's) when the settings are the
reference's, version 2 otherwise.

:class:`Options` is the one schema of these choices: each field's
``dataclasses.field(metadata=field_metadata(...))`` holds its help text, the TQ01
version a non-default value needs and its allowed values. Validation here, the LMCache
bridge's option table (:func:`tq_jax.bridge._src.registry.option_table`) and the
``tq-jax compress`` flags (:mod:`tq_jax._src.flags`) are generated from
``dataclasses.fields(Options)``: a new option is a new field (plus, when blobs must
record it, its header field in :mod:`tq_jax._src.wire` and its use in the codec).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import NamedTuple

import numpy as np

from tq_jax._src import codebook as _codebook
from tq_jax._src import rotation as _rotation
from tq_jax._src import wire as _wire

__all__ = ["Options", "PRESETS", "encode_options", "FieldSpec", "field_specs", "check_field", "describe_values",
           "field_metadata", "field_type"]

_BITS_WHY = "it sets the codebook size 2**bits."
_NORM_BITS_WHY = "0 keeps float norms; 2..8 store each norm as a code on a log-uniform grid of 2**norm_bits - 1 levels."


def field_metadata(help: str, version: int, *, values=None, off=None, why: str = "") -> dict:
    """A field's schema: what it means (``help``), the TQ01 ``version`` that a non-default
    value needs, its allowed ``values`` (a ``range`` of ints or a tuple of choices; None:
    any value of the field's type), an ``off`` value accepted outside ``values`` (0 for
    "feature off"), and ``why`` the constraint exists (quoted in errors)."""
    return {"help": help, "version": version, "values": values, "off": off, "why": why}


def describe_values(values) -> str:
    """``range(1, 9)`` → ``"1..8"``; a tuple of choices → its repr."""
    if isinstance(values, range):
        return f"{values.start}..{values.stop - 1}"
    return repr(tuple(values))


_TYPES = {"int": int, "bool": bool, "str": str}


def field_type(f: dataclasses.Field) -> type:
    """A field's Python type (``int``, ``bool`` or ``str``), annotations as strings or types."""
    return _TYPES.get(f.type, f.type) if isinstance(f.type, str) else f.type


def check_field(f: dataclasses.Field, value, name: str | None = None):
    """``value`` validated and canonicalised against field ``f``'s type and metadata.

    Args:
        f: a field of :class:`Options` (or of a dataclass built the same way).
        value: the value given.
        name: the name to quote in an error (default ``f.name``; ``Options.make``
            says ``bits`` when the caller said ``bits``).

    Raises:
        ValueError: the value has the wrong type or is outside the field's values; the
            message names the field, the value and what is allowed.
    """
    name = name or f.name
    m = f.metadata
    kind = field_type(f)
    why = f": {m['why']}" if m.get("why") else "."
    if kind is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"`{name}` must be a bool, got {value!r}.")
        return bool(value)
    if kind is int:
        if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
            if m.get("values") is None:
                raise ValueError(f"`{name}` must be an int, got {value!r}.")
            raise ValueError(f"`{name}` must be an int in {describe_values(m['values'])}, got {value!r}{why}")
        value = int(value)
        if m.get("off") is not None and value == m["off"]:
            return value
        if m.get("values") is not None and value not in m["values"]:
            raise ValueError(f"`{name}` must be an int in {describe_values(m['values'])}, got {value!r}{why}")
        return value
    if m.get("values") is not None and value not in m["values"]:
        raise ValueError(f"`{name}` must be one of {describe_values(m['values'])}, got {value!r}{why}")
    return value


class FieldSpec(NamedTuple):
    """One field of an options dataclass as every generator sees it (:func:`field_specs`).

    The ``tq-jax compress`` flags (:mod:`tq_jax._src.flags`) are built from these, and so can
    any other front end (the LMCache bridge's option table reads the same fields).
    """

    name: str
    kind: type  # int, bool or str
    default: object  # None when the field has no default (``required``)
    required: bool
    help: str
    version: int  # the TQ01 version a non-default value needs
    values: object  # a range of ints, a tuple of choices, or None (any value of ``kind``)
    off: object  # a value accepted outside ``values`` that turns the feature off, or None
    why: str

    def choices(self, most: int = 16) -> tuple | None:
        """The allowed values as a tuple (``off`` first), when there are at most ``most``."""
        if self.values is None or len(self.values) > most:
            return None
        return tuple(self.values) if self.off is None else (self.off, *self.values)


def field_specs(options_cls=None) -> tuple[FieldSpec, ...]:
    """The :class:`FieldSpec` of every field of ``options_cls`` (default :class:`Options`),
    from ``dataclasses.fields`` and each field's :func:`field_metadata`."""
    out = []
    for f in dataclasses.fields(Options if options_cls is None else options_cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        m = f.metadata
        out.append(FieldSpec(f.name, field_type(f), None if required else f.default, required, m["help"],
                             m["version"], m.get("values"), m.get("off"), m.get("why", "")))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Options:
    """How to encode: every field a plain hashable scalar.

    Each field is self-describing: ``dataclasses.fields(Options)`` gives its name, type,
    default and ``metadata`` — ``help`` (one line), ``version`` (the TQ01 version a
    non-default value needs), ``values`` (a ``range`` or a tuple of choices; None: any
    value of the type), ``off`` (a value that turns the feature off, accepted outside
    ``values``) and ``why`` (quoted in errors). Validation (:func:`check_field`, once,
    in ``__post_init__``), the LMCache bridge's option table and the ``tq-jax compress``
    flags are all generated from it, so a new option is one field here.

    Attributes:
        key_bits: bits per coordinate of group 0 (keys in LMCache's ``[2, L, ...]``), 1..8.
        value_bits: bits of group 1 (values), 1..8.
        seed: rotation seed (low 32 bits are stored).
        skip_first_layers: leading layers (axis 1 of ``[2, L, ...]``) stored as their
            exact original bytes.
        skip_last_layers: trailing layers stored raw.
        rotation: ``"haar"`` (the reference's) or ``"hadamard"`` (fast, structured).
        norm_dtype: ``"float16"`` (v1's; a norm above 65504 is an error), ``"float32"``,
            or ``"auto"``: float16 when every norm fits, else float32 — nothing lost,
            but the blob is then version 2 and 2 bytes per vector longer.
        norm_correction: decoders rescale each centroid vector to unit length (v2).
        checksum: append a CRC32 over the whole blob, verified on load (v2).
        norm_bits: 0 (norms stored as ``norm_dtype`` floats) or 2..8: each vector's norm
            becomes a ``norm_bits``-bit code on a log-uniform grid per (K/V, layer) (v2),
            ``norm_bits`` bits per vector instead of 16 or 32.
        trellis: code each vector's rotated coordinates as one path of an 8-state
            trellis (v2; key_bits and value_bits 2..7): the same bytes, less error, a
            slower encoder (a Viterbi search per vector). See docs/TQ01-v2.md.
    """

    key_bits: int = dataclasses.field(metadata=field_metadata(
        "bits per coordinate of group 0 (keys) of KV tensors [2, layers, ..., head_dim]; default: bits",
        2, values=_codebook.BITS_RANGE, why=_BITS_WHY))
    value_bits: int = dataclasses.field(metadata=field_metadata(
        "bits per coordinate of group 1 (values); default: bits", 2, values=_codebook.BITS_RANGE, why=_BITS_WHY))
    seed: int = dataclasses.field(default=42, metadata=field_metadata(
        "rotation seed; every blob records its low 32 bits (as int32)", 1))
    skip_first_layers: int = dataclasses.field(default=0, metadata=field_metadata(
        "store the first N layers (axis 1) as their exact bytes", 2,
        values=range(0, _wire.MAX_SKIP_LAYERS + 1), why="a count of layers kept raw."))
    skip_last_layers: int = dataclasses.field(default=0, metadata=field_metadata(
        "store the last N layers as their exact bytes", 2,
        values=range(0, _wire.MAX_SKIP_LAYERS + 1), why="a count of layers kept raw."))
    rotation: str = dataclasses.field(default="haar", metadata=field_metadata(
        "haar (the reference's dense rotation) or hadamard (fast, structured)", 2, values=_rotation.ROTATIONS,
        why="'haar' is the reference's dense rotation, 'hadamard' the fast structured one (TQ01 v2)."))
    norm_dtype: str = dataclasses.field(default="auto", metadata=field_metadata(
        "float16 (v1), float32 (never overflows), or auto: float16 unless a norm overflows it, then float32",
        2, values=("auto", *_wire.NORM_DTYPES)))
    norm_correction: bool = dataclasses.field(default=False, metadata=field_metadata(
        "decoders rescale centroid vectors to unit length", 2))
    checksum: bool = dataclasses.field(default=False, metadata=field_metadata(
        "append a CRC32 to every blob, verified on load", 2))
    norm_bits: int = dataclasses.field(default=0, metadata=field_metadata(
        "0: norms stored as floats; 2..8: each norm a code of that many bits on a log-uniform grid "
        "per (K/V, layer)", 2, values=_wire.NORM_BITS, off=0, why=_NORM_BITS_WHY))
    trellis: bool = dataclasses.field(default=False, metadata=field_metadata(
        "trellis-coded indices: the same bytes, less error, a slower encoder (bits 2..7)", 2))

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_field(f, getattr(self, f.name)))
        if self.norm_bits and self.norm_dtype == "float32":
            raise ValueError(
                "`norm_bits` and norm_dtype='float32' both say how to store norms: log codes (norm_bits 2..8) "
                "or floats (norm_bits=0 with norm_dtype). Drop one of them."
            )
        if self.trellis and not {self.key_bits, self.value_bits} <= set(_wire.TRELLIS_BITS):
            lo, hi = _wire.TRELLIS_BITS.start, _wire.TRELLIS_BITS.stop - 1
            raise ValueError(
                f"trellis=True takes key_bits and value_bits in {lo}..{hi}, got key_bits={self.key_bits}, "
                f"value_bits={self.value_bits}: a trellis codes over a codebook of bits + 1 bits, and "
                f"codebooks stop at 8. Lower the bits, or set trellis=False."
            )

    @classmethod
    def make(cls, *args, **kwargs):
        """Removed: raises, naming its replacement (:func:`encode_options`)."""
        raise AttributeError(
            "Options.make was removed; settings have one front door: tq_jax.encode_options(bits=4, ...) "
            "(or options='turbo-4' with keyword overrides), or Options(key_bits=4, value_bits=4, ...)."
        )

    @property
    def kv_layout(self) -> bool:
        """Whether the tensor is split into K/V groups and layers (per-group bits, raw layers)."""
        return self.key_bits != self.value_bits or self.skip_first_layers > 0 or self.skip_last_layers > 0

    @property
    def v1_expressible(self) -> bool:
        """True when version 1 (the reference's format) can say these settings."""
        return (
            not self.kv_layout
            and self.key_bits in _wire.READ_BITS_V1
            and self.rotation == "haar"
            and self.norm_dtype in ("auto", "float16")
            and not self.norm_correction
            and not self.checksum
            and not self.norm_bits
            and not self.trellis
        )

    def layout(self, shape, dtype, *, norm_dtype: str | None = None) -> _wire.Layout:
        """The :class:`~tq_jax._src.wire.Layout` of a tensor of ``shape``/``dtype`` under these
        options (its header, the header's bytes, the blob's length), in one call to
        :func:`tq_jax._src.wire.layout`; ``norm_dtype`` resolves "auto".

        Raises:
            ValueError: the shape cannot carry these options (e.g. raw layers on a
                tensor that is not ``[groups, layers, ..., head_dim]``), or the header
                cannot be written (:func:`tq_jax._src.wire.layout`: dtype, dense rotation size).
        """
        shape = tuple(int(s) for s in shape)
        nd = norm_dtype or ("float16" if self.norm_dtype == "auto" else self.norm_dtype)
        if self.norm_bits:
            nd = "float16"  # no float norms are written: the NORMS_F32 flag stays clear
        if self.kv_layout:
            if len(shape) < 3 or shape[0] not in (1, 2):
                raise ValueError(
                    f"key_bits != value_bits and raw layers need a KV tensor [2 (K, V) or 1, layers, ..., "
                    f"head_dim], got shape {shape}: use one `bits` for other tensors."
                )
            if self.skip_first_layers + self.skip_last_layers > shape[1]:
                raise ValueError(
                    f"skip_first_layers + skip_last_layers = {self.skip_first_layers + self.skip_last_layers} "
                    f"exceeds the tensor's {shape[1]} layers (axis 1 of {shape})."
                )
        if self.v1_expressible and nd == "float16":
            return _wire.layout(_wire.Header(self.key_bits, self.seed, shape, dtype))
        return _wire.layout(_wire.Header(
            bits=self.key_bits,
            seed=self.seed,
            shape=shape,
            dtype=dtype,
            version=_wire.VERSION_2,
            value_bits=self.value_bits,
            kv_layout=self.kv_layout,
            skip_first=self.skip_first_layers if self.kv_layout else 0,
            skip_last=self.skip_last_layers if self.kv_layout else 0,
            rotation=self.rotation,
            norm_dtype=nd,
            norm_correction=self.norm_correction,
            checksum=self.checksum,
            norm_bits=self.norm_bits,
            trellis=self.trellis,
        ))

    def header(self, shape, dtype, *, norm_dtype: str | None = None) -> _wire.Header:
        """The header for a tensor of ``shape``/``dtype`` (:meth:`layout`'s)."""
        return self.layout(shape, dtype, norm_dtype=norm_dtype).header

    def serialized_size(self, shape, dtype) -> int:
        """Exact blob length for ``shape``/``dtype`` (``norm_dtype="auto"``: the float16 case)."""
        return self.layout(shape, dtype).nbytes

    def codec_config(self, dim: int, group: int = 0):
        """The :class:`tq_jax.CodecConfig` of group ``group`` (0: keys, ``key_bits``;
        1: values, ``value_bits``) for vectors of length ``dim``: the codec settings of
        these options (seed, rotation, norm correction), one schema for both.

        Raises:
            ValueError: ``group`` is not 0 or 1, or ``dim`` is not a valid head_dim.
        """
        from tq_jax._src import codec as _codec  # jax: imported when a codec is asked for

        if group not in (0, 1):
            raise ValueError(f"`group` must be 0 (keys, key_bits) or 1 (values, value_bits), got {group!r}.")
        bits = self.key_bits if group == 0 else self.value_bits
        return _codec.CodecConfig(dim, bits, self.seed, self.rotation, self.norm_correction, self.trellis)

    def replace(self, **changes) -> "Options":
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in dataclasses.fields(Options)}


# Named presets for LMCache's [2, L, T, ...] KV chunks; quality measured in benchmarks/studies/quality.md.
PRESETS = {
    # The reference's format: readable by lmcache-turbo-quant-serde.
    "compat-4bit": dict(key_bits=4, value_bits=4, norm_dtype="float16"),
    # Keys carry outlier channels and drive softmax: more bits there, edges raw.
    "k4v3-edges": dict(key_bits=4, value_bits=3, skip_first_layers=2, skip_last_layers=2,
                       rotation="hadamard", norm_dtype="float32", norm_correction=True, checksum=True),
    "k4v2-edges": dict(key_bits=4, value_bits=2, skip_first_layers=2, skip_last_layers=2,
                       rotation="hadamard", norm_dtype="float32", norm_correction=True, checksum=True),
    "k8v4": dict(key_bits=8, value_bits=4, rotation="hadamard", norm_dtype="float32",
                 norm_correction=True, checksum=True),
    # Chosen on SmolLM2-135M (benchmarks/studies/quality-lm.md): keys get the extra bit, and norms are
    # 6-bit log codes (0.094 bit per element at head_dim 64 instead of float16's 0.25).
    # All-in <= 3.6 and <= 2.6 bits per element at head_dim 64 and 128.
    "turbo-3.5": dict(key_bits=4, value_bits=3, rotation="hadamard", norm_correction=True,
                      norm_bits=6, checksum=True),
    "turbo-2.5": dict(key_bits=3, value_bits=2, rotation="hadamard", norm_correction=True,
                      norm_bits=6, checksum=True),
    # 4/4's bytes with a value bit moved to the keys. Chosen on SmolLM2-135M in the
    # generation loop (benchmarks/studies/serving-smollm2.md): closer to a bf16 cache's perplexity and KL
    # than 4/4 or K6V2 at the same bytes; its passkey means over rotation seeds stay near
    # bf16's up to 1024 tokens, not at 2048. All-in 4.095 bits per element at head_dim 64
    # and 4.047 at 128 for 256-token chunks (docs/codec.md's table); in the cache it takes 4/4's
    # bytes (tests/test_kvcache_window.py).
    "turbo-4": dict(key_bits=5, value_bits=3, rotation="hadamard", norm_correction=True,
                    norm_bits=6, checksum=True),
    # turbo-4's bytes with trellis-coded indices (TQ01 v2 TRELLIS): less error where every
    # token is a code (a prefix loaded from L2, a long context), a slower encoder.
    "turbo-4t": dict(key_bits=5, value_bits=3, rotation="hadamard", norm_correction=True,
                     norm_bits=6, checksum=True, trellis=True),
}


# The words the settings front door takes besides the Options fields.
_DOOR_WORDS = ("bits", "options")


def _preset(name: str, word: str) -> dict:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"`{word}` names no preset: {name!r}.{hint} Presets: {', '.join(sorted(PRESETS))}; or pass "
                         f"a tq_jax.Options, or bits and the option keywords.")
    return dict(PRESETS[name])


def encode_options(options=None, bits=None, **fields) -> Options:
    """The one front door to the codec settings: what a caller said, as one validated :class:`Options`.

    In Python there is one way to give settings: ``options=`` (a preset name or an
    :class:`Options`) with keyword overrides (``bits=``, ``key_bits=`` ...) on top.
    :func:`tq_jax.dumps`, :func:`tq_jax.dump_into` and :func:`tq_jax.serialized_size`
    call this, :func:`tq_jax._src.kvcache.init` takes the same ``options``, and the
    ``tq-jax compress --preset`` flag and the LMCache serde's ``"preset"`` key expand
    a preset the same way (tests/test_settings_front_door.py checks that the bytes agree).

    Args:
        options: the starting values: None, a preset name of :data:`PRESETS`
            (``"turbo-4"``), or an :class:`Options`.
        bits: one width for both groups (keys and values); ``key_bits`` or
            ``value_bits`` given as well win for their group.
        **fields: :class:`Options` fields, each overriding the starting value.

    Returns:
        The validated :class:`Options`.

    Raises:
        ValueError: an unknown keyword (named, with the closest valid name and the
            presets), an unknown preset, ``options`` of another type, the removed
            ``preset=`` keyword (the message shows ``options=``), no bits for a group,
            or a value :class:`Options` refuses.

    Examples:
        >>> encode_options("turbo-4") == Options(**PRESETS["turbo-4"])
        True
        >>> encode_options("turbo-4", seed=7).seed, encode_options(bits=3).value_bits
        (7, 3)
    """
    if "preset" in fields:
        raise ValueError(
            f"`preset=` is not a Python keyword: write options={fields['preset']!r} (keywords such as bits= or "
            f"seed= override it). The CLI's --preset and the LMCache serde's \"preset\" key keep the word."
        )
    unknown = [k for k in fields if k not in _FIELDS]
    if unknown:
        valid = [*_DOOR_WORDS, *_FIELDS]
        name = unknown[0]
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        raise ValueError(
            f"unknown option `{name}`{f' (and {unknown[1:]})' if unknown[1:] else ''}.{hint} The options are "
            f"{', '.join(valid)}; the presets (options='...'): {', '.join(sorted(PRESETS))}."
        )
    if options is None:
        base = {}
    elif isinstance(options, str):
        base = _preset(options, "options")
    elif isinstance(options, Options):
        base = dataclasses.asdict(options)
    else:
        raise ValueError(
            f"`options` must be None, a preset name or a tq_jax.Options, got {type(options).__name__}: "
            f"e.g. options='turbo-4' (presets: {', '.join(sorted(PRESETS))}), "
            f"options=tq_jax.Options(key_bits=4, value_bits=4, ...), or the fields as keywords."
        )
    if bits is not None:  # named as the caller named it; key_bits/value_bits keywords win
        bits = check_field(_FIELDS["key_bits"], bits, "bits")
        base.update(key_bits=bits, value_bits=bits)
    base.update(fields)
    if "key_bits" not in base or "value_bits" not in base:
        raise ValueError(
            "give `bits` (one width for everything), both `key_bits` and `value_bits`, or a preset "
            f"(options='turbo-4'; presets: {', '.join(sorted(PRESETS))})."
        )
    return Options(**base)
