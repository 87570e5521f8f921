"""Progress of ``tq-jax compress``/``decompress``: a bar on a terminal, plain lines in a log.

When stderr is not a terminal (a pipe, a log file, CI) nothing is redrawn: no tqdm
fragments and no ``\\r``, one line per file (and one every ``LOG_EVERY`` seconds for a
file that takes longer). On a terminal the bar stays.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from tq_jax._src import batch
from tq_jax._src.batch import run as batch_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _write_inputs(tmp_path, names):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    paths = []
    for name in names:
        path = tmp_path / name
        save_file({"kv": rng.standard_normal((2, 4, 16, 2, 128)).astype(np.float32)}, str(path))
        paths.append(path)
    return paths


def _cli(*argv, cwd) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, stdout and stderr to pipes (not terminals)."""
    proc = subprocess.run([sys.executable, "-m", "tq_jax", *map(str, argv)], cwd=cwd, capture_output=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc


@pytest.mark.slow
def test_cli_progress_to_a_pipe_is_one_plain_line_per_file(tmp_path):
    a, b = _write_inputs(tmp_path, ["a.safetensors", "b.safetensors"])
    proc = _cli("compress", a, b, tmp_path / "c", cwd=tmp_path)
    err = proc.stderr.decode()
    assert "\r" not in err and "\x1b" not in err  # no redraws, no terminal escapes
    lines = [ln for ln in err.splitlines() if ln]
    assert [ln.split(":")[0] for ln in lines] == ["compress a.safetensors", "compress b.safetensors"], err
    for ln in lines:
        assert " 100.0% " in ln and ln.endswith("MB/s"), ln

    proc = _cli("decompress", tmp_path / "c" / "a.safetensors", tmp_path / "back.safetensors", cwd=tmp_path)
    err = proc.stderr.decode()
    assert "\r" not in err
    assert [ln.split(":")[0] for ln in err.splitlines() if ln] == ["decompress a.safetensors"], err


def test_not_a_terminal_prints_one_line_at_close():
    out = io.StringIO()  # isatty() is False
    p = batch.Progress(3_000_000, "compress x.safetensors", stream=out)
    for _ in range(3):
        p.update(1_000_000)
    assert out.getvalue() == ""  # nothing before the end of a file that took under LOG_EVERY
    p.close()
    text = out.getvalue()
    assert "\r" not in text and text.count("\n") == 1 and text.endswith(" MB/s\n")
    assert text.startswith("compress x.safetensors: 100.0% 3.0/3.0 MB ")


def test_not_a_terminal_logs_a_line_every_log_every_seconds(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(batch_run, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    out = io.StringIO()
    p = batch.Progress(4_000_000, "job", stream=out)
    for _ in range(4):  # each MB takes 6 s: lines at 12 s (2 MB) and 24 s (done: left to close)
        clock[0] += 6.0
        p.update(1_000_000)
    assert out.getvalue() == "job:  50.0% 2.0/4.0 MB 0.2 MB/s\n"
    p.close()
    assert out.getvalue().splitlines() == ["job:  50.0% 2.0/4.0 MB 0.2 MB/s", "job: 100.0% 4.0/4.0 MB 0.2 MB/s"]
    assert batch_run.LOG_EVERY == 10.0


def test_terminal_without_tqdm_redraws_in_place(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    out = _Terminal()
    p = batch.Progress(2_000_000, "job", stream=out)
    p.update(1_000_000)
    p.update(1_000_000)
    p.close()
    text = out.getvalue()
    assert text.startswith("job:  50.0% 1.0/2.0 MB") and "\rjob: 100.0% 2.0/2.0 MB" in text and text.endswith("\n")


def test_terminal_with_tqdm_draws_a_bar():
    pytest.importorskip("tqdm")
    out = _Terminal()
    p = batch.Progress(2_000_000, "job", stream=out)
    p.update(2_000_000)
    p.close()
    text = out.getvalue()
    assert "\r" in text and "job: 100%" in text  # tqdm's own format, redrawn


def test_quiet_prints_nothing_anywhere():
    for out in (io.StringIO(), _Terminal()):
        p = batch.Progress(10, "job", quiet=True, stream=out)
        p.update(10)
        p.close()
        assert out.getvalue() == ""
