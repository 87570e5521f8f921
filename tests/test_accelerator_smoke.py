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
    for step, case, what, ms, *_ in rows:  # every row was measured (or checked), none failed
        assert "FAILED" not in what, what
        if "accuracy" in case:  # the bf16 mode's bound, checked on the device: no time
            assert "accuracy ok" in what, what
            continue
        assert float(ms) > 0, (step, case, what)
    whats = " ".join(r[2] for r in rows)
    for name in ("dumps(jax.Array) [program]", "dumps(jax.Array) [blocks]", "loads(device=d) [program]",
                 "loads(device=d) [blocks]", "device program encode", "device program decode",
                 "host-link floor: the blob's", "host-link: the tensor host->device",
                 "bridge encode: dump_into(host chunk, device=d) [program]",
                 "bridge decode: load_into(blob, host chunk, device=d) [program]", "kvcache xla", "kvcache pallas_gpu exact",
                 "kvcache pallas_gpu bf16", "bf16 mode accuracy ok", "jax.nn.dot_product_attention", "einsum",
                 "tokens/s", "attend impl=pallas_gpu exact", "attend impl=pallas_gpu bf16", "examples.smollm2's make_step"):
        assert name in whats, name
    cases = " ".join(r[1] for r in rows)
    for case in ("batch 1, 64 tokens 4/4", "batch 2, 64 tokens turbo-3.5", "batch 2, 8 tokens of context"):
        assert case in cases, case


def test_on_a_tpu_the_script_names_the_chip_and_runs_the_tpu_kernel(monkeypatch):
    """What a TPU changes in the script, decided without one: the product name and the
    spec-sheet bandwidth of JAX's device kinds, and the TPU kernel in the GPU kernel's place."""
    import types

    import jax

    from benchmarks import accelerator

    v5e, v6e, v5p = (types.SimpleNamespace(device_kind=k) for k in ("TPU v5 lite", "TPU v6 lite", "TPU v5"))
    assert [accelerator.device_label(d) for d in (v5e, v6e, v5p)] == [
        "TPU v5e (TPU v5 lite)", "TPU v6e (TPU v6 lite)", "TPU v5p (TPU v5)"]
    assert [accelerator.peak_gbs(d) for d in (v5e, v6e, v5p)] == [819, 1640, 2765]
    assert accelerator.peak_ms(819 * 10**6, v5e) == pytest.approx(1.0)  # 0.819 GB at 819 GB/s: 1 ms
    assert accelerator.peak_gbs(types.SimpleNamespace(device_kind="cpu")) is None
    assert accelerator.kernel_impl() == "pallas_gpu" and not accelerator.on_tpu()  # this CPU: the interpreted GPU kernel
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert accelerator.kernel_impl() == "pallas_tpu"
    impls = [impl for _, kind, _, impl, _ in accelerator.model_kinds() if kind == "tq"]
    assert impls == ["pallas_tpu"] * len(accelerator.ATTEND_CACHES)
