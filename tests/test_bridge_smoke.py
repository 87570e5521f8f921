"""`python -m tq_jax.bridge.smoke`: a real StorageManager round trip from the operator's JSON.

One subprocess run (the command as an operator types it) on a temp `fs` directory; the
failure paths run `smoke.main` in this process, where LMCache is already imported.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

from lmcache.v1.distributed.serde import AsyncSerdeProcessor, Deserializer, Serializer  # noqa: E402
from lmcache.v1.distributed.serde import factory as lmc_factory  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax._src import frames  # noqa: E402
from tq_jax.bridge import smoke  # noqa: E402

from conftest import LMCACHE_WARNINGS  # noqa: E402

pytestmark = LMCACHE_WARNINGS
REPO = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--layers", "2", "--tokens", "64", "--kv-heads", "2"]  # [2, 2, 64, 256] bf16
STORED = (2, 2, 64, 2, 128)


@pytest.mark.slow
def test_smoke_command_round_trips_through_fs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LMCACHE_LOG_LEVEL", "LMCACHE_DISABLE_BANNER")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    adapter = {"type": "fs", "base_path": str(tmp_path), "serde": {"type": "tq_jax", "head_dim": 128}}  # the default
    r = subprocess.run(
        [sys.executable, "-m", "tq_jax.bridge.smoke", *SMALL, "--l2-adapter", json.dumps(adapter)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert out.splitlines()[-1] == "OK"
    # turbo-4 (the default) and the key trailer after its blob
    size = tq_jax.serialized_size(STORED, "bfloat16", options="turbo-4") + frames.KEY_TRAILER_BYTES
    bf16 = 2 * 2 * 64 * 256 * 2
    m = re.search(r"stored: ([\d,]+) bytes per chunk \(reported by the adapter\): ([\d.]+) % of bf16", out)
    assert m, out
    assert int(m.group(1).replace(",", "")) == size  # what the fs adapter wrote: our exact size
    assert float(m.group(2)) == round(100 * size / bf16, 1)
    cos = float(re.search(r"mean cosine ([\d.]+)", out).group(1))
    assert 0.99 <= cos <= 1.0
    # The operator sees that the serde is active, once; LMCache's INFO lines stay hidden.
    assert r.stderr.count("tq_jax serde created") == 1
    assert "writing TQ01 v2" in r.stderr and "detects damaged values: yes" in r.stderr and "key_bits=5" in r.stderr
    assert "LMCache INFO" not in r.stderr and "FutureWarning" not in r.stderr
    assert not list(tmp_path.rglob("*.data"))  # the smoke chunk was deleted from L2 again


def _main(capsys, adapter: dict, *extra: str) -> tuple[int, str]:
    rc = smoke.main([*SMALL, "--timeout", "60", *extra, "--l2-adapter", json.dumps(adapter)])
    return rc, capsys.readouterr().out


def test_smoke_fails_when_the_chunk_does_not_load_back(tmp_path, capsys):
    adapter = {"type": "fault_inject", "gap_indices": [0], "inner": {"type": "fs", "base_path": str(tmp_path)},
               "serde": {"type": "tq_jax"}}
    rc, out = _main(capsys, adapter)
    assert rc == 1
    assert "FAILED: the chunk was stored but did not load back from L2 (hits 0" in out
    assert "OK" not in out.splitlines()


class _Broken(Serializer, Deserializer):
    """serialize raises (AsyncSerdeProcessor only logs it) or deserialize writes noise."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def estimate_serialized_size(self, layout_desc) -> int:
        return layout_desc.shapes[0].numel() * 2

    def serialize(self, src, dst, key) -> int:
        if self.mode == "store":
            raise RuntimeError("injected serialize failure")
        dst.tensor.view(-1)[: src.tensor.numel() * 2].copy_(src.tensor.reshape(-1).view(torch.uint8))
        return src.tensor.numel() * 2

    def deserialize(self, src, dst, key) -> None:
        dst.tensor.copy_(torch.randn(dst.tensor.shape, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize(
    "mode,message",
    [("store", "FAILED: the L2 store failed"), ("noise", "is below 0.9: the chunk came back wrong")],
)
def test_smoke_checks_what_lmcache_swallows(tmp_path, capsys, monkeypatch, mode, message):
    registry = dict(lmc_factory._SERDE_FACTORY_REGISTRY)
    registry["broken"] = lambda kw: AsyncSerdeProcessor(_Broken(mode), _Broken(mode), max_workers=1)
    monkeypatch.setattr(lmc_factory, "_SERDE_FACTORY_REGISTRY", registry)
    rc, out = _main(capsys, {"type": "fs", "base_path": str(tmp_path), "serde": {"type": "broken"}})
    assert rc == 1
    assert message in out, out
    assert "serde: 'broken', not the tq_jax serde" in out


def test_smoke_refuses_a_layout_the_serde_cannot_store(tmp_path, capsys):
    rc, out = _main(capsys, {"type": "fs", "base_path": str(tmp_path), "serde": {"type": "tq_jax"}}, "--head-dim", "100")
    assert rc == 1
    assert "FAILED: the serde refuses a [2, 2, 64, 200] bfloat16 chunk" in out
    assert "not a multiple of head_dim=128" in out


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"type": "fs"', "--l2-adapter is not valid JSON"),
        ('["fs"]', 'must be a JSON object with a string "type"'),
        ('{"type": "fs", "serde": "tq_jax"}', 'the adapter\'s "serde" must be an object'),
        ('{"type": "fs", "serde": {"type": "tq_jax", "bitz": 4}}', "unknown tq_jax serde option(s) 'bitz'"),
    ],
)
def test_smoke_bad_input_exits_2(capsys, text, message):
    assert smoke.main(["--l2-adapter", text]) == 2
    assert message in capsys.readouterr().err
