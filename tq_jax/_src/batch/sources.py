"""Input files, read chunk by chunk: safetensors, ``.npy`` and ``.npz``.

:func:`open_source` opens a file by its extension and lists its tensors (names,
safetensors dtype names, shapes) without reading their data; :meth:`Source.read` then
returns any run of a tensor's elements, memory-mapped where the file allows it
(safetensors, ``.npy``, stored ``.npz`` members), so reading a tensor chunk by chunk
keeps at most one chunk in memory. A deflated ``.npz`` member is read whole, and only
the latest one is kept.

``.npy`` headers (format versions 1.0, 2.0 and 3.0) are parsed with numpy's public
readers, and version 3.0 (UTF-8 field names, which numpy has no public reader for) by
:func:`read_npy_header` itself, with the same checks and limits.
"""

from __future__ import annotations

import ast
import math
import os
import struct
import zipfile
from typing import NamedTuple

import numpy as np

from tq_jax._src import frames
from tq_jax._src import safetensors_io as st
from tq_jax._src import wire
from tq_jax._src.batch.errors import BatchError
from tq_jax._src.wire import MAGIC

__all__ = ["Source", "open_source", "check_input", "read_npy_header", "MAX_NPY_HEADER_SIZE"]

# numpy's own limit for headers it parses without allow_pickle (characters).
MAX_NPY_HEADER_SIZE = 10_000
_NPY_KEYS = {"descr", "fortran_order", "shape"}
_NPY_ERRORS = (ValueError, OSError, SyntaxError, TypeError)


class _Npy(NamedTuple):
    shape: tuple
    dtype: np.dtype
    offset: int  # of the data, in the file


def _read_exactly(f, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"EOF: reading {what}, expected {n} bytes got {len(data)}")
    return data


def _clip(value, n: int = 200) -> str:
    """``repr(value)``, cut to ``n`` characters (a hostile header can be 10,000 long)."""
    r = repr(value)
    return r if len(r) <= n else r[:n] + "..."


def _read_npy_header_3_0(f, max_header_size: int = MAX_NPY_HEADER_SIZE) -> tuple:
    """(shape, fortran_order, dtype) from a version-3.0 header; ``f`` is just past the magic.

    Version 3.0 is 2.0 with a UTF-8 header: a little-endian uint32 length, then that
    many bytes holding a Python dict literal. The declared length is checked before
    anything is read; the text is parsed with :func:`ast.literal_eval` (literals only,
    never evaluated code) and validated as numpy validates versions 1.0 and 2.0.
    """
    (length,) = struct.unpack("<I", _read_exactly(f, 4, "array header length"))
    # A UTF-8 character is at most 4 bytes: a longer header cannot be within the limit.
    if length > 4 * max_header_size:
        raise ValueError(f"Header info length ({length} bytes) is large and may not be safe to load securely.")
    text = _read_exactly(f, length, "array header").decode("utf-8")
    if len(text) > max_header_size:
        raise ValueError(f"Header info length ({len(text)}) is large and may not be safe to load securely.")
    try:
        d = ast.literal_eval(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"Cannot parse header: {_clip(text)}") from e
    if not isinstance(d, dict):
        raise ValueError(f"Header is not a dictionary: {_clip(d)}")
    if d.keys() != _NPY_KEYS:
        raise ValueError(f"Header does not contain the correct keys: {_clip(sorted(d.keys(), key=repr))}")
    shape = d["shape"]
    if not isinstance(shape, tuple) or not all(isinstance(s, int) for s in shape):
        raise ValueError(f"shape is not valid: {_clip(shape)}")
    if not isinstance(d["fortran_order"], bool):
        raise ValueError(f"fortran_order is not a valid bool: {_clip(d['fortran_order'])}")
    try:
        dtype = np.lib.format.descr_to_dtype(d["descr"])
    except TypeError as e:
        raise ValueError(f"descr is not a valid dtype descriptor: {_clip(d['descr'])}") from e
    return shape, d["fortran_order"], dtype


