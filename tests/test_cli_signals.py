"""Ctrl-C and SIGTERM end `tq-jax compress` at once: rc 130/143, one line, no partial output.

Each case runs the real command in a subprocess on a 50 MB input, its stderr a terminal
(a pty, so the progress bar is drawn as for a person; into a pipe the command logs one
line per file instead), and signals it at a
fixed delay after start (0.3 s: still importing), once its progress bar shows (planning and
compiling), once the bar counts a first chunk (mid-compress), or once its temporary output
file exists (mid-write). Moments are states of the job, not clock times, wherever the job
could be over by then: a fast machine runs the whole compress in under 1.5 s.
"""

import errno
import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import numpy as np
import pytest

from tq_jax._src import safetensors_io as st

from conftest import sweep


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("sig") / "big.safetensors"
    x = np.random.default_rng(0).standard_normal((2, 24, 256, 8, 128), dtype=np.float32)  # 48 MiB
    st.save_file({"kv": x, "ids": np.arange(7)}, path)
    return path


def _signal_compress(big, out_dir, when, signum=signal.SIGINT):
    """Run compress, signal it ``when`` (seconds after start, "progress": once its progress
    bar shows, "mid-compress": once the bar counts a first chunk done, "mid-write": once its
    temporary output exists); return (rc, stderr, seconds
    from the signal to the exit, files left in the output directory, signals sent)."""
    os.makedirs(out_dir)
    out = out_dir / "o.safetensors"
    t0 = time.monotonic()
    terminal, stderr = pty.openpty()  # the bar is drawn only for a terminal
    fcntl.ioctl(stderr, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns: room for the bar
    p = subprocess.Popen([sys.executable, "-m", "tq_jax", "compress", str(big), str(out), "--chunk-mb", "8"],
                         stdout=subprocess.DEVNULL, stderr=stderr)
    os.close(stderr)
    err = bytearray()

    def read() -> bytes:
        try:
            return os.read(terminal, 4096)
        except OSError as e:  # EIO: the process has exited and closed the pty
            if e.errno == errno.EIO:
                return b""
            raise

    reader = threading.Thread(target=lambda: [err.extend(b) for b in iter(read, b"")])
    reader.start()
    try:
        ready = {
            "progress": lambda: b"compress big.safetensors" in err,
            "mid-compress": lambda: re.search(rb"\| *[1-9][0-9.]*[kMG]?/", err) is not None,
            "mid-write": lambda: any(n.endswith(".tmp") for n in os.listdir(out_dir)),
        }.get(when, lambda: time.monotonic() - t0 >= when)
        while not ready():
            assert p.poll() is None and time.monotonic() - t0 < 60, f"never reached {when!r}: {bytes(err)!r}"
            time.sleep(0.01)
        assert p.poll() is None, "the job ended before the signal: make the input larger"
        if out.exists():  # written and renamed: only the interpreter's exit is left
            p.wait(timeout=60)
            pytest.skip(f"the job had written its output {time.monotonic() - t0:.1f} s in, before the signal: nothing to interrupt")
        p.send_signal(signum)
        t_sig = time.monotonic()
        sent = 1
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:  # swallowed: a second one, to end the test quickly
            p.send_signal(signum)
            sent = 2
            p.wait(timeout=60)
        took = time.monotonic() - t_sig
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        reader.join()
        os.close(terminal)
    return p.returncode, err.decode(errors="replace"), took, sorted(os.listdir(out_dir)), sent


@pytest.mark.parametrize("when", sweep(["mid-write", 0.3, "mid-compress", "progress"]))  # quick tier: mid-write
def test_ctrl_c_ends_the_job_with_130_and_no_output(big, tmp_path, when):
    rc, err, took, left, sent = _signal_compress(big, tmp_path / "out", when)
    assert (rc, sent) == (130, 1), err
    assert not left, f"left behind: {left}"
    assert took < 3, f"{took:.1f} s from SIGINT to exit"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip().splitlines()[-1].startswith("tq-jax: interrupted"), err


@pytest.mark.slow
def test_sigterm_mid_write_ends_with_143_and_no_output(big, tmp_path):
    rc, err, took, left, sent = _signal_compress(big, tmp_path / "out", "mid-write", signal.SIGTERM)
    assert (rc, sent, left) == (143, 1, []), err
    assert took < 3 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("tq-jax: terminated by SIGTERM"), err
