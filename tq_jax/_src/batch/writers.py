"""Output files, written sequentially and atomically: safetensors, ``.npy``, ``.npz``.

Every writer takes the output's bytes in order, in pieces of any size, and keeps them
in a :class:`tq_jax._src.safetensors_io.AtomicFile` (the one temporary-file mechanism of the
package: mode ``0o666`` less the umask, renamed over the destination only by
``commit``, deleted by ``abort`` or by :func:`~tq_jax._src.safetensors_io.remove_temp_files`
from a signal handler). So the destination is either absent/unchanged or complete.

numpy files cannot record bfloat16 or float8 (:data:`NUMPY_CANNOT`), and a ``.npy``
holds exactly one array: :func:`check_numpy_output` refuses such an output before any
work, with the same message the writers give.
"""

from __future__ import annotations

import math
import os
import zipfile

import numpy as np

from tq_jax._src import safetensors_io as st
from tq_jax._src.batch.errors import BatchError

__all__ = ["NUMPY_CANNOT", "check_numpy_output", "open_writer"]

NUMPY_CANNOT = ("BF16", "F8_E4M3", "F8_E5M2")  # safetensors dtypes .npy/.npz cannot record


def check_numpy_output(path, specs) -> None:
    """Refuse an .npy/.npz ``path`` that cannot hold ``specs`` ((name, dtype, shape) triples).

    Does nothing for any other extension (safetensors holds every dtype).

    Raises:
        BatchError: a ``.npy`` for other than one tensor, or a dtype numpy cannot record.
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".npy", ".npz"):
        return
    specs = list(specs)
    if ext == ".npy" and len(specs) != 1:
        raise BatchError(
            f"{path}: a .npy file holds exactly one tensor, this output has {len(specs)}; "
            f"write .safetensors or .npz."
        )
    for name, dtype, _ in specs:
        if dtype in NUMPY_CANNOT:
            raise BatchError(
                f"{path}: {ext} cannot record dtype {dtype} (tensor {name!r}); write .safetensors instead."
            )


def _write_npy_header(f, dtype: str, shape) -> None:
    np.lib.format.write_array_header_2_0(
        f, {"descr": np.lib.format.dtype_to_descr(st.DTYPES[dtype]), "fortran_order": False, "shape": tuple(shape)}
    )


def _bytes(data) -> memoryview:
    return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


class _NpyWriter:
    """Sequential writer of one .npy array (version-2.0 header, then data), atomically."""

    def __init__(self, path, specs, metadata=None):
        self.path = os.fspath(path)
        check_numpy_output(self.path, specs)
        _, dtype, shape = specs[0]
        self._atomic = st.AtomicFile(self.path)
        self.tmp_path = self._atomic.tmp_path
        self._f = self._atomic.file
        try:
            _write_npy_header(self._f, dtype, shape)
        except BaseException:
            self.abort()
            raise

    def write(self, data):
        self._f.write(_bytes(data))

    def commit(self):
        self._atomic.commit()

    def abort(self):
        self._atomic.abort()


class _NpzWriter:
    """Sequential writer of an .npz (stored zip of .npy members), atomically."""

    def __init__(self, path, specs, metadata=None):
        self.path = os.fspath(path)
        self.specs = list(specs)
        check_numpy_output(self.path, self.specs)
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
            _write_npy_header(self._m, dtype, shape)
            self._left = math.prod(shape) * st.DTYPES[dtype].itemsize

    def write(self, data):
        mv = _bytes(data)
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


def open_writer(plan, specs=None, metadata=None):
    """A sequential, atomic writer for ``plan.out``; its format follows the extension.

    Compressed output is always safetensors (it carries the tq-jax metadata);
    decompressed output is ``.npy``/``.npz`` by extension, else safetensors.

    Args:
        plan: a :class:`~tq_jax._src.batch.plan.FilePlan`.
        specs: (name, dtype, shape) triples; default the plan's (final when the
            sizes are known ahead), with ``metadata`` default the plan's.
        metadata: str -> str annotations (safetensors only).
    """
    if specs is None:
        specs = [(e.name, e.dtype, e.shape) for e in plan.entries]
        metadata = plan.metadata
    ext = os.path.splitext(plan.out)[1].lower()
    if plan.mode == "compress" or ext not in (".npy", ".npz"):
        return st.SafetensorsWriter(plan.out, specs, metadata, plan.header_size)
    return (_NpyWriter if ext == ".npy" else _NpzWriter)(plan.out, specs, metadata)
