"""A resolved plan: one request (shape, dtype, :class:`~tq_jax.Options`), or one parsed
header, turned once into everything an executor needs to write or read a blob.

A :class:`Plan` holds the TQ01 header and its bytes, every quantized segment with its
:class:`~tq_jax._src.codec.CodecConfig`, its rows in the tensor and the byte offsets of its
index and norm sections, the raw edge layers with theirs, the exact blob size and,
when norms are ``"auto"``, the plan to fall back to if a norm overflows float16. It is
immutable and hashable, so compiled programs can be cached by it.

Both executors read only the plan: the host block driver (:mod:`tq_jax._src.blocks`, driven
by :mod:`tq_jax._src.blob`) and the device program (:mod:`tq_jax._src.program`). Nothing below
:mod:`tq_jax._src.blob` asks :class:`~tq_jax.Options` again; on load the parse becomes the
plan (:func:`for_parsed`: the header as the parser read it, not written again).

Row coordinates: a tensor of shape ``(..., d)`` is viewed as ``(rows, d)`` with
``rows = prod(shape[:-1])``. A KV segment ``x[g, lo:hi]`` of ``[G, L, ..., d]`` and a
raw edge layer range are contiguous runs of those rows, so an executor addresses both
by ``row_start`` and a count.
"""

from __future__ import annotations

import dataclasses
import math

from tq_jax._src import wire as _wire

__all__ = ["Plan", "Segment", "RawRange", "for_tensor", "for_header", "for_parsed", "OVERFLOW_POLICIES"]

OVERFLOW_POLICIES = ("raise", "widen", "keep")
"""What a norm beyond float16's range does: ``raise`` (``norm_dtype="float16"``),
``widen`` (``"auto"``: rewrite with float32 norms, :attr:`Plan.widened`), ``keep``
(float32 norms, or log-coded norms, which have no float16 limit)."""

_LEN = 8  # every section is preceded by its i64 length


@dataclasses.dataclass(frozen=True)
class Segment:
    """One quantized part of the tensor, in wire order.

    Attributes:
        group: 0/1 (K/V) with a KV layout, else None (the whole tensor).
        layers: ``(lo, hi)`` of axis 1 with a KV layout, else None.
        n_vectors: vectors in the segment.
        row_start: the segment's first row in the tensor's ``(rows, d)`` view.
        config: the segment's :class:`~tq_jax._src.codec.CodecConfig` (bits, seed, rotation, nc).
        index_offset: blob offset of the index section's data (after its length).
        index_nbytes: ``ceil(n_vectors * d * bits / 8)``.
        norms_offset: blob offset of the norm section's data.
        norms_nbytes: bytes of the norm section (floats, or ranges + log codes).
        norm_groups: log-coded norm groups (``Header.norm_groups``); 0 without ``norm_bits``.
    """

    group: int | None
    layers: tuple | None
    n_vectors: int
    row_start: int
    config: object  # tq_jax._src.codec.CodecConfig (imported lazily: codec imports jax)
    index_offset: int
    index_nbytes: int
    norms_offset: int
    norms_nbytes: int
    norm_groups: int

    @property
    def bits(self) -> int:
        return self.config.bits


