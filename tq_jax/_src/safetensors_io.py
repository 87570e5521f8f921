"""A minimal, strict safetensors reader and writer in numpy, built for streaming.

The format (https://github.com/huggingface/safetensors)::

    N         u64 little-endian     length of the JSON header
    header    N bytes, UTF-8 JSON   {"__metadata__": {str: str},          (optional)
                                     name: {"dtype": "BF16", "shape": [..],
                                            "data_offsets": [begin, end]}, ...}
    buffer    the tensors' bytes, C order, little-endian; offsets are relative
              to the buffer's start and must tile it exactly

Reading never loads a file: :meth:`SafetensorsReader.read` maps just the element range
asked for (``np.memmap``), so a caller that walks a tensor chunk by chunk and drops each
chunk keeps its resident memory at one chunk, whatever the file size.

:func:`parse_header` checks untrusted bytes in a fixed order, as the reference Rust
implementation does: the 8-byte prefix is present, N is within
:data:`MAX_HEADER_SIZE` and within the file, the header is UTF-8 JSON starting with
``{``, every entry has exactly the fields it should with the right types, dtypes are
known, sizes are computed with Python ints and each tensor's byte length equals
``prod(shape) * itemsize``, and finally "the offsets cover the buffer exactly" (sorted
by begin, each begin the previous end, the last end the buffer's length). Each cause
has its own :class:`SafetensorsError` subclass (all ``ValueError``).

:class:`SafetensorsWriter` takes the full list of (name, dtype, shape) up front, writes
the header, then accepts the tensors' bytes in order, in pieces of any size, into a
temporary file in the destination's directory; only a complete file is renamed over
the destination (``os.replace``), so a crash or an error never leaves a half-written
file behind. The temporary file is created like ``open(path, "w")`` creates a file —
mode ``0o666`` less the process umask — so the output gets the permissions ``cp`` would
give it (a ``tempfile.mkstemp`` file would keep its private ``0o600`` through the
rename). :class:`AtomicFile` is that mechanism on its own, shared with the numpy
writers of :mod:`tq_jax._src.batch.writers`; :func:`remove_temp_files` lets a signal handler delete every unfinished one.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
import threading
from typing import Iterable, NamedTuple

import ml_dtypes
import numpy as np

__all__ = [
    "MAX_HEADER_SIZE",
    "DTYPES",
    "SafetensorsError",
    "TruncatedFileError",
    "HeaderTooLargeError",
    "InvalidHeaderError",
    "InvalidDtypeError",
    "TensorSizeError",
    "InvalidOffsetsError",
    "AtomicFile",
    "remove_temp_files",
    "TensorInfo",
    "Header",
    "parse_header",
    "header_bytes",
    "SafetensorsReader",
    "SafetensorsWriter",
    "dtype_name",
    "load_file",
    "save_file",
]

MAX_HEADER_SIZE = 100_000_000  # the reference implementation's limit
METADATA_KEY = "__metadata__"
_U64 = struct.Struct("<Q")

# safetensors dtype name -> numpy dtype (little-endian). bfloat16 and float8 come from
# ml_dtypes, jax's own dependency (the same dtype objects as jax.numpy's; no jax import).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
_NAMES_BY_DTYPE = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """A file is not valid safetensors. Subclasses name the cause."""


class TruncatedFileError(SafetensorsError):
    """The file ends before the 8-byte length prefix or the header it declares."""


class HeaderTooLargeError(SafetensorsError):
    """The declared header length exceeds MAX_HEADER_SIZE."""


class InvalidHeaderError(SafetensorsError):
    """The header is not UTF-8 JSON of the expected structure."""


class InvalidDtypeError(SafetensorsError):
    """A tensor's dtype is not one this module reads."""


class TensorSizeError(SafetensorsError):
    """A tensor's byte range disagrees with prod(shape) * itemsize."""