def read_npy_header(f) -> tuple:
    """(shape, fortran_order, dtype) of the ``.npy`` array at ``f``'s position.

    Leaves ``f`` at the first data byte. Versions 1.0 and 2.0 go through numpy's
    public readers, 3.0 through :func:`_read_npy_header_3_0`; all three refuse headers
    over :data:`MAX_NPY_HEADER_SIZE` characters.

    Raises:
        ValueError: not a ``.npy`` array, an unknown version, or a malformed header.
    """
    fmt = np.lib.format
    version = fmt.read_magic(f)
    if version == (1, 0):
        return fmt.read_array_header_1_0(f, max_header_size=MAX_NPY_HEADER_SIZE)
    if version == (2, 0):
        return fmt.read_array_header_2_0(f, max_header_size=MAX_NPY_HEADER_SIZE)
    if version == (3, 0):
        return _read_npy_header_3_0(f)
    raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]} (this reader takes 1.0, 2.0, 3.0)")


def _npy_header(f, offset: int, what: str) -> _Npy:
    f.seek(offset)
    shape, dtype = _checked_header(f, what)
    return _Npy(shape, dtype, f.tell())


def _checked_header(f, what: str, fortran_ok: bool = False) -> tuple:
    """(shape, dtype) of the ``.npy`` array at ``f``'s position, or BatchError.

    Fortran order is refused unless ``fortran_ok`` (a member that is read whole, by
    numpy, and made C-contiguous): a memory-mapped array is read as C order.
    """
    try:
        shape, fortran, dtype = read_npy_header(f)
    except _NPY_ERRORS as e:
        raise BatchError(f"{what} is not a valid .npy array: {e}") from None
    if any(s < 0 for s in shape):
        raise BatchError(f"{what} is not a valid .npy array: negative dimension in shape {list(shape)}")
    if fortran and len(shape) > 1 and not fortran_ok:
        raise BatchError(f"{what} is stored in Fortran order; save it in C order (np.ascontiguousarray) first.")
    return tuple(int(s) for s in shape), dtype


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
        raise BatchError(f"{what}: unsupported dtype: {e}") from None
    nbytes = math.prod(shape) * dtype.itemsize
    return st.TensorInfo(name, dname, tuple(shape), 0, nbytes)


