"""Batch compression of tensor files: the engine behind ``tq-jax compress/decompress``.

A *compressed file* is an ordinary safetensors file. Every tensor chosen for
compression is stored under its own name as a 1-D ``U8`` tensor holding one or more
TQ01 blobs back to back; every other tensor passes through unchanged. The file's
``__metadata__`` keeps the input's metadata and adds one key, ``"tq_jax"``, whose value
is a JSON document::

    {"format": "tq-jax", "version": 1, "source": "safetensors" | "npy" | "npz",
     "tensors": {name: {"codec": "TQ01", "dtype": "BF16", "shape": [2, 32, 256, 8, 128],
                        "head_dim": 128, "bits": 4, "seed": 42,
                        "blobs": [nbytes, nbytes, ...]}}}

``shape``/``dtype`` are the original tensor's; ``blobs`` lists the byte length of each
blob in the entry, in order. Each blob is a self-contained TQ01 blob (readable by the
reference plugin) of one *chunk* of the tensor: the tensor is viewed as
``(rows, *shape[k:])`` for the smallest ``k`` whose rows fit the chunk budget
(default 64 MiB of input), and each chunk is a run of whole rows, so a blob's shape is
``(rows_in_chunk, *shape[k:])``. A tensor that fits the budget is one blob of its own
shape. Decoding the blobs in order and concatenating them (C order) gives the tensor
back. With ``--all``, a tensor whose last axis is a multiple ``n * head_dim`` is
encoded as ``(..., n, head_dim)`` (like LMCache's ``[.., H*D] -> [.., H, D]``) and
reshaped back on decode.

Memory stays bounded by the chunk budget: inputs are memory-mapped one chunk at a time,
outputs are written chunk by chunk to a temporary file that is renamed over OUT only
once complete (:class:`safetensors_io.AtomicFile`: mode ``0o666`` less the umask, like
any new file). The chunking depends only on the shapes and the budget, never on the
devices or processes, so the output bytes do not either.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import struct
import sys
import time
import zipfile
from typing import Callable, Iterator, NamedTuple

import numpy as np

from tq_jax import safetensors_io as st

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_KEY",
    "DEFAULT_CHUNK_BYTES",
    "CliError",
    "CompressOptions",
    "Unit",
    "Entry",
    "FilePlan",
    "open_source",
    "plan_compress",
    "plan_decompress",
    "open_writer",
    "produce",
    "run_local",
    "Progress",
]

FORMAT = "tq-jax"
FORMAT_VERSION = 1
META_KEY = "tq_jax"
DEFAULT_CHUNK_BYTES = 64 << 20
TQ_DTYPES = ("BF16", "F16", "F32")  # what TQ01 can record as the original dtype


class CliError(Exception):
    """An error a person can act on: printed as one line, exit status 1."""


# --------------------------------------------------------------------------- sources


class _Npy(NamedTuple):
    shape: tuple
    dtype: np.dtype
    offset: int  # of the data, in the file


def _read_npy_header(f):
    fmt = np.lib.format
    version = fmt.read_magic(f)
    if version == (1, 0):
        return fmt.read_array_header_1_0(f)
    if version == (2, 0):
        return fmt.read_array_header_2_0(f)
    return fmt._read_array_header(f, version)  # (3, 0): utf-8 names; no public reader


def _npy_header(f, offset: int, what: str) -> _Npy:
    f.seek(offset)
    try:
        shape, fortran, dtype = _read_npy_header(f)
    except (ValueError, OSError, SyntaxError, TypeError) as e:
        raise CliError(f"{what} is not a valid .npy array: {e}") from None
    if fortran and len(shape) > 1:
        raise CliError(f"{what} is stored in Fortran order; save it in C order (np.ascontiguousarray) first.")
    return _Npy(tuple(int(s) for s in shape), dtype, f.tell())


class Source:
    """Tensors of an input file: safetensors, .npy or .npz, read chunk by chunk.

    Attributes:
        path: the file.
        kind: "safetensors", "npy" or "npz".
        tensors: name -> :class:`safetensors_io.TensorInfo` (dtype as a safetensors
            name; offsets only meaningful for safetensors).
        metadata: str -> str (empty for npy/npz).
    """

    def __init__(self, path, kind, tensors, metadata, reader=None, arrays=None, f=None):
        self.path, self.kind, self.tensors, self.metadata = path, kind, tensors, metadata
        self._reader, self._arrays, self._f = reader, arrays, f
        self._cache: tuple | None = None

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements [start, stop) of tensor ``name``, flat, memory-mapped where possible."""
        info = self.tensors[name]
        stop = info.size if stop is None else stop
        if self._reader is not None:
            return self._reader.read(name, start, stop)
        loc = self._arrays[name]
        if isinstance(loc, _Npy):
            if stop == start:
                return np.empty(0, loc.dtype)
            off = loc.offset + start * loc.dtype.itemsize
            return np.memmap(self._f, dtype=loc.dtype, mode="r", offset=off, shape=(stop - start,))
        # A compressed .npz member: read once, keep only the latest one.
        if self._cache is None or self._cache[0] != name:
            self._cache = None
            with zipfile.ZipFile(self.path) as z, z.open(loc) as m:
                arr = np.lib.format.read_array(m, allow_pickle=False)
            self._cache = (name, np.ascontiguousarray(arr).reshape(-1))
        return self._cache[1][start:stop]

    def close(self):
        self._cache = None
        if self._reader is not None:
            self._reader.close()
        if self._f is not None:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _info(name, dtype: np.dtype, shape, what) -> st.TensorInfo:
    try:
        dname = st.dtype_name(dtype)
    except st.InvalidDtypeError as e:
        raise CliError(f"{what}: unsupported dtype: {e}") from None
    nbytes = math.prod(shape) * dtype.itemsize
    return st.TensorInfo(name, dname, tuple(shape), 0, nbytes)