class InvalidOffsetsError(SafetensorsError):
    """The tensors' byte ranges overlap, leave gaps, or do not end at the buffer's end."""


class TensorInfo(NamedTuple):
    """One tensor's entry in the header.

    Attributes:
        name: the tensor's name.
        dtype: safetensors dtype name ("BF16", "F32", ...).
        shape: tuple of Python ints.
        begin: byte offset of the tensor's data from the start of the buffer.
        end: one past its last byte.
    """

    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


class Header(NamedTuple):
    """A parsed header: tensors in buffer order, metadata, and where the buffer starts."""

    tensors: dict  # name -> TensorInfo, ordered by begin offset
    metadata: dict  # str -> str
    data_start: int  # 8 + N
    buffer_nbytes: int


def dtype_name(dtype) -> str:
    """The safetensors name of a numpy dtype ("F32", "BF16", ...)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise InvalidDtypeError(
            f"dtype {dt} is big-endian; safetensors stores little-endian data: convert with "
            f"array.astype(array.dtype.newbyteorder('<')) first."
        )
    name = _NAMES_BY_DTYPE.get(dt)
    if name is None:
        raise InvalidDtypeError(
            f"dtype {dt} has no safetensors equivalent here; supported: {', '.join(DTYPES)}."
        )
    return name


# --------------------------------------------------------------------------- parsing


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise InvalidHeaderError(f"safetensors header has the key {k!r} twice: the header is corrupt.")
        out[k] = v
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_entry(name, entry) -> tuple:
    if not isinstance(entry, dict):
        raise InvalidHeaderError(f"safetensors entry {name!r} must be a JSON object, got {type(entry).__name__}.")
    keys = set(entry)
    if keys != {"dtype", "shape", "data_offsets"}:
        raise InvalidHeaderError(
            f"safetensors entry {name!r} must have exactly the fields dtype, shape, data_offsets; "
            f"got {sorted(keys)}."
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise InvalidHeaderError(f"safetensors entry {name!r}: dtype must be a string, got {dtype!r}.")
    if dtype not in DTYPES:
        raise InvalidDtypeError(
            f"safetensors entry {name!r} has dtype {dtype!r}, which this reader does not support "
            f"(supported: {', '.join(DTYPES)})."
        )
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise InvalidHeaderError(
            f"safetensors entry {name!r}: shape must be a list of non-negative integers, got {shape!r}."
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
    ):
        raise InvalidHeaderError(
            f"safetensors entry {name!r}: data_offsets must be [begin, end] with non-negative "
            f"integers, got {offsets!r}."
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def parse_header(header: bytes, file_size: int) -> Header:
    """Validate a safetensors header.

    Args:
        header: at least the file's first ``8 + N`` bytes (more is ignored).
        file_size: the whole file's length in bytes.

    Returns:
        :class:`Header`.

    Raises:
        SafetensorsError: one subclass per cause (see the module docstring).
    """
    if file_size < _U64.size or len(header) < _U64.size:
        raise TruncatedFileError(
            f"not a safetensors file: it has {file_size} bytes, fewer than the 8-byte header length prefix."
        )
    (n,) = _U64.unpack_from(header, 0)
    if n > MAX_HEADER_SIZE:
        raise HeaderTooLargeError(
            f"safetensors header length {n} exceeds MAX_HEADER_SIZE={MAX_HEADER_SIZE}: the file is "
            f"corrupt or not safetensors."
        )
    if _U64.size + n > file_size or len(header) < _U64.size + n:
        raise TruncatedFileError(
            f"safetensors header declares {n} bytes but the file has only {file_size - _U64.size} "
            f"after the length prefix: the file is truncated or not safetensors."
        )
    raw = bytes(header[_U64.size : _U64.size + n])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidHeaderError(f"safetensors header is not UTF-8 ({e.reason} at byte {e.start}).") from None
    if not text.startswith("{"):
        raise InvalidHeaderError("safetensors header does not start with '{': the file is corrupt or not safetensors.")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise InvalidHeaderError(f"safetensors header is not valid JSON: {e.msg} at character {e.pos}.") from None
    if not isinstance(obj, dict):
        raise InvalidHeaderError("safetensors header must be a JSON object.")

    metadata = obj.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidHeaderError("safetensors __metadata__ must be an object mapping strings to strings.")

    buffer_nbytes = file_size - _U64.size - n
    entries = []
    for name, entry in obj.items():
        dtype, shape, begin, end = _parse_entry(name, entry)
        # Python ints: no wrap-around; bail out as soon as the product passes the buffer.
        count = 1
        for s in shape:
            count *= s
            if count * DTYPES[dtype].itemsize > buffer_nbytes:
                break
        if end < begin or end - begin != count * DTYPES[dtype].itemsize:
            raise TensorSizeError(
                f"safetensors tensor {name!r} ({dtype}, shape {list(shape)}) needs "
                f"{count * DTYPES[dtype].itemsize} bytes but data_offsets [{begin}, {end}] give "
                f"{end - begin}: the header is corrupt."
            )
        entries.append(TensorInfo(name, dtype, shape, begin, end))

    entries.sort(key=lambda t: (t.begin, t.end))
    pos = 0
    for t in entries:
        if t.begin != pos:
            what = "overlaps the previous tensor" if t.begin < pos else "leaves a gap after the previous tensor"
            raise InvalidOffsetsError(
                f"safetensors tensor {t.name!r} starts at byte {t.begin}, expected {pos}: it {what}."
            )
        pos = t.end
    if pos != buffer_nbytes:
        raise InvalidOffsetsError(
            f"safetensors tensors cover {pos} bytes but the buffer after the header has "
            f"{buffer_nbytes}: the file is truncated or has trailing bytes."
        )
    return Header({t.name: t for t in entries}, metadata, _U64.size + n, buffer_nbytes)


def header_bytes(specs: Iterable[tuple], metadata: dict | None = None,
                 size: int | None = None) -> tuple[bytes, list[TensorInfo]]:
    """The 8-byte prefix and JSON header for tensors laid out in the order given.

    Args:
        specs: (name, dtype name, shape) triples, in buffer order.
        metadata: optional str -> str annotations.
        size: pad (with spaces, which JSON ignores) to exactly this many bytes,
            prefix included; default: the next multiple of 8.

    Returns:
        (prefix + padded header, [TensorInfo]).

    Raises:
        ValueError: the header does not fit ``size``.
    """
    obj: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        obj[METADATA_KEY] = dict(metadata)
    infos = []
    pos = 0
    for name, dtype, shape in specs:
        if not isinstance(name, str) or name == METADATA_KEY or name in obj:
            raise ValueError(f"tensor name {name!r} is reserved, duplicated or not a string")
        if dtype not in DTYPES:
            raise InvalidDtypeError(f"unknown safetensors dtype {dtype!r}; supported: {', '.join(DTYPES)}.")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {shape}")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        infos.append(TensorInfo(name, dtype, shape, pos, pos + nbytes))
        pos += nbytes
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if size is None:
        text += b" " * (-(len(text) + _U64.size) % 8)  # 8-byte align the buffer, as safetensors does
    elif _U64.size + len(text) <= size:
        text += b" " * (size - _U64.size - len(text))
    else:
        raise ValueError(f"safetensors header needs {_U64.size + len(text)} bytes, more than the {size} reserved")
    if len(text) > MAX_HEADER_SIZE:
        raise HeaderTooLargeError(f"header of {len(text)} bytes exceeds MAX_HEADER_SIZE={MAX_HEADER_SIZE}")
    return _U64.pack(len(text)) + text, infos


# --------------------------------------------------------------------------- reading


class SafetensorsReader:
    """Read-only access to a safetensors file without loading it.

    Examples:
        >>> with SafetensorsReader(path) as r:                      # doctest: +SKIP
        ...     for info in r.tensors.values():
        ...         chunk = r.read(info.name, 0, 1024)              # memory-mapped view
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self._f = open(self.path, "rb")
        try:
            size = os.fstat(self._f.fileno()).st_size
            head = self._f.read(_U64.size)
            if len(head) == _U64.size:
                (n,) = _U64.unpack(head)
                if n <= MAX_HEADER_SIZE and _U64.size + n <= size:
                    head += self._f.read(n)
            self.header = parse_header(head, size)
        except BaseException:
            self._f.close()
            raise
        self.file_size = size

    @property
    def tensors(self) -> dict:
        """name -> :class:`TensorInfo`, in buffer order."""
        return self.header.tensors

    @property
    def metadata(self) -> dict:
        return self.header.metadata

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` of tensor ``name``, flattened in C order.

        The result is a read-only ``np.memmap`` of just that range: its pages are read
        on access and released when the array is dropped.
        """
        info = self.tensors[name]
        dt = info.np_dtype
        stop = info.size if stop is None else stop
        if not 0 <= start <= stop <= info.size:
            raise IndexError(f"element range [{start}, {stop}) is outside tensor {name!r} of {info.size} elements")
        if stop == start:
            return np.empty(0, dt)
        offset = self.header.data_start + info.begin + start * dt.itemsize
        return np.memmap(self._f, dtype=dt, mode="r", offset=offset, shape=(stop - start,))

    def read_bytes(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of tensor ``name`` through a plain read (small reads)."""
        info = self.tensors[name]
        stop = info.nbytes if stop is None else min(stop, info.nbytes)
        start = min(start, stop)
        self._f.seek(self.header.data_start + info.begin + start)
        return self._f.read(stop - start)

    def array(self, name: str) -> np.ndarray:
        """The whole tensor as a memory-mapped array of its shape."""
        info = self.tensors[name]
        return self.read(name).reshape(info.shape)

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------- writing


# Temporary files of unfinished writers: their paths, for remove_temp_files.
_PENDING: set[str] = set()
_PENDING_LOCK = threading.RLock()


class AtomicFile:
    """A file that appears at ``path`` only once complete.

    Bytes go to a temporary file in ``path``'s directory (``.<name>.<random>.tmp``),
    created with mode ``0o666`` less the umask, as ``open(path, "wb")`` would create
    ``path`` itself; :meth:`commit` flushes, fsyncs and renames it over ``path``
    (``os.replace``), :meth:`abort` deletes it. Until one of them, its path is
    registered for :func:`remove_temp_files`.

    Attributes:
        path: the destination.
        tmp_path: the temporary file.
        file: the temporary file, open for binary writing (seekable).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.file = None
        directory = os.path.dirname(os.path.abspath(self.path))
        base = os.path.basename(self.path)
        with _PENDING_LOCK:  # registered before it exists: remove_temp_files misses none
            for _ in range(100):
                tmp = os.path.join(directory, f".{base}.{secrets.token_hex(4)}.tmp")
                try:
                    # Mode 0o666: the kernel applies the umask, as to any new file.
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
                except FileExistsError:
                    continue
                break
            else:
                raise FileExistsError(f"{directory}: could not create a unique temporary file for {base}")
            self.tmp_path = tmp
            _PENDING.add(tmp)
        try:
            self.file = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            self.abort()
            raise

    def commit(self) -> None:
        """Flush, fsync and rename the temporary file over ``path``."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp_path, self.path)
        with _PENDING_LOCK:
            _PENDING.discard(self.tmp_path)

    def abort(self) -> None:
        """Close and delete the temporary file; ``path`` is left as it was."""
        try:
            if self.file is not None:
                self.file.close()
        finally:
            try:
                os.unlink(self.tmp_path)
            except FileNotFoundError:
                pass
            with _PENDING_LOCK:
                _PENDING.discard(self.tmp_path)


def remove_temp_files() -> list[str]:
    """Delete the temporary file of every unfinished :class:`AtomicFile`; return their paths.

    For a signal handler that ends the process right after (``os._exit``) without
    unwinding the writers. The registry stays locked afterwards, so no writer can
    start a new temporary file before the process ends: call it only then.
    """
    _PENDING_LOCK.acquire()  # never released: the caller exits
    removed = []
    for p in sorted(_PENDING):
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            pass
    _PENDING.clear()
    return removed


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, atomically.

    The layout (names, dtypes, order) is fixed when the writer is created; :meth:`write`
    then takes the buffer's bytes in order, in pieces of any size. :meth:`commit`
    checks that every byte arrived and renames the temporary file over ``path``;
    :meth:`abort` (or leaving the ``with`` block by an exception) deletes it.

    When the tensors' sizes are only known once their bytes have been produced (a
    codec whose output length depends on the data), reserve room for the header with
    ``header_size`` and pass the final specs and metadata to :meth:`commit`: the header
    is then rewritten in place, padded with spaces to the same size.

    Args:
        path: destination file.
        specs: (name, dtype name, shape) triples in buffer order.
        metadata: optional str -> str annotations.
        header_size: bytes before the buffer (prefix included), a multiple of 8;
            default: just enough for this header.
    """

    def __init__(self, path, specs: Iterable[tuple], metadata: dict | None = None,
                 header_size: int | None = None):
        self.path = os.fspath(path)
        if header_size is not None and header_size % 8:
            raise ValueError(f"header_size must be a multiple of 8, got {header_size}")
        prefix, self.infos = header_bytes(specs, metadata, header_size)
        self.data_start = len(prefix)
        self.resizable = header_size is not None
        self.total = self.infos[-1].end if self.infos else 0
        self.written = 0
        self._atomic = AtomicFile(self.path)
        self.tmp_path = self._atomic.tmp_path
        self._f = self._atomic.file
        try:
            self._f.write(prefix)
        except BaseException:
            self.abort()
            raise

    def write(self, data) -> None:
        """Append the next bytes of the buffer (bytes-like or a C-contiguous array)."""
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        mv = memoryview(data).cast("B")
        if not self.resizable and self.written + len(mv) > self.total:
            raise ValueError(
                f"writing {len(mv)} bytes at {self.written} overruns the {self.total}-byte buffer "
                f"this file's header declares"
            )
        self._f.write(mv)
        self.written += len(mv)

    def commit(self, specs: Iterable[tuple] | None = None, metadata: dict | None = None) -> None:
        """Finish the file; with ``specs`` (and ``metadata``), first rewrite the header."""
        try:
            if specs is not None:
                if not self.resizable:
                    raise ValueError("new specs at commit need a writer created with header_size")
                prefix, infos = header_bytes(specs, metadata, self.data_start)
                self.total = infos[-1].end if infos else 0
                if self.written == self.total:
                    self._f.seek(0)
                    self._f.write(prefix)
            if self.written != self.total:
                raise ValueError(f"{self.written} buffer bytes were written but the header declares {self.total}; file not created")
            self._atomic.commit()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        self._atomic.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
        else:
            self.abort()


# --------------------------------------------------------------------------- helpers


def save_file(tensors: dict, path, metadata: dict | None = None) -> None:
    """Write a dict of numpy arrays (any order) as safetensors, atomically."""
    arrays = {k: np.asarray(v) for k, v in tensors.items()}
    specs = [(k, dtype_name(a.dtype), a.shape) for k, a in arrays.items()]
    with SafetensorsWriter(path, specs, metadata) as w:
        for a in arrays.values():
            w.write(np.ascontiguousarray(a))


def load_file(path) -> tuple[dict, dict]:
    """Read a whole safetensors file into memory: ({name: array}, metadata)."""
    with SafetensorsReader(path) as r:
        return {name: np.array(r.array(name)) for name in r.tensors}, dict(r.metadata)