def _zip_member_offset(f, zinfo) -> int:
    """Where a stored zip member's bytes start (after its local file header)."""
    f.seek(zinfo.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise BatchError(f"corrupt .npz: bad local header for {zinfo.filename!r}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return zinfo.header_offset + 30 + name_len + extra_len


def check_input(path) -> str:
    """``path`` as a string, or BatchError if it is missing or a directory."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise BatchError(f"{path}: no such file")
    if os.path.isdir(path):
        raise BatchError(f"{path}: is a directory, expected a file")
    return path


def _open_npy(path) -> Source:
    f = open(path, "rb")
    try:
        loc = _npy_header(f, 0, path)
        size = os.fstat(f.fileno()).st_size
        name = os.path.splitext(os.path.basename(path))[0]
        info = _info(name, loc.dtype, loc.shape, f"{path}")
        if loc.offset + info.nbytes > size:
            raise BatchError(f"{path}: truncated .npy: needs {loc.offset + info.nbytes} bytes, has {size}")
    except BaseException:
        f.close()
        raise
    return Source(path, "npy", {name: info}, {}, arrays={name: loc}, f=f)


def _open_npz(path) -> Source:
    f = open(path, "rb")
    try:
        try:
            z = zipfile.ZipFile(f)
        except zipfile.BadZipFile as e:
            raise BatchError(f"{path}: not a valid .npz (zip) file: {e}") from None
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
                    raise BatchError(f"{what}: truncated .npz member")
                arrays[name] = loc
            else:
                with z.open(zi) as m:
                    shape, dtype = _checked_header(m, what, fortran_ok=True)
                info = _info(name, dtype, shape, what)
                arrays[name] = zi.filename
            tensors[name] = info
    except BaseException:
        f.close()
        raise
    return Source(path, "npz", tensors, {}, arrays=arrays, f=f)


BARE_BLOB = (
    "{path}: this is a bare TQ01 blob (one tensor's bytes, as tq_jax.dumps writes them), not a tensor file: "
    "compress/decompress read and write safetensors/.npy/.npz files. Decode it in Python with "
    "tq_jax.loads(open({path!r}, 'rb').read()), or run `tq-jax inspect {path}` to see its header."
)


KEY_BOUND_VALUE = (
    "{path}: this is a key-bound L2 value (a {blob:,}-byte TQ01 blob and the 20-byte TQK1 key trailer, as the "
    "tq_jax LMCache serde stores it with a checksum preset), not a tensor file: compress/decompress read and write "
    "safetensors/.npy/.npz files. Decode its blob in Python with tq_jax.loads(open({path!r}, 'rb').read()[:{blob}]) "
    "(the key binding is not verified: that needs the ObjectKey), or run `tq-jax inspect {path}` to see its header."
)
SEALED_VALUE = (
    "{path}: this is a sealed L2 value ({magic}: encrypted per tenant by the tq_jax LMCache serde's `encrypt` "
    "option), not a tensor file: nothing in it can be read without the master key. Load it through the serde with "
    "the same `encrypt` block; `tq-jax inspect {path}` shows its frame and size."
)
NOT_A_TENSOR_FILE = (
    "{path}: not a safetensors file or TQ01 blob: it starts with {head!r}, where a safetensors file has its "
    "header's length (8 bytes) and then '{{' and a TQ01 blob 'TQ01'. tq-jax reads safetensors files, and .npy "
    "and .npz files by their extension; `tq-jax inspect` also reads TQ01 blobs and stored LMCache values."
)


def _refuse_bare_blob(path: str) -> None:
    """A file starting with the TQ01 magic is a blob, not safetensors: say so (its first
    8 bytes would otherwise read as an absurd safetensors header length). A key-bound
    L2 value (blob + key trailer) and a sealed one (TQS1/TQS2) are named as such, and a
    file whose ninth byte is not the ``{`` of a safetensors header as none of them."""
    with open(path, "rb") as f:
        head = f.read(frames.SEAL_OVERHEAD)
    if frames.sealed_version(head) is not None:
        raise BatchError(SEALED_VALUE.format(path=path, magic=head[:4].decode()))
    if head[: len(MAGIC)] != MAGIC:
        if head[8:9] != b"{":  # a safetensors file: a little-endian u64 header length, then its JSON
            raise BatchError(NOT_A_TENSOR_FILE.format(path=path, head=head[:8]))
        return
    mm = np.memmap(path, np.uint8, mode="r")
    try:
        n = wire.blob_nbytes(wire.peek_header(mm))
    except wire.WireError:
        n = -1
    if n >= 0 and frames.ends_with_key_trailer(mm, n):
        raise BatchError(KEY_BOUND_VALUE.format(path=path, blob=n))
    raise BatchError(BARE_BLOB.format(path=path))


def open_source(path) -> Source:
    """Open an input file by its extension (.npy, .npz, anything else: safetensors).

    Raises:
        BatchError: missing, unreadable or corrupt file, unsupported dtype.
    """
    path = check_input(path)
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".npy":
            return _open_npy(path)
        if ext == ".npz":
            return _open_npz(path)
        _refuse_bare_blob(path)
        reader = st.SafetensorsReader(path)
        return Source(path, "safetensors", dict(reader.tensors), dict(reader.metadata), reader=reader)
    except st.SafetensorsError as e:
        raise BatchError(f"{path}: not a valid safetensors file: {e}") from None
    except PermissionError:
        raise BatchError(f"{path}: permission denied") from None
    except OSError as e:
        raise BatchError(f"{path}: cannot read: {e.strerror or e}") from None
