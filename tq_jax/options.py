"""Encoding options: one validated, frozen description of how a tensor becomes a blob.

:class:`Options` carries what a writer chooses (bits per K/V group, raw edge layers,
rotation, norm dtype, norm correction, checksum). From options plus a tensor's
shape and dtype alone it derives the TQ01 header — and so the exact blob size, which
the LMCache bridge reports before it has seen any data. The writer picks the lowest
format version that can say it: version 1 (the reference's) when the settings are the
reference's, version 2 otherwise.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tq_jax import wire as _wire

__all__ = ["Options", "NORM_DTYPES", "ROTATIONS", "PRESETS"]

NORM_DTYPES = ("auto", "float16", "float32")
ROTATIONS = tuple(_wire.ROTATION_CODES)
_BITS_WHY = "it sets the codebook size 2**bits."
_NORM_BITS_WHY = "0 keeps float norms; 2..8 store each norm as a code on a log-uniform grid of 2**norm_bits - 1 levels."


def _int(value, name: str, lo: int, hi: int, why: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"`{name}` must be an int in {lo}..{hi}, got {value!r}: {why}")
    return int(value)


def _bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be a bool, got {value!r}.")
    return bool(value)


@dataclasses.dataclass(frozen=True)
class Options:
    """How to encode: every field a plain hashable scalar.

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
            becomes a ``norm_bits``-bit code on a log-uniform grid per layer (v2). At
            head_dim 64 a float16 norm costs 0.25 bit per element, a 6-bit code 0.094.
    """

    key_bits: int
    value_bits: int
    seed: int = 42
    skip_first_layers: int = 0
    skip_last_layers: int = 0
    rotation: str = "haar"
    norm_dtype: str = "auto"
    norm_correction: bool = False
    checksum: bool = False
    norm_bits: int = 0

    def __post_init__(self):
        object.__setattr__(self, "key_bits", _int(self.key_bits, "key_bits", 1, 8, _BITS_WHY))
        object.__setattr__(self, "value_bits", _int(self.value_bits, "value_bits", 1, 8, _BITS_WHY))
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise ValueError(f"`seed` must be an int, got {self.seed!r}.")
        object.__setattr__(self, "seed", int(self.seed))
        for name in ("skip_first_layers", "skip_last_layers"):
            object.__setattr__(
                self, name, _int(getattr(self, name), name, 0, _wire.MAX_SKIP_LAYERS, "a count of layers kept raw.")
            )
        if self.rotation not in ROTATIONS:
            raise ValueError(
                f"`rotation` must be one of {ROTATIONS}, got {self.rotation!r}: 'haar' is the reference's "
                f"dense rotation, 'hadamard' the fast structured one (TQ01 v2)."
            )
        if self.norm_dtype not in NORM_DTYPES:
            raise ValueError(f"`norm_dtype` must be one of {NORM_DTYPES}, got {self.norm_dtype!r}.")
        object.__setattr__(self, "norm_correction", _bool(self.norm_correction, "norm_correction"))
        object.__setattr__(self, "checksum", _bool(self.checksum, "checksum"))
        if self.norm_bits != 0:
            object.__setattr__(self, "norm_bits", _int(self.norm_bits, "norm_bits", 2, 8, _NORM_BITS_WHY))
        if self.norm_bits and self.norm_dtype == "float32":
            raise ValueError(
                "`norm_bits` and norm_dtype='float32' both say how to store norms: log codes (norm_bits 2..8) "
                "or floats (norm_bits=0 with norm_dtype). Drop one of them."
            )

    @classmethod
    def make(cls, bits=None, *, key_bits=None, value_bits=None, **kwargs) -> "Options":
        """Options from ``bits`` (both groups) and/or ``key_bits``/``value_bits``."""
        if bits is not None and (key_bits is None or value_bits is None):  # named as the caller named it
            bits = _int(bits, "bits", 1, 8, _BITS_WHY)
        kb = bits if key_bits is None else key_bits
        vb = bits if value_bits is None else value_bits
        if kb is None or vb is None:
            raise ValueError(
                "give `bits` (one width for everything) or both `key_bits` and `value_bits`."
            )
        return cls(kb, vb, **kwargs)

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
        )

    def header(self, shape, dtype, *, norm_dtype: str | None = None) -> _wire.Header:
        """The header for a tensor of ``shape``/``dtype``; ``norm_dtype`` resolves "auto".

        Raises:
            ValueError: the shape cannot carry these options (e.g. raw layers on a
                tensor that is not ``[groups, layers, ..., head_dim]``).
        """
        shape = tuple(int(s) for s in shape)
        dtype = _wire._dtype_name(dtype)
        nd = norm_dtype or ("float16" if self.norm_dtype == "auto" else self.norm_dtype)
        if self.norm_bits:
            nd = "float16"  # no float norms are written: the NORMS_F32 flag stays clear
        dense = _wire.dense_dim(shape[-1], self.rotation) if shape else 0
        if dense > _wire.MAX_DENSE_DIM:
            raise ValueError(
                f"head_dim {shape[-1]} with rotation={self.rotation!r} needs a dense {dense}x{dense} rotation, "
                f"but TQ01 readers refuse more than MAX_DENSE_DIM={_wire.MAX_DENSE_DIM} (they build it from the "
                f"header alone). Use rotation='hadamard' (its dense factor is the odd part of head_dim) or "
                f"split the vectors into heads of at most {_wire.MAX_DENSE_DIM}."
            )
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
            return _wire.Header(self.key_bits, _wire._seed32(self.seed), shape, dtype)
        return _wire.Header(
            bits=self.key_bits,
            seed=_wire._seed32(self.seed),
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
        )

    def serialized_size(self, shape, dtype) -> int:
        """Exact blob length for ``shape``/``dtype`` (``norm_dtype="auto"``: the float16 case)."""
        return _wire.blob_nbytes(self.header(shape, dtype))

    def replace(self, **changes) -> "Options":
        return dataclasses.replace(self, **changes)


# Named presets for LMCache's [2, L, T, ...] KV chunks; quality measured in docs/quality.md.
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
    # Chosen on SmolLM2-135M (docs/quality-lm.md): keys get the extra bit, and norms are
    # 6-bit log codes (0.094 bit per element at head_dim 64 instead of float16's 0.25).
    # All-in <= 3.6 and <= 2.6 bits per element at head_dim 64 and 128.
    "turbo-3.5": dict(key_bits=4, value_bits=3, rotation="hadamard", norm_correction=True,
                      norm_bits=6, checksum=True),
    "turbo-2.5": dict(key_bits=3, value_bits=2, rotation="hadamard", norm_correction=True,
                      norm_bits=6, checksum=True),
}