def _zip_member_offset(f, zinfo) -> int:
    """Where a stored zip member's bytes start (after its local file header)."""
    f.seek(zinfo.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise CliError(f"corrupt .npz: bad local header for {zinfo.filename!r}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return zinfo.header_offset + 30 + name_len + extra_len


def check_input(path) -> str:
    """``path`` as a string, or CliError if it is missing or a directory."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CliError(f"{path}: no such file")
    if os.path.isdir(path):
        raise CliError(f"{path}: is a directory, expected a file")
    return path


def open_source(path) -> Source:
    """Open an input file by its extension (.npy, .npz, anything else: safetensors).

    Raises:
        CliError: missing, unreadable or corrupt file, unsupported dtype.
    """
    path = check_input(path)
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".npy":
            f = open(path, "rb")
            try:
                loc = _npy_header(f, 0, path)
                size = os.fstat(f.fileno()).st_size
                name = os.path.splitext(os.path.basename(path))[0]
                info = _info(name, loc.dtype, loc.shape, f"{path}")
                if loc.offset + info.nbytes > size:
                    raise CliError(f"{path}: truncated .npy: needs {loc.offset + info.nbytes} bytes, has {size}")
            except BaseException:
                f.close()
                raise
            return Source(path, "npy", {name: info}, {}, arrays={name: loc}, f=f)
        if ext == ".npz":
            f = open(path, "rb")
            try:
                try:
                    z = zipfile.ZipFile(f)
                except zipfile.BadZipFile as e:
                    raise CliError(f"{path}: not a valid .npz (zip) file: {e}") from None
                tensors, arrays = {}, {}
                size = os.fstat(f.fileno()).st_size
                for zi in z.infolist():
                    if not zi.filename.endswith(".npy"):
                        continue
                    name = zi.filename[: -len(".npy")]
                    what = f"{path}[{name}]"
                    if zi.compress_type == zipfile.ZIP_STORED:
                        loc = _npy_header(f, _zip_member_offset(f, zi), what)
                        info = _info(name, loc.dtype, loc.shape, what)
                        if loc.offset + info.nbytes > size:
                            raise CliError(f"{what}: truncated .npz member")
                        arrays[name] = loc
                    else:
                        with z.open(zi) as m:
                            try:
                                shape, _, dtype = _read_npy_header(m)
                            except (ValueError, OSError, SyntaxError, TypeError) as e:
                                raise CliError(f"{what} is not a valid .npy array: {e}") from None
                        info = _info(name, dtype, shape, what)
                        arrays[name] = zi.filename
                    tensors[name] = info
            except BaseException:
                f.close()
                raise
            return Source(path, "npz", tensors, {}, arrays=arrays, f=f)
        reader = st.SafetensorsReader(path)
        return Source(path, "safetensors", dict(reader.tensors), dict(reader.metadata), reader=reader)
    except st.SafetensorsError as e:
        raise CliError(f"{path}: not a valid safetensors file: {e}") from None
    except PermissionError:
        raise CliError(f"{path}: permission denied") from None
    except OSError as e:
        raise CliError(f"{path}: cannot read: {e.strerror or e}") from None


# --------------------------------------------------------------------------- plans


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
    options: tuple = ()  # "encode": sorted (name, value) pairs for tq_jax.dumps


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
        metadata[META_KEY] = _tq_json(dict(self.tq, tensors=tensors))
        return specs, metadata

    @property
    def in_nbytes(self) -> int:
        return sum(u.in_nbytes for e in self.entries for u in e.units)

    def fingerprint(self) -> str:
        import hashlib

        doc = json.dumps([self.mode, self.out, [list(e) for e in self.entries], self.metadata], default=str)
        return hashlib.sha256(doc.encode()).hexdigest()[:16]


class CompressOptions(NamedTuple):
    """Settings of ``compress``.

    Attributes:
        options: codec options, sorted (name, value) pairs of :class:`tq_jax.Options`
            fields (``key_bits``, ``value_bits``, ``seed``, ``rotation``, ...): what
            :func:`tq_jax.dumps` receives, recorded in the metadata.
        head_dim: vector length; tensors whose last axis is head_dim are compressed.
        all: also compress floating tensors whose last axis is a multiple of head_dim;
            a floating tensor TQ01 cannot encode (its dtype, or a last axis head_dim
            does not divide) passes through unchanged, recorded in ``FilePlan.passed``.
        exclude: glob patterns of tensor names to pass through unchanged.
        chunk_bytes: input bytes per blob at most (rounded to whole rows).
    """

    options: tuple = (("key_bits", 4), ("value_bits", 4), ("seed", 42))
    head_dim: int = 128
    all: bool = False
    exclude: tuple = ()
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    @classmethod
    def make(cls, bits: int = 4, seed: int = 42, **kwargs) -> "CompressOptions":
        """From ``bits``/``seed`` plus any :class:`tq_jax.Options` field and the fields above."""
        fields = set(cls._fields)
        codec = {k: v for k, v in kwargs.items() if k not in fields}
        codec.setdefault("key_bits", bits)
        codec.setdefault("value_bits", bits)
        codec["seed"] = seed
        return cls(options=tuple(sorted(codec.items())), **{k: v for k, v in kwargs.items() if k in fields})


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
    if info.dtype not in TQ_DTYPES:
        return f"dtype {info.dtype}; TQ01 encodes only {', '.join(TQ_DTYPES)}"
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


def _check_some_layer_coded(where: str, name: str, shape: tuple, options: dict, preset: str | None) -> None:
    """Refuse raw-layer counts that cover every layer of a KV tensor ``[2 or 1, layers, ...]``.

    (More raw layers than the tensor has is the codec's error, raised when sizing it.)
    """
    first, last = options.get("skip_first_layers", 0), options.get("skip_last_layers", 0)
    if not (first or last) or len(shape) < 3 or shape[0] not in (1, 2) or first + last != shape[1]:
        return
    flags = f"--skip-first-layers {first} --skip-last-layers {last}"
    if preset:
        what, fix = f"--preset {preset} ({flags})", (
            "Override them (e.g. add --skip-first-layers 0 --skip-last-layers 0: flags win over a preset), "
            "use a preset without raw layers (k8v4, compat-4bit), ")
    else:
        what, fix = flags, "Lower them, "
    raise CliError(EVERY_LAYER_RAW.format(where=where, opts=what, s="s" if preset else "", first=first,
                                          last=last, layers=shape[1], fix=fix, name=name))


def plan_compress(src: Source, out: str, opts: CompressOptions, preset: str | None = None) -> FilePlan:
    """Decide, for every tensor of ``src``, how it is stored in ``out``.

    Args:
        src: the input.
        out: the output path.
        opts: what to compress and how.
        preset: the ``--preset`` the options came from, if any (named in errors).

    Raises:
        CliError: the file is already compressed, a tensor chosen by its last axis has
            a dtype TQ01 cannot record, the options do not fit a chosen tensor, or
            raw-layer counts cover every layer of a KV tensor.
    """
    import tq_jax

    if META_KEY in src.metadata:
        raise CliError(f"{src.path} is already a tq-jax compressed file; decompress it first.")
    hd = opts.head_dim
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
                raise CliError(
                    f"{src.path}: tensor {info.name!r} has dtype {info.dtype}, but TQ01 encodes only "
                    f"{', '.join(TQ_DTYPES)}: cast it first, or keep it uncompressed with --exclude {info.name!r}."
                )
            passed.append((info.name, why))  # --all takes what TQ01 can encode
            entries.append(Entry(info.name, info.dtype, info.shape, _raw_units(info, opts.chunk_bytes)))
            continue
        last = info.shape[-1]
        bshape = info.shape if last == hd else info.shape[:-1] + (last // hd, hd)
        _check_some_layer_coded(f"{src.path}: tensor {info.name!r} of shape {list(info.shape)}", info.name,
                                bshape, dict(opts.options), preset)
        itemsize = info.np_dtype.itemsize
        units = []
        for s, e, cshape, kw in _encode_chunks(bshape, itemsize, opts.chunk_bytes, dict(opts.options)):
            try:
                nb = tq_jax.serialized_size(cshape, st.DTYPES[info.dtype], **kw)
            except ValueError as err:  # options the tensor cannot carry (e.g. raw layers)
                raise CliError(
                    f"{src.path}: tensor {info.name!r} of shape {list(info.shape)}: {err} "
                    f"(keep it uncompressed with --exclude {info.name!r})"
                ) from None
            units.append(Unit("encode", info.name, "U8", s, e, cshape, nb, (e - s) * itemsize,
                              tuple(sorted(kw.items()))))
        blobs = [u.nbytes for u in units]
        tensors[info.name] = {
            "codec": "TQ01",
            "dtype": info.dtype,
            "shape": list(info.shape),
            "head_dim": hd,
            "options": dict(opts.options),
            "blobs": blobs,
        }
        entries.append(Entry(info.name, "U8", (sum(blobs),), tuple(units)))
    tq = {"format": FORMAT, "version": FORMAT_VERSION, "source": src.kind, "tensors": tensors}
    metadata = dict(src.metadata)
    metadata[META_KEY] = _tq_json(tq)
    # Blob sizes are estimates until encoded (e.g. norms that overflow float16 make a
    # longer blob), so the header gets room for every number to grow: the same room
    # in every run, so the bytes stay deterministic.
    specs = [(e.name, e.dtype, e.shape) for e in entries]
    n_numbers = sum(len(t["blobs"]) for t in tensors.values()) + 3 * len(entries)
    planned = len(st.header_bytes(specs, metadata)[0])
    header_size = -(-(planned + 8 * n_numbers + 64) // 8) * 8
    return FilePlan("compress", src.path, os.fspath(out), tuple(entries), metadata, tq, header_size,
                    tuple(passed))


def _tq_json(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _kv_layout(options: dict) -> bool:
    return (
        options.get("key_bits") != options.get("value_bits")
        or options.get("skip_first_layers", 0) > 0
        or options.get("skip_last_layers", 0) > 0
    )


def _encode_chunks(shape: tuple, itemsize: int, chunk_bytes: int, options: dict):
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
    if not _kv_layout(options) or total * itemsize <= chunk_bytes or len(shape) < 3:
        for s, e, cshape in chunk_rows(shape, itemsize, chunk_bytes):
            yield s, e, cshape, options
        return
    groups, layers, rest = shape[0], shape[1], tuple(shape[2:])
    layer = math.prod(rest)
    first, last = options.get("skip_first_layers", 0), options.get("skip_last_layers", 0)
    if first + last > layers:  # let the codec's own check explain it
        yield 0, total, shape, options
        return
    for g in range(groups):
        bits = options["key_bits"] if g == 0 else options["value_bits"]
        per = chunk_bytes // (layer * itemsize)
        spans = (
            [(l0, min(layers, l0 + per), None) for l0 in range(0, layers, per)]
            if per >= 1
            else [(li, li + 1, r) for li in range(layers) for r in chunk_rows(rest, itemsize, chunk_bytes)]
        )
        for l0, l1, rows in spans:
            local = dict(
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


def read_tq_metadata(src: Source) -> dict | None:
    """The parsed ``tq_jax`` metadata document of a compressed file, or None."""
    raw = src.metadata.get(META_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CliError(f"{src.path}: corrupt tq_jax metadata: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tensors"), dict):
        raise CliError(f"{src.path}: corrupt tq_jax metadata: not a {FORMAT} document")
    if doc.get("version") != FORMAT_VERSION:
        raise CliError(
            f"{src.path}: tq_jax metadata version {doc.get('version')!r} is not supported by this "
            f"tq-jax (reads {FORMAT_VERSION}); upgrade tq-jax."
        )
    return doc


def blob_headers(src: Source, name: str, meta: dict) -> list:
    """Validate a compressed entry against its metadata; return [(offset, nbytes, Header)]."""
    import tq_jax

    info = src.tensors.get(name)
    where = f"{src.path}: tensor {name!r}"
    if info is None:
        raise CliError(f"{where} is listed in the tq_jax metadata but missing from the file")
    if not isinstance(meta, dict):
        raise CliError(f"{where}: corrupt tq_jax metadata entry {meta!r}")
    try:
        blobs = [int(b) for b in meta["blobs"]]
        shape = tuple(int(s) for s in meta["shape"])
        dtype = meta["dtype"]
    except (KeyError, TypeError, ValueError):
        raise CliError(f"{where}: corrupt tq_jax metadata entry {meta!r}") from None
    if dtype not in TQ_DTYPES or any(b < 0 for b in blobs) or any(s < 0 for s in shape):
        raise CliError(f"{where}: corrupt tq_jax metadata entry {meta!r}")
    if info.dtype != "U8" or len(info.shape) != 1 or info.shape[0] != sum(blobs):
        raise CliError(
            f"{where} should be a 1-D U8 tensor of {sum(blobs)} bytes (its blobs), but is "
            f"{info.dtype} of shape {list(info.shape)}: the file is corrupt."
        )
    out, off, n_el = [], 0, 0
    for i, nb in enumerate(blobs):
        try:
            # The whole blob, memory-mapped: a version-2 checksum covers all of it.
            h = tq_jax.peek_header(src.read(name, off, off + nb))
        except tq_jax.WireError as e:
            raise CliError(f"{where}, blob {i}: corrupt TQ01 blob: {e}") from None
        out.append((off, nb, h))
        off += nb
        n_el += math.prod(h.shape)
    if n_el != math.prod(shape) or (shape and out and any(h.shape[-1] != out[0][2].shape[-1] for _, _, h in out)):
        raise CliError(
            f"{where}: its blobs hold {n_el} values but the metadata says shape {list(shape)}: "
            f"the file is corrupt."
        )
    return out


def plan_decompress(src: Source, out: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> FilePlan:
    """Plan restoring every tensor of a compressed file.

    Raises:
        CliError: not a tq-jax file, or its metadata and blobs disagree.
    """
    doc = read_tq_metadata(src)
    if doc is None:
        raise CliError(
            f"{src.path} is not a tq-jax compressed file (no {META_KEY!r} metadata); nothing to decompress."
        )
    metas = doc["tensors"]
    entries = []
    for info in src.tensors.values():
        meta = metas.get(info.name)
        if meta is None:
            entries.append(Entry(info.name, info.dtype, info.shape, _raw_units(info, chunk_bytes)))
            continue
        headers = blob_headers(src, info.name, meta)
        itemsize = st.DTYPES[meta["dtype"]].itemsize
        units = []
        for off, nb, h in headers:
            n_out = math.prod(h.shape) * itemsize
            units.append(Unit("decode", info.name, meta["dtype"], off, off + nb, tuple(h.shape), n_out, nb))
        entries.append(Entry(info.name, meta["dtype"], tuple(meta["shape"]), tuple(units)))
    missing = sorted(set(metas) - set(src.tensors))
    if missing:
        raise CliError(f"{src.path}: tensor {missing[0]!r} is listed in the tq_jax metadata but missing from the file")
    metadata = {k: v for k, v in src.metadata.items() if k != META_KEY}
    plan = FilePlan("decompress", src.path, os.fspath(out), tuple(entries), metadata, doc)
    _check_numpy_output(plan)
    return plan


_NUMPY_CANNOT = ("BF16", "F8_E4M3", "F8_E5M2")


def _check_numpy_output(plan: FilePlan) -> None:
    """Refuse, before any work, an .npy/.npz OUT that cannot hold the plan's tensors."""
    ext = os.path.splitext(plan.out)[1].lower()
    if ext not in (".npy", ".npz"):
        return
    if ext == ".npy" and len(plan.entries) != 1:
        raise CliError(
            f"{plan.out}: a .npy file holds exactly one tensor, this output has {len(plan.entries)}; "
            f"write .safetensors or .npz."
        )
    for e in plan.entries:
        if e.dtype in _NUMPY_CANNOT:
            raise CliError(
                f"{plan.out}: {ext} cannot record dtype {e.dtype} (tensor {e.name!r}); write .safetensors instead."
            )


# --------------------------------------------------------------------------- writers


class _NpyWriter:
    """Sequential writer of one .npy array (header, then data), atomically."""

    def __init__(self, path, specs, metadata=None):
        if len(specs) != 1:
            raise CliError(f"{path}: a .npy file holds exactly one tensor, this output has {len(specs)}; write .safetensors or .npz.")
        self.path = os.fspath(path)
        name, dtype, shape = specs[0]
        self._atomic = st.AtomicFile(self.path)
        self.tmp_path = self._atomic.tmp_path
        self._f = self._atomic.file
        try:
            _write_npy_header(self._f, dtype, shape, self.path)
        except BaseException:
            self.abort()
            raise

    def write(self, data):
        self._f.write(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)))

    def commit(self):
        self._atomic.commit()

    def abort(self):
        self._atomic.abort()


def _write_npy_header(f, dtype: str, shape, what):
    dt = st.DTYPES[dtype]
    if dtype in ("BF16", "F8_E4M3", "F8_E5M2"):
        raise CliError(f"{what}: .npy/.npz cannot record dtype {dtype}; write .safetensors instead.")
    np.lib.format.write_array_header_2_0(
        f, {"descr": np.lib.format.dtype_to_descr(dt), "fortran_order": False, "shape": tuple(shape)}
    )


class _NpzWriter:
    """Sequential writer of an .npz (stored zip of .npy members), atomically."""

    def __init__(self, path, specs, metadata=None):
        self.path = os.fspath(path)
        self.specs = list(specs)
        for name, dtype, _ in self.specs:
            if dtype in ("BF16", "F8_E4M3", "F8_E5M2"):
                raise CliError(f"{path}: .npz cannot record dtype {dtype} (tensor {name!r}); write .safetensors instead.")
        self._atomic = st.AtomicFile(self.path)
        self.tmp_path = self._atomic.tmp_path
        try:
            self._zip = zipfile.ZipFile(self._atomic.file, "w", zipfile.ZIP_STORED, allowZip64=True)
        except BaseException:
            self._atomic.abort()
            raise
        self._i = -1
        self._left = 0
        self._m = None
        self._next()

    def _next(self):
        while self._left == 0:
            if self._m is not None:
                self._m.close()
                self._m = None
            self._i += 1
            if self._i >= len(self.specs):
                return
            name, dtype, shape = self.specs[self._i]
            self._m = self._zip.open(name + ".npy", "w", force_zip64=True)
            _write_npy_header(self._m, dtype, shape, self.path)
            self._left = math.prod(shape) * st.DTYPES[dtype].itemsize
            if self._left == 0:
                continue

    def write(self, data):
        mv = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        while len(mv):
            if self._m is None:
                raise ValueError("npz writer: more bytes than the declared tensors hold")
            n = min(self._left, len(mv))
            self._m.write(mv[:n])
            mv = mv[n:]
            self._left -= n
            self._next()

    def commit(self):
        if self._m is not None:
            raise ValueError("npz writer: output incomplete")
        self._zip.close()  # writes the central directory; leaves the file open
        self._atomic.commit()

    def abort(self):
        try:
            if self._m is not None:
                self._m.close()
            self._zip.close()
        except Exception:
            pass
        self._atomic.abort()


def open_writer(plan: FilePlan, specs=None, metadata=None):
    """A sequential, atomic writer for ``plan.out``; its format follows the extension.

    ``specs``/``metadata`` default to the plan's (final when sizes are known ahead).
    """
    if specs is None:
        specs = [(e.name, e.dtype, e.shape) for e in plan.entries]
        metadata = plan.metadata
    ext = os.path.splitext(plan.out)[1].lower()
    if plan.mode == "compress" or ext not in (".npy", ".npz"):
        return st.SafetensorsWriter(plan.out, specs, metadata, plan.header_size)
    return (_NpyWriter if ext == ".npy" else _NpzWriter)(plan.out, specs, metadata)


# --------------------------------------------------------------------------- running


def byte_view(data) -> memoryview:
    """A flat byte view of bytes or an array (no copy for contiguous arrays)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return memoryview(data).cast("B")


def produce(src: Source, unit: Unit, devices) -> np.ndarray | bytes:
    """The output bytes of one unit (an array or bytes of exactly ``unit.nbytes``)."""
    import tq_jax

    where = f"{src.path}: tensor {unit.name!r}"
    if unit.kind == "raw":
        return src.read(unit.name, unit.start, unit.stop)
    if unit.kind == "encode":
        x = src.read(unit.name, unit.start, unit.stop).reshape(unit.shape)
        try:
            blob = tq_jax.dumps(x, device=devices, **dict(unit.options))
        except tq_jax.NormOverflowError as e:
            raise CliError(f"{where}: {e}") from None
        return blob
    if unit.kind == "decode":
        blob = src.read(unit.name, unit.start, unit.stop)
        out = np.empty(unit.shape, st.DTYPES[unit.dtype])
        try:
            tq_jax.load_into(blob, out, device=devices)
        except tq_jax.WireError as e:
            raise CliError(f"{where}: corrupt TQ01 blob at byte {unit.start}: {e}") from None
        return out
    raise ValueError(f"unknown unit kind {unit.kind!r}")


class Progress:
    """Bytes-based progress with MB/s on stderr: tqdm when installed, else a plain line."""

    def __init__(self, total: int, desc: str, quiet: bool = False):
        self.total, self.desc, self.quiet = total, desc, quiet
        self.done = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._bar = None
        if quiet:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                         file=sys.stderr, leave=True, dynamic_ncols=True)

    def update(self, n: int) -> None:
        self.done += n
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last >= 0.5 or self.done >= self.total:
            self._last = now
            self._line(end="\r")

    def _line(self, end):
        dt = max(time.perf_counter() - self.t0, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        sys.stderr.write(
            f"{self.desc}: {pct:5.1f}% {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
            f"{self.done / 1e6 / dt:,.1f} MB/s{end}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            self._line(end="\n")


def run_local(plan: FilePlan, src: Source, devices,
              progress: Callable[[int], None] = lambda n: None) -> None:
    """Write ``plan.out`` in one process, unit by unit, atomically."""
    w = open_writer(plan)
    try:
        sizes = {}
        for ei, e in enumerate(plan.entries):
            for ui, u in enumerate(e.units):
                data = byte_view(produce(src, u, devices))
                w.write(data)
                if u.kind != "raw":
                    sizes[ei, ui] = len(data)
                del data
                progress(u.in_nbytes)
        specs, metadata = plan.finalize(sizes)
        if plan.header_size is not None:
            w.commit(specs, metadata)
        else:
            w.commit()
    except BaseException:
        w.abort()
        raise
