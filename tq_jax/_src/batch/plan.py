"""Plans: what ``compress``/``decompress`` will write, decided before any data is read.

A :class:`FilePlan` lists the output's tensors (:class:`Entry`) in order, each as a
run of :class:`Unit` s: a copy of input elements, one TQ01 blob to encode, or one blob
to decode. Units are cut by :func:`chunk_rows` (and, for per-group bits or raw edge
layers, by group and layer) so that each reads at most the chunk budget of input.
The plan depends only on the input's tensor list, the options and the budget — never
on devices or processes — so every process of a job plans the same output bytes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
from typing import Iterator, NamedTuple

from tq_jax._src import options as _options
from tq_jax._src import safetensors_io as st
from tq_jax._src.batch import metadata as _meta
from tq_jax._src.batch import writers as _writers
from tq_jax._src.batch.errors import BatchError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "EVERY_LAYER_RAW",
    "Unit",
    "Entry",
    "FilePlan",
    "CompressOptions",
    "chunk_rows",
    "plan_compress",
    "plan_decompress",
]

DEFAULT_CHUNK_BYTES = 64 << 20


class Unit(NamedTuple):
    """One contiguous piece of an output entry's bytes.

    kind: "raw" (copy input elements [start, stop)), "encode" (TQ01-encode input
    elements [start, stop) viewed as ``shape``), or "decode" (decode the blob at input
    bytes [start, stop) into an array of ``shape``).
    """

    kind: str
    name: str  # the input tensor
    dtype: str  # safetensors dtype name of the output bytes
    start: int
    stop: int
    shape: tuple
    nbytes: int  # output bytes (an estimate for "encode" until encoded)
    in_nbytes: int  # input bytes (for progress)
    options: _options.Options | None = None  # "encode": the chunk's tq_jax.Options


class Entry(NamedTuple):
    name: str
    dtype: str  # safetensors dtype name of the output tensor
    shape: tuple
    units: tuple


class FilePlan(NamedTuple):
    mode: str  # "compress" | "decompress"
    src: str
    out: str
    entries: tuple
    metadata: dict
    tq: dict  # the tq_jax metadata document (compress: written; decompress: read)
    header_size: int | None = None  # compress: bytes reserved for the output's header
    passed: tuple = ()  # compress --all: (name, why) of floating tensors TQ01 cannot encode

    def finalize(self, sizes: dict) -> tuple[list, dict]:
        """Output specs and metadata once the codec units' real sizes are known.

        Args:
            sizes: ``(entry index, unit index) -> bytes`` for every encode/decode unit.
        """
        specs, tensors = [], {}
        for ei, e in enumerate(self.entries):
            if not e.units or e.units[0].kind != "encode":
                for ui, u in enumerate(e.units):
                    if u.kind == "decode" and sizes[ei, ui] != u.nbytes:
                        raise RuntimeError(f"tensor {e.name!r}: decoded {sizes[ei, ui]} bytes, expected {u.nbytes}")
                specs.append((e.name, e.dtype, e.shape))
                continue
            blobs = [int(sizes[ei, ui]) for ui in range(len(e.units))]
            tensors[e.name] = dict(self.tq["tensors"][e.name], blobs=blobs)
            specs.append((e.name, "U8", (sum(blobs),)))
        if self.mode != "compress":
            return specs, self.metadata
        metadata = dict(self.metadata)
        metadata[_meta.META_KEY] = _meta.to_json(dict(self.tq, tensors=tensors))
        return specs, metadata

    @property
    def in_nbytes(self) -> int:
        return sum(u.in_nbytes for e in self.entries for u in e.units)

    def fingerprint(self) -> str:
        import hashlib

        doc = json.dumps([self.mode, self.out, [list(e) for e in self.entries], self.metadata], default=str)
        return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _as_options(value) -> _options.Options:
    """An Options as is; (name, value) pairs or a dict as the Options they name."""
    if isinstance(value, _options.Options):
        return value
    try:
        return _options.Options(**dict(value))
    except (TypeError, ValueError) as e:
        raise BatchError(f"invalid codec options: {e}") from None


@dataclasses.dataclass(frozen=True)
class CompressOptions:
    """Settings of ``compress``.

    Attributes:
        options: the :class:`tq_jax.Options` every compressed tensor is written with
            (each chunk gets its local share: :func:`plan_compress`), recorded in the
            metadata. (name, value) pairs of Options fields are accepted too and
            become the Options they name, validated here, once.
        head_dim: vector length; tensors whose last axis is head_dim are compressed.
        all: also compress floating tensors whose last axis is a multiple of head_dim;
            a floating tensor TQ01 cannot encode (its dtype, or a last axis head_dim
            does not divide) passes through unchanged, recorded in ``FilePlan.passed``.
        exclude: glob patterns of tensor names to pass through unchanged.
        chunk_bytes: input bytes per blob at most (rounded to whole rows).

    Raises:
        BatchError: ``options`` do not make a valid :class:`tq_jax.Options`.
    """

    options: _options.Options = _options.Options(key_bits=4, value_bits=4, seed=42)
    head_dim: int = 128
    all: bool = False
    exclude: tuple = ()
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self):
        object.__setattr__(self, "options", _as_options(self.options))
        object.__setattr__(self, "exclude", tuple(self.exclude))


def chunk_rows(shape: tuple, itemsize: int, chunk_bytes: int) -> Iterator[tuple[int, int, tuple]]:
    """Cut a C-order tensor into runs of whole rows along its leading axes.

    Yields (element start, element stop, chunk shape). One chunk when the tensor fits
    ``chunk_bytes``; otherwise the tensor is viewed as ``(rows, *shape[k:])`` with the
    smallest ``k`` whose row fits, and each chunk takes as many rows as fit (at least 1).
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if total * itemsize <= chunk_bytes or len(shape) <= 1:
        yield 0, total, shape
        return
    for k in range(1, len(shape)):
        if math.prod(shape[k:]) * itemsize <= chunk_bytes:
            break
    row = math.prod(shape[k:])
    rows = math.prod(shape[:k])
    per = max(1, chunk_bytes // (row * itemsize))
    for r0 in range(0, rows, per):
        r1 = min(rows, r0 + per)
        yield r0 * row, r1 * row, (r1 - r0,) + shape[k:]


def _raw_units(info: st.TensorInfo, chunk_bytes: int) -> tuple:
    itemsize = info.np_dtype.itemsize
    per = max(1, chunk_bytes // itemsize)
    n = info.size
    units = []
    for s in range(0, max(n, 1), per):
        e = min(n, s + per)
        nb = (e - s) * itemsize
        units.append(Unit("raw", info.name, info.dtype, s, e, (e - s,), nb, nb))
    return tuple(units)


def _wants_compression(info: st.TensorInfo, opts: CompressOptions) -> bool:
    if info.dtype not in st.FLOAT_DTYPES:
        return False
    if any(fnmatch.fnmatchcase(info.name, p) for p in opts.exclude):
        return False
    if opts.all:
        return True
    return len(info.shape) >= 1 and info.shape[-1] == opts.head_dim


def _cannot_encode(info: st.TensorInfo, head_dim: int) -> str | None:
    """Why TQ01 cannot encode a floating tensor, or None when it can."""
    if info.dtype not in _meta.TQ_DTYPES:
        return f"dtype {info.dtype}; TQ01 encodes only {', '.join(_meta.TQ_DTYPES)}"
    if not info.shape:
        return "a scalar; TQ01 encodes vectors of head_dim values"
    if info.shape[-1] % head_dim:
        return f"last axis not a multiple of --head-dim {head_dim}"
    return None


EVERY_LAYER_RAW = (
    "{where}: {opts} keep{s} the first {first} and last {last} layers raw, which covers all {layers} "
    "layers (axis 1) of this KV tensor: nothing would be compressed and the output would be larger than "
    "the input. {fix}or keep the tensor uncompressed with --exclude {name!r}."
)


def _check_some_layer_coded(where: str, name: str, shape: tuple, options: _options.Options,
                            preset: str | None) -> None:
    """Refuse raw-layer counts that cover every layer of a KV tensor ``[2 or 1, layers, ...]``.

    (More raw layers than the tensor has is the codec's error, raised when sizing it.)
    """
    first, last = options.skip_first_layers, options.skip_last_layers
    if not (first or last) or len(shape) < 3 or shape[0] not in (1, 2) or first + last != shape[1]:
        return
    flags = f"--skip-first-layers {first} --skip-last-layers {last}"
    if preset:
        what, fix = f"--preset {preset} ({flags})", (
            "Override them (e.g. add --skip-first-layers 0 --skip-last-layers 0: flags win over a preset), "
            "use a preset without raw layers (k8v4, compat-4bit), ")
    else:
        what, fix = flags, "Lower them, "
    raise BatchError(EVERY_LAYER_RAW.format(where=where, opts=what, s="s" if preset else "", first=first,
                                            last=last, layers=shape[1], fix=fix, name=name))


def _encode_chunks(shape: tuple, itemsize: int, chunk_bytes: int, options: _options.Options):
    """Chunks of a tensor to encode, each with the options that encode it.

    Yields (element start, element stop, chunk shape, options). Plain options: the
    chunks of :func:`chunk_rows`, all with the same options. Per-group bits or raw
    edge layers (a KV tensor ``[groups, layers, ...]``): a tensor over the budget is
    cut inside one group and then by whole layers (or rows of one layer), and each
    chunk gets the options that say the same thing locally: its group's bits, and the
    raw-layer counts that fall inside it. Decoding the chunks in order gives the same
    values as one blob would.
    """
    total = math.prod(shape)
    if not options.kv_layout or total * itemsize <= chunk_bytes or len(shape) < 3:
        for s, e, cshape in chunk_rows(shape, itemsize, chunk_bytes):
            yield s, e, cshape, options
        return
    groups, layers, rest = shape[0], shape[1], tuple(shape[2:])
    layer = math.prod(rest)
    first, last = options.skip_first_layers, options.skip_last_layers
    if first + last > layers:  # let the codec's own check explain it
        yield 0, total, shape, options
        return
    for g in range(groups):
        bits = options.key_bits if g == 0 else options.value_bits
        per = chunk_bytes // (layer * itemsize)
        spans = (
            [(l0, min(layers, l0 + per), None) for l0 in range(0, layers, per)]
            if per >= 1
            else [(li, li + 1, r) for li in range(layers) for r in chunk_rows(rest, itemsize, chunk_bytes)]
        )
        for l0, l1, rows in spans:
            local = dataclasses.replace(
                options, key_bits=bits, value_bits=bits,
                skip_first_layers=min(max(first - l0, 0), l1 - l0),
                skip_last_layers=min(max(l1 - (layers - last), 0), l1 - l0),
            )
            base = (g * layers + l0) * layer
            if rows is None:
                yield base, base + (l1 - l0) * layer, (1, l1 - l0) + rest, local
            else:
                s, e, cshape = rows
                yield base + s, base + e, (1, 1) + cshape, local


def plan_compress(src, out: str, opts: CompressOptions, preset: str | None = None) -> FilePlan:
    """Decide, for every tensor of ``src``, how it is stored in ``out``.

    Args:
        src: the input (a :class:`~tq_jax._src.batch.sources.Source`).
        out: the output path.
        opts: what to compress and how.
        preset: the ``--preset`` the options came from, if any (named in errors).

    Raises:
        BatchError: the file is already compressed, a tensor chosen by its last axis has
            a dtype TQ01 cannot record, the options do not fit a chosen tensor, or
            raw-layer counts cover every layer of a KV tensor.
    """
    import tq_jax

    if _meta.META_KEY in src.metadata:
        raise BatchError(f"{src.path} is already a tq-jax compressed file; decompress it first.")
    hd = opts.head_dim
    options = _as_options(opts.options)
    recorded = dataclasses.asdict(options)
    entries = []
    tensors = {}
    passed = []
    for info in src.tensors.values():
        if not _wants_compression(info, opts):
            entries.append(Entry(info.name, info.dtype, info.shape, _raw_units(info, opts.chunk_bytes)))
            continue
        why = _cannot_encode(info, hd)
        if why is not None:
            if not opts.all:  # chosen because its last axis is head_dim: only its dtype can be wrong
                raise BatchError(
                    f"{src.path}: tensor {info.name!r} has dtype {info.dtype}, but TQ01 encodes only "
                    f"{', '.join(_meta.TQ_DTYPES)}: cast it first, or keep it uncompressed with --exclude {info.name!r}."
                )
            passed.append((info.name, why))  # --all takes what TQ01 can encode
            entries.append(Entry(info.name, info.dtype, info.shape, _raw_units(info, opts.chunk_bytes)))
            continue
        last = info.shape[-1]
        bshape = info.shape if last == hd else info.shape[:-1] + (last // hd, hd)
        _check_some_layer_coded(f"{src.path}: tensor {info.name!r} of shape {list(info.shape)}", info.name,
                                bshape, options, preset)
        itemsize = info.np_dtype.itemsize
        units = []
        for s, e, cshape, local in _encode_chunks(bshape, itemsize, opts.chunk_bytes, options):
            try:
                nb = tq_jax.serialized_size(cshape, st.DTYPES[info.dtype], options=local)
            except ValueError as err:  # options the tensor cannot carry (e.g. raw layers)
                raise BatchError(
                    f"{src.path}: tensor {info.name!r} of shape {list(info.shape)}: {err} "
                    f"(keep it uncompressed with --exclude {info.name!r})"
                ) from None
            units.append(Unit("encode", info.name, "U8", s, e, cshape, nb, (e - s) * itemsize, local))
        blobs = [u.nbytes for u in units]
        tensors[info.name] = _meta.tensor_entry(info.dtype, info.shape, hd, recorded, blobs)
        entries.append(Entry(info.name, "U8", (sum(blobs),), tuple(units)))
    tq = _meta.document(src.kind, tensors)
    metadata = dict(src.metadata)
    metadata[_meta.META_KEY] = _meta.to_json(tq)
    # Blob sizes are estimates until encoded (e.g. norms that overflow float16 make a
    # longer blob), so the header gets room for every number to grow: the same room
    # in every run, so the bytes stay deterministic.
    specs = [(e.name, e.dtype, e.shape) for e in entries]
    n_numbers = sum(len(t["blobs"]) for t in tensors.values()) + 3 * len(entries)
    planned = len(st.header_bytes(specs, metadata)[0])
    header_size = -(-(planned + 8 * n_numbers + 64) // 8) * 8
    return FilePlan("compress", src.path, os.fspath(out), tuple(entries), metadata, tq, header_size,
                    tuple(passed))


def plan_decompress(src, out: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> FilePlan:
    """Plan restoring every tensor of a compressed file.

    Raises:
        BatchError: not a tq-jax file, its metadata and blobs disagree, or an
            .npy/.npz ``out`` cannot hold the tensors.
    """
    doc = _meta.read_tq_metadata(src)
    if doc is None:
        raise BatchError(
            f"{src.path} is not a tq-jax compressed file (no {_meta.META_KEY!r} metadata); nothing to decompress."
        )
    metas = doc["tensors"]
    entries = []
    for info in src.tensors.values():
        meta = metas.get(info.name)
        if meta is None:
            entries.append(Entry(info.name, info.dtype, info.shape, _raw_units(info, chunk_bytes)))
            continue
        headers = _meta.blob_headers(src, info.name, meta)
        itemsize = st.DTYPES[meta["dtype"]].itemsize
        units = []
        for off, nb, h in headers:
            n_out = math.prod(h.shape) * itemsize
            units.append(Unit("decode", info.name, meta["dtype"], off, off + nb, tuple(h.shape), n_out, nb))
        entries.append(Entry(info.name, meta["dtype"], tuple(meta["shape"]), tuple(units)))
    missing = sorted(set(metas) - set(src.tensors))
    if missing:
        raise BatchError(f"{src.path}: tensor {missing[0]!r} is listed in the tq_jax metadata but missing from the file")
    metadata = {k: v for k, v in src.metadata.items() if k != _meta.META_KEY}
    plan = FilePlan("decompress", src.path, os.fspath(out), tuple(entries), metadata, doc)
    _writers.check_numpy_output(plan.out, [(e.name, e.dtype, e.shape) for e in plan.entries])
    return plan
