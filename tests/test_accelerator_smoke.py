"""`python -m benchmarks.accelerator` runs end to end on CPU (tiny sizes, interpreted Pallas), so
the prepared accelerator script cannot rot between the runs on a GPU."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_cpu_smoke_runs_every_step_and_writes_one_table(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.accelerator", "--cpu-smoke", "--out", str(tmp_path), "--commit", "abc123"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "accelerator_cpu_smoke.md").read_text()
    assert "Commit: abc123" in text and "--cpu-smoke" in text
    passed, total = map(int, re.search(r"(\d+) of (\d+) checks passed", text).groups())
    assert passed == total >= 10  # codec bytes/values and kvcache bytes/attend, both impls
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| [234] ", line)]
    steps = {r[0].strip() for r in rows}
    assert steps == {"2 codec", "3 attend", "4 model"}
    for step, case, what, ms, *_ in rows:  # every row was measured, none failed
        assert "FAILED" not in what and "not routed" not in what, what
        assert float(ms) > 0, (step, case, what)
    whats = " ".join(r[2] for r in rows)
    for name in ("dumps(jax.Array)", "loads(device=d)", "kvcache xla", "kvcache pallas_gpu",
                 "jax.nn.dot_product_attention", "einsum", "tokens/s", "attend impl=pallas_gpu"):
        assert name in whats, name
