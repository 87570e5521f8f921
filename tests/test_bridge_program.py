"""The bridge's ``device`` path through the device executor (tq_jax._src.program).

With ``device: "gpu"`` the serde hands ``tq_jax.dump_into`` a numpy view of LMCache's
CPU L1 chunk and ``tq_jax.load_into`` a numpy view of the destination: the chunk
crosses to the device in one transfer, one compiled program writes the blob there,
and the bytes come back into ``dst`` (loads: the reverse). On this CPU-only machine the
same code runs with ``device: "cpu"`` and the device path forced on CPU devices (the
serde's calls given ``executor="program"``); the expectation is the host block driver's bytes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

import numpy as np  # noqa: E402

from tq_jax._src import blocks as blocks_mod  # noqa: E402
from tq_jax._src import program as program_mod  # noqa: E402
from tq_jax.bridge._src import dlpack  # noqa: E402
from tq_jax.bridge._src import serde as S  # noqa: E402

from bridge_util import byte_obj, key, layout, make_obj  # noqa: E402

from conftest import LMCACHE_WARNINGS  # noqa: E402
from device_path_helpers import assert_decoded_like  # noqa: E402

pytestmark = LMCACHE_WARNINGS
SHAPE = (2, 4, 48, 512)  # [K/V, layers, tokens, heads * head_dim]


def _chunk(seed=0):
    obj = make_obj([SHAPE], [torch.bfloat16])
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(SHAPE, generator=g).to(torch.bfloat16))
    return obj


@pytest.mark.parametrize("options", [dict(bits=4), dict(preset="turbo-3.5")])
def test_serde_device_path_runs_the_program_and_writes_the_host_bytes(options, monkeypatch):

    kw = dict(options)
    if "preset" in kw:
        import tq_jax

        kw = dict(tq_jax.PRESETS[kw.pop("preset")], bits=4)
    ser = S.TQJaxSerializer(head_dim=128, device="cpu", **kw)
    de = S.TQJaxDeserializer(device="cpu", bind_key=ser.bind_key)
    src = _chunk()
    need = ser.estimate_serialized_size(layout([SHAPE], [torch.bfloat16]))
    host = byte_obj(need)
    ser.serialize(src, host, key(0))  # the host block driver
    want = host.tensor.numpy().copy()
    want_out = make_obj([SHAPE], [torch.bfloat16])
    de.deserialize(host, want_out, key(0))

    built = []
    import tq_jax

    for name in ("dump_into", "load_into", "loads"):  # what the serde calls, with the device path pinned
        real = getattr(tq_jax, name)
        monkeypatch.setattr(tq_jax, name, lambda *a, _r=real, **k: _r(*a, **k, executor="program"))
    for name in ("encoder", "decoder"):
        real = getattr(program_mod, name)
        monkeypatch.setattr(program_mod, name, lambda *a, _r=real, _n=name: built.append(_n) or _r(*a))
    monkeypatch.setattr(blocks_mod, "encode_plan", lambda *a: pytest.fail("host block driver used"))
    monkeypatch.setattr(blocks_mod, "decode_plan", lambda *a: pytest.fail("host block driver used"))
    dev = byte_obj(need)
    assert ser.serialize(src, dev, key(0)) == need
    np.testing.assert_array_equal(dev.tensor.numpy(), want)
    out = make_obj([SHAPE], [torch.bfloat16])
    out.tensor.fill_(-7)
    de.deserialize(dev, out, key(0))
    assert_decoded_like(dlpack.numpy_view(out.tensor), dlpack.numpy_view(want_out.tensor))
    assert built == ["encoder", "decoder"]
