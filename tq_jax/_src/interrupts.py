"""Signals while a command runs: SIGINT/SIGTERM end the process at once, cleanly.

Used by the ``tq-jax`` command (:func:`tq_jax._src.cli.main`) around everything it does and
by the code it runs (:mod:`tq_jax._src.batch`, :mod:`tq_jax._src.distributed` register cleanups
through :meth:`Interrupts.at_exit`). Standard library only: it is installed before
numpy and JAX are imported, so a Ctrl-C during JAX's seconds-long import is handled too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["Interrupts"]


class Interrupts:
    """While a command runs, SIGINT and SIGTERM end the process at once, cleanly.

    On either signal: delete the temporary file of every unfinished output
    (:func:`safetensors_io.remove_temp_files`) and run the registered cleanups, print
    one line on stderr, and end with ``os._exit(128 + signum)`` — 130 for Ctrl-C, 143
    for SIGTERM. No exception unwinds and the interpreter is not torn down: a
    ``KeyboardInterrupt`` can be swallowed (raised inside a garbage-collector callback
    such as JAX's it is only printed as "Exception ignored"), and tearing the
    interpreter down while XLA's threads still run could crash (SIGSEGV).

    Python runs a signal handler only between bytecodes of the main thread, which can
    sit in one XLA call for seconds, so the Python-level handler does nothing and a
    watcher thread does the work, woken through :func:`signal.set_wakeup_fd` (written
    by the C-level handler the moment the signal arrives).

    Installed only from the main thread (``signal`` allows nothing else) and by the
    outermost ``with`` (the command's ``main``); leaving it restores the previous handlers.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    active: "Interrupts | None" = None  # the installed one

    def __init__(self, prog: str = "tq-jax"):
        self.prog = prog  # names the command in the one line printed on a signal
        self._cleanups: list = []
        self._lock = threading.Lock()
        self._saved = None

    @classmethod
    def at_exit(cls, fn) -> None:
        """Call ``fn()`` (best effort) if a signal ends the process during this command."""
        if cls.active is not None:
            cls.active._cleanups.append(fn)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread() or Interrupts.active is not None:
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            old = {s: signal.signal(s, self._note) for s in self.SIGNALS}
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return self
        self._saved = (old_fd, old, w)
        Interrupts.active = self
        threading.Thread(target=self._watch, args=(r,), name="tq-jax-signals", daemon=True).start()
        return self

    def __exit__(self, *exc):
        if self._saved is None:
            return
        old_fd, old, w = self._saved
        self._saved = None
        Interrupts.active = None
        for s, h in old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(old_fd)
        os.close(w)  # the watcher reads end-of-file and stops

    @staticmethod
    def _note(signum, frame):
        pass  # the watcher thread acts: this handler only makes the C handler wake it

    def _watch(self, r: int) -> None:
        try:
            while data := os.read(r, 64):
                for signum in data:
                    if signum in self.SIGNALS:
                        self._end(signum)
        finally:
            os.close(r)

    def _end(self, signum: int) -> None:
        self._lock.acquire()  # never released: the process ends here
        for fn in reversed(self._cleanups):
            try:
                fn()
            except Exception:
                pass
        # Not imported, or still importing (a signal during the import): no writer has started.
        remove = getattr(sys.modules.get("tq_jax._src.safetensors_io"), "remove_temp_files", None)
        if remove is not None:
            try:
                remove()
            except Exception:
                pass
        what = "interrupted" if signum == signal.SIGINT else f"terminated by {signal.Signals(signum).name}"
        try:  # os.write: the main thread may hold sys.stderr's lock mid-write
            os.write(2, f"\n{self.prog}: {what}\n".encode())
        except OSError:
            pass
        os._exit(128 + signum)
