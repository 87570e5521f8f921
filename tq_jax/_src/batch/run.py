"""Running a plan in one process, with progress.

:func:`run_local` produces each unit in plan order (:func:`produce`: copy, encode or
decode one chunk) and streams it to the output's atomic writer, so memory holds about
one chunk at a time; the output appears only once complete. :class:`Progress` reports
input bytes done on stderr.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import numpy as np

from tq_jax._src import safetensors_io as st
from tq_jax._src.batch.errors import BatchError
from tq_jax._src.batch.writers import open_writer

__all__ = ["byte_view", "produce", "unit_device", "Progress", "run_local", "LOG_EVERY"]

LOG_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal (a log)


def byte_view(data) -> memoryview:
    """A flat byte view of bytes or an array (no copy for contiguous arrays)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return memoryview(data).cast("B")


def unit_device(devices, turn: int, executor: str | None = None):
    """Where one unit is encoded or decoded: on accelerators (devices that take the device
    path, :func:`tq_jax._src.blob.takes`: a GPU or TPU host, or any device with
    ``executor`` ``"program"``) one device, the units dealt to them in turn, so that each
    unit runs as one compiled program there (:mod:`tq_jax._src.program`); on CPU devices
    the list, whose blocks the host block driver deals out."""
    from tq_jax._src import blob

    if all(blob.takes(d, executor) for d in devices):
        return devices[turn % len(devices)]
    return devices


def produce(src, unit, devices, turn: int = 0, executor: str | None = None) -> np.ndarray | bytes:
    """The output bytes of one :class:`~tq_jax._src.batch.plan.Unit` (exactly ``unit.nbytes``
    for raw and decode units; an encode unit's blob may differ from its estimate),
    computed where :func:`unit_device` puts unit number ``turn``, by ``executor``
    (:func:`tq_jax.dumps`'; None: chosen by the device).

    Raises:
        BatchError: a norm that float16 cannot hold (encode), or a corrupt blob (decode).
    """
    import tq_jax

    devices = unit_device(devices, turn, executor)
    where = f"{src.path}: tensor {unit.name!r}"
    if unit.kind == "raw":
        return src.read(unit.name, unit.start, unit.stop)
    if unit.kind == "encode":
        x = src.read(unit.name, unit.start, unit.stop).reshape(unit.shape)
        try:
            blob = tq_jax.dumps(x, options=unit.options, device=devices, executor=executor)
        except tq_jax.NormOverflowError as e:
            raise BatchError(f"{where}: {e}") from None
        return blob
    if unit.kind == "decode":
        blob = src.read(unit.name, unit.start, unit.stop)
        out = np.empty(unit.shape, st.DTYPES[unit.dtype])
        try:
            tq_jax.load_into(blob, out, device=devices, executor=executor)
        except tq_jax.WireError as e:
            raise BatchError(f"{where}: corrupt TQ01 blob at byte {unit.start}: {e}") from None
        return out
    raise ValueError(f"unknown unit kind {unit.kind!r}")


class Progress:
    """Bytes-based progress with MB/s on stderr, drawn for a terminal, logged otherwise.

    On a terminal (``stream.isatty()``): a tqdm bar when tqdm is installed, else one
    plain line redrawn in place (``\\r``) at most twice a second and once at 100 %. Not on a
    terminal (a log file, a pipe, CI): no bar and no ``\\r``; one line when
    :meth:`close` is called (one line per file) and, for a file that takes longer, one
    line every :data:`LOG_EVERY` seconds before it, so a log stays readable line by line.
    ``quiet`` prints nothing.

    Args:
        total: input bytes reported on (a file's, or a process's share of a distributed job).
        desc: the label each line starts with (``"compress model.safetensors"``).
        quiet: print nothing.
        stream: where to write; default ``sys.stderr`` (looked up when created).
    """

    def __init__(self, total: int, desc: str, quiet: bool = False, stream=None):
        self.total, self.desc, self.quiet = total, desc, quiet
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self.tty = _isatty(self.stream)  # whether a bar can be redrawn in place
        self.t0 = time.perf_counter()
        self._last = 0.0 if self.tty else self.t0
        self._bar = None
        if quiet or not self.tty:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                         file=self.stream, leave=True, dynamic_ncols=True)

    def update(self, n: int) -> None:
        self.done += n
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last >= 0.5 or self.done >= self.total:
                self._last = now
                self._line(end="\r")
        elif now - self._last >= LOG_EVERY and self.done < self.total:  # close() prints the last line
            self._last = now
            self._line(end="\n")

    def _line(self, end):
        dt = max(time.perf_counter() - self.t0, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        self.stream.write(
            f"{self.desc}: {pct:5.1f}% {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
            f"{self.done / 1e6 / dt:,.1f} MB/s{end}"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            self._line(end="\n")


def _isatty(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


def run_local(plan, src, devices, progress: Callable[[int], None] = lambda n: None) -> None:
    """Write ``plan.out`` in one process, unit by unit, atomically.

    Args:
        plan: a :class:`~tq_jax._src.batch.plan.FilePlan` of ``src``.
        src: the open :class:`~tq_jax._src.batch.sources.Source`.
        devices: where the codec runs (passed to :func:`tq_jax.dumps`/``load_into``).
        progress: called with each unit's input bytes once it is written.
    """
    w = open_writer(plan)
    try:
        sizes = {}
        turn = 0
        for ei, e in enumerate(plan.entries):
            for ui, u in enumerate(e.units):
                data = byte_view(produce(src, u, devices, turn))
                turn += u.kind != "raw"
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