@dataclasses.dataclass(frozen=True)
class RawRange:
    """Raw (exact) edge layers of one group: ``rows`` rows from ``row_start``, stored at
    blob offset ``offset`` (``nbytes`` bytes of the original dtype)."""

    group: int
    layers: tuple
    row_start: int
    rows: int
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything an executor needs to write or read one blob (see the module docstring).

    Attributes:
        header: the blob's :class:`~tq_jax._src.wire.Header`.
        header_bytes: its bytes (up to the first section length).
        shape: the tensor's shape; ``dim`` its last axis.
        dtype: the tensor's TQ01 dtype name.
        segments: the quantized parts (:class:`Segment`), in wire order.
        raw: the raw edge layers (:class:`RawRange`), in wire order.
        raw_offset: blob offset of the raw section's data (version 2), else None.
        nbytes: the exact blob length, checksum included.
        checksum: a CRC32 of every preceding byte ends the blob.
        norm_dtype: ``"float16"``/``"float32"`` (float norms) or None (log codes).
        norm_bits: 0, or the width of log-coded norms.
        overflow: one of :data:`OVERFLOW_POLICIES`.
        widened: with ``overflow == "widen"``, the plan with float32 norms.
        qjl: the blob carries the QJL residual (read only; version 1 as the reference wrote it).
    """

    header: _wire.Header
    header_bytes: bytes
    shape: tuple
    dtype: str
    segments: tuple
    raw: tuple
    raw_offset: int | None
    nbytes: int
    checksum: bool
    norm_dtype: str | None
    norm_bits: int
    overflow: str
    widened: "Plan | None"
    qjl: bool

    @property
    def dim(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def version(self) -> int:
        return self.header.version

    @classmethod
    def from_layout(cls, layout: _wire.Layout, configs, overflow: str, widened: "Plan | None" = None) -> "Plan":
        """The plan of a blob laid out as ``layout`` (:func:`tq_jax._src.wire.layout` for a writer,
        :attr:`tq_jax._src.wire.Parsed.layout` for a reader), ``configs`` one
        :class:`~tq_jax._src.codec.CodecConfig` per segment: the section offsets follow from the
        header; wire's length is the check that both read the format alike."""
        h, hb, nbytes = layout
        dim = h.shape[-1] if h.shape else 0
        off = len(hb)
        per_layer = math.prod(h.shape[2:-1]) if h.kv_layout else 0
        layers = h.shape[1] if h.kv_layout else 0
        segments = []
        for (g, bits, lo, hi, n_vec), cfg in zip(h.segments(), configs):
            row_start = 0 if g is None else (g * layers + lo) * per_layer
            idx_n = (n_vec * dim * bits + 7) // 8
            index_offset = off + _LEN
            off = index_offset + idx_n
            nrm_n = h.norms_nbytes(n_vec)
            norms_offset = off + _LEN
            off = norms_offset + nrm_n
            groups = h.norm_groups(n_vec) if h.norm_bits else 0
            layer_span = None if g is None else (lo, hi)
            segments.append(Segment(g, layer_span, n_vec, row_start, cfg, index_offset, idx_n, norms_offset, nrm_n,
                                    groups))
        raw, raw_offset = [], None
        if h.version == _wire.VERSION_2:
            raw_offset = off + _LEN
            r_off = raw_offset
            itemsize = _wire.ITEMSIZE[h.dtype]
            for g, lo, hi in h.raw_ranges():
                rows = (hi - lo) * per_layer
                raw_n = rows * dim * itemsize
                raw.append(RawRange(g, (lo, hi), (g * layers + lo) * per_layer, rows, r_off, raw_n))
                r_off += raw_n
            off = r_off
        if h.version == _wire.VERSION_1 and h.use_qjl:
            _, _, sk, rn = _wire.section_sizes(h.shape, h.bits, True, h.qjl_sketch_size)
            off += _LEN + sk + _LEN + rn
        if h.version == _wire.VERSION_2 and h.checksum:
            off += 4
        if off != nbytes:  # the plan's offsets and wire's length are two readings of one format
            raise AssertionError(f"plan: sections end at {off} but the layout's blob holds {nbytes} bytes for {h}")
        return cls(
            header=h,
            header_bytes=hb,
            shape=tuple(h.shape),
            dtype=h.dtype,
            segments=tuple(segments),
            raw=tuple(raw),
            raw_offset=raw_offset,
            nbytes=nbytes,
            checksum=bool(h.version == _wire.VERSION_2 and h.checksum),
            norm_dtype=None if h.norm_bits else h.norm_dtype,
            norm_bits=h.norm_bits,
            overflow=overflow,
            widened=widened,
            qjl=bool(h.use_qjl),
        )

    @property
    def layout(self) -> _wire.Layout:
        """The blob's :class:`~tq_jax._src.wire.Layout`: what :func:`tq_jax._src.wire.pieces` writes it to."""
        return _wire.Layout(self.header, self.header_bytes, self.nbytes)

    def section_lengths(self) -> list:
        """``(offset, value)`` of every section-length field, in wire order: what an
        executor writes besides the sections' data (a Python list of ints)."""
        out = []
        for s in self.segments:
            out.append((s.index_offset - _LEN, s.index_nbytes))
            out.append((s.norms_offset - _LEN, s.norms_nbytes))
        if self.raw_offset is not None:
            out.append((self.raw_offset - _LEN, sum(r.nbytes for r in self.raw)))
        return out


def _config(dim: int, bits: int, seed: int, rotation: str, norm_correction: bool, trellis: bool):
    from tq_jax._src import codec as _codec  # jax: imported when a plan is built

    return _codec.CodecConfig(dim, bits, seed, rotation, norm_correction, trellis)


def for_tensor(shape, dtype, options) -> Plan:
    """The plan of encoding a tensor of ``shape``/``dtype`` under ``options``
    (a :class:`~tq_jax.Options`): the one place the blob path reads the options, and
    one call to wire for the header's layout (:meth:`~tq_jax.Options.layout`).

    Raises:
        ValueError: the options cannot apply to this shape (``Options.layout``'s errors).
    """
    layout = options.layout(shape, dtype)  # validates the shape for the options
    dim = layout.header.shape[-1]
    configs = [options.codec_config(dim, 1 if g == 1 else 0) for g, *_ in layout.header.segments()]
    if options.norm_bits:
        return Plan.from_layout(layout, configs, "keep")
    if options.norm_dtype == "auto":
        wide = Plan.from_layout(options.layout(shape, dtype, norm_dtype="float32"), configs, "keep")
        return Plan.from_layout(layout, configs, "widen", wide)
    return Plan.from_layout(layout, configs, "raise" if layout.header.norm_dtype == "float16" else "keep")


def for_header(header: _wire.Header) -> Plan:
    """The plan of reading a blob whose parsed header is ``header``: every segment's
    codec from the header's own fields (bits, seed, rotation, norm correction)."""
    return Plan.from_layout(_wire.layout(header), _read_configs(header), "keep")


def for_parsed(parsed: _wire.Parsed) -> Plan:
    """The plan of reading a parsed blob: :func:`for_header` of its header, with the
    header bytes and length the parser read (nothing is written again). Equal to the
    plan the writer resolved."""
    return Plan.from_layout(parsed.layout, _read_configs(parsed.header), "keep")


def _read_configs(header: _wire.Header) -> list:
    dim = header.shape[-1]
    return [_config(dim, bits, header.seed, header.rotation, header.norm_correction, header.trellis) for _, bits, *_ in header.segments()]
