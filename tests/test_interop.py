"""Interop with the real reference peer (lmcache-turbo-quant-serde 0.1.0 + tqai 0.6.1).

The reference is imported here only, as the independent expectation: our blobs must
decode with its ``from_bytes`` and its blobs with our ``loads``.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax

torch = pytest.importorskip("torch")
ref_codec = pytest.importorskip("lmcache_turbo_quant_serde._codec")
from tqai.packing import unpack as ref_unpack  # noqa: E402

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def to_numpy(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


def rel_err(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _ref_roundtrip(x_t, bits, seed=42, **kw):
    blob = ref_codec.TurboQuantSerializer(bits=bits, seed=seed, **kw).to_bytes(x_t)
    return blob, ref_codec.TurboQuantDeserializer().from_bytes(blob)


@pytest.mark.parametrize("dim", [64, 96, 128, 256, 80])
@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_interop_both_ways(dim, bits, dtype):
    gen = torch.Generator().manual_seed(dim * 100 + bits)
    x_t = torch.randn(2, 3, 5, 2, dim, generator=gen).to(TORCH_DTYPES[dtype])
    x = to_numpy(x_t)
    ref_blob, ref_dec = _ref_roundtrip(x_t, bits)
    ours = tq_jax.dumps(x, bits=bits)

    # Same length, same header bytes (everything before the indices section).
    assert len(ours) == len(ref_blob)
    h = tq_jax.parse(ours)
    head_len = len(ours) - h.indices[0].nbytes - h.norms[0].nbytes - 16
    assert ours[:head_len] == ref_blob[:head_len]

    # Our loads of the reference's blob vs the reference's own decode.
    got = tq_jax.loads(ref_blob)
    assert got.dtype == jnp.dtype(dtype) and got.shape == tuple(x_t.shape)
    assert rel_err(got, ref_dec.float().numpy()) <= 1e-3

    # The reference's from_bytes of our blob vs our own decode.
    theirs = ref_codec.TurboQuantDeserializer().from_bytes(ours)
    assert rel_err(theirs.float().numpy(), tq_jax.loads(ours)) <= 1e-3

    # Indices agree with the reference encoder's on >= 99.9 % of coordinates.
    n = x_t.numel()
    ref_idx = ref_unpack(tq_jax.parse(ref_blob).indices[0], bits, (n,))
    our_idx = ref_unpack(h.indices[0], bits, (n,))
    assert (ref_idx == our_idx).mean() >= 0.999
    # Norms agree to float16 rounding.
    np.testing.assert_allclose(
        h.norms[0].astype(np.float32), tq_jax.parse(ref_blob).norms[0].astype(np.float32), rtol=1e-3
    )


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("m", [64, 32])
def test_reference_qjl_blobs_decode(bits, m):
    gen = torch.Generator().manual_seed(bits)
    x_t = torch.randn(3, 7, 128, generator=gen).to(torch.bfloat16)
    blob, ref_dec = _ref_roundtrip(x_t, bits, seed=5, use_qjl=True, qjl_sketch_size=m)
    assert tq_jax.parse(blob).header.use_qjl
    assert rel_err(tq_jax.loads(blob), ref_dec.float().numpy()) <= 1e-3


# Produced by the reference's TurboQuantSerializer (bits=4, seed=42) on
# x[0, j, k] = sin(1 + 3j + 0.37k), float32, shape (1, 2, 64).
GOLDEN_F32_B4 = bytes.fromhex(
    "5451303101040040002a0000000301000000000000000200000000000000400000000000000007666c6f617433"
    "324000000000000000ad18513c18c7662bb6b5a3bbd58a6977b5b9306a47d857caba39b68c82a846c942f79ed4"
    "e72999d4484a5c442a7596874a45cfa6b828a83645c65a737c57a9360400000000000000c645c745"
)
# Same input cast to bfloat16, bits=3, seed=-7 (a negative seed, stored as int32).
GOLDEN_BF16_B3 = bytes.fromhex(
    "545130310103004000f9ffffff030100000000000000020000000000000040000000000000000862666c6f6174"
    "313630000000000000001329bf9b2d531eb895fa433183288654241662c52c985776ece8406cd4acdac76d06bc"
    "ce7cd779abdbe59d3ad367a8890400000000000000c645c745"
)


def _golden_input():
    j, k = np.meshgrid(np.arange(2), np.arange(64), indexing="ij")
    return np.sin(1 + 3 * j + 0.37 * k).astype(np.float32)[None]


def test_golden_blobs():
    x = _golden_input()
    assert tq_jax.dumps(x, bits=4, seed=42) == GOLDEN_F32_B4
    assert tq_jax.dumps(x.astype(jnp.bfloat16), bits=3, seed=-7) == GOLDEN_BF16_B3
    # The golden bytes are still what the installed reference writes.
    assert ref_codec.TurboQuantSerializer(bits=4, seed=42).to_bytes(torch.from_numpy(x)) == GOLDEN_F32_B4


def test_seed_is_stored_as_low_32_bits_like_torch():
    x = _golden_input()
    assert tq_jax.dumps(x, bits=4, seed=42 + 2**32) == tq_jax.dumps(x, bits=4, seed=42)
    assert tq_jax.parse(tq_jax.dumps(x, bits=4, seed=2**32 - 7)).header.seed == -7
