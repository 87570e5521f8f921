"""compress/decompress across devices and processes: the bytes never change.

Each test starts fresh Python processes (XLA's host device count is fixed at start-up,
and jax.distributed needs a process per member), so they take a few seconds each.
"""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from tq_jax._src import cli
from tq_jax._src import safetensors_io as st

from conftest import free_port

pytestmark = pytest.mark.slow  # fresh processes with forced device counts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 180


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env




def _inputs(tmp_path):
    rng = np.random.default_rng(3)
    a = tmp_path / "a.safetensors"
    b = tmp_path / "b.safetensors"
    st.save_file(
        {
            # 32768 vectors: 4 kernel blocks per blob, so 4 devices each take one.
            "kv": rng.standard_normal((2, 4, 512, 8, 128), dtype=np.float32).astype(jnp.bfloat16),
            "k": rng.standard_normal((40, 128)).astype(np.float16),
            "ids": np.arange(100, dtype=np.int64),
        },
        a,
        {"who": "a"},
    )
    st.save_file({"v": rng.standard_normal((3, 64, 128)).astype(np.float32), "scale": np.ones(3, np.float32)}, b)
    return a, b


def _run_py(code: str, devices: int):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=_env(devices),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_four_devices_same_bytes_as_one(tmp_path):
    a, _ = _inputs(tmp_path)
    one, back1 = tmp_path / "one.safetensors", tmp_path / "back1.safetensors"
    assert cli.main(["compress", str(a), str(one), "-q", "--chunk-mb", "8"]) == 0
    v2 = ["--key-bits", "4", "--value-bits", "2", "--skip-first-layers", "1", "--rotation", "hadamard",
          "--exclude", "k", "--chunk-mb", "3", "-q"]
    assert cli.main(["compress", str(a), str(tmp_path / "v2one.safetensors"), *v2]) == 0
    assert cli.main(["decompress", str(one), str(back1), "-q"]) == 0
    out = _run_py(
        f"""
        import jax
        from tq_jax._src import cli
        print(len(jax.local_devices()))
        assert cli.main(["compress", {str(a)!r}, {str(tmp_path / 'four.safetensors')!r}, "-q", "--chunk-mb", "8"]) == 0
        assert cli.main(["decompress", {str(one)!r}, {str(tmp_path / 'back4.safetensors')!r}, "-q"]) == 0
        assert cli.main(["compress", {str(a)!r}, {str(tmp_path / 'first.safetensors')!r}, "-q", "--chunk-mb", "8",
                         "--devices", "1"]) == 0
        assert cli.main(["compress", {str(a)!r}, {str(tmp_path / 'v2four.safetensors')!r}, *{v2!r}]) == 0
        """,
        devices=4,
    )
    assert out.split() == ["4"]
    assert (tmp_path / "four.safetensors").read_bytes() == one.read_bytes()
    assert (tmp_path / "first.safetensors").read_bytes() == one.read_bytes()
    assert (tmp_path / "back4.safetensors").read_bytes() == back1.read_bytes()
    assert (tmp_path / "v2four.safetensors").read_bytes() == (tmp_path / "v2one.safetensors").read_bytes()


def _two_processes(argv: list[str], devices: int = 2):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tq_jax", *argv, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i), "--barrier-timeout", "120"],
            cwd=ROOT, env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, out, err))
    return results


def test_two_processes_same_bytes_as_one(tmp_path):
    a, b = _inputs(tmp_path)
    assert cli.main(["compress", str(a), str(b), str(tmp_path / "one"), "-q", "--chunk-mb", "1"]) == 0
    for rc, _, err in _two_processes(["compress", str(a), str(b), str(tmp_path / "two"), "-q", "--chunk-mb", "1"]):
        assert rc == 0, err[-3000:]
    for name in ("a.safetensors", "b.safetensors"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    # Decompress one file, its entries and blobs shared by the two processes.
    comp = tmp_path / "one" / "a.safetensors"
    assert cli.main(["decompress", str(comp), str(tmp_path / "back1.safetensors"), "-q"]) == 0
    for rc, _, err in _two_processes(["decompress", str(comp), str(tmp_path / "back2.safetensors"), "-q"]):
        assert rc == 0, err[-3000:]
    assert (tmp_path / "back2.safetensors").read_bytes() == (tmp_path / "back1.safetensors").read_bytes()
    # The parts directories are gone.
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors", "back1.safetensors",
                                            "back2.safetensors", "one", "two"]
    assert sorted(os.listdir(tmp_path / "two")) == ["a.safetensors", "b.safetensors"]


def test_two_processes_share_one_failure(tmp_path):
    port = free_port()
    common = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--barrier-timeout", "120", "-q"]
    a, _ = _inputs(tmp_path)
    procs = [
        subprocess.Popen([sys.executable, "-m", "tq_jax", "compress", str(src), str(tmp_path / "o.safetensors"),
                          *common, "--process-id", str(i)],
                         cwd=ROOT, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, src in enumerate([a, tmp_path / "missing.safetensors"])
    ]
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 1
        errs.append(err.strip().splitlines()[-1])
    assert errs[0].startswith("tq-jax: error: process 1 of 2 failed:") and "no such file" in errs[0]
    assert errs[1].startswith("tq-jax: error: ") and "no such file" in errs[1]
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("sizes, count, want", [([5, 1, 1, 3], 2, [0, 1, 1, 1]), ([2, 2, 2], 3, [0, 1, 2])])
def test_assignment_is_deterministic(sizes, count, want):
    from tq_jax._src.distributed import assign

    assert assign(sizes, count) == want
