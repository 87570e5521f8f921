"""The tq_jax serde inside a real LMCache 0.5.6 StorageManager with an `fs` L2 adapter.

W1-shaped chunks ([2, 32, 256, 1024] bf16, head_dim 128) are written to L1, stored to L2
through our serde, deleted from L1 (the freed memory is overwritten), prefetched back
from L2 and compared with the originals. The bytes on disk must be exactly our size.
"""

from __future__ import annotations

import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

import numpy as np  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax.bridge._src import dlpack  # noqa: E402
from tq_jax.bridge import register  # noqa: E402
from tq_jax.bridge._src.serde import KEY_TRAILER_BYTES  # noqa: E402

from bridge_util import Events, build_manager, key, mean_cosine, store_evict_prefetch  # noqa: E402


from conftest import LMCACHE_WARNINGS  # noqa: E402

pytestmark = LMCACHE_WARNINGS

W1 = (2, 32, 256, 1024)
STORED = (2, 32, 256, 8, 128)
N_CHUNKS = 4
BF16_BYTES = 2 * int(np.prod(W1))
# Mean per-vector cosine floors on N(0, 1) data; measured: 2-bit ~0.940, 3-bit ~0.983,
# 4-bit ~0.9954, 8-bit ~0.99998 (README's Numbers; the reference measures the same).
COSINE_FLOOR = {2: 0.935, 3: 0.980, 4: 0.995, 8: 0.9999}


@pytest.fixture(scope="module")
def chunks():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(W1, generator=g).to(torch.bfloat16) for _ in range(N_CHUNKS)]


# Slow: W1-sized round trips cost seconds each (and LMCache's StorageManager ~1 s to close).
# The quick tier keeps test_bridge_registry's plugin round trip (fs, 4 bits, TQ01 v1, exact
# sizes) and test_faults' fs round trips (v1 and v2 with a checksum).
@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 2, 3, 8])
def test_fs_round_trip_w1(tmp_path, chunks, bits):
    register()
    events = Events()
    sm = build_manager(
        {"type": "fs", "base_path": str(tmp_path), "serde": {"type": "tq_jax", "head_dim": 128, "bits": bits, "format": "v1"}},
        l1_gb=0.6,
    )
    keys = [key(i, f"w1-{bits}") for i in range(N_CHUNKS)]
    try:
        ok, failed, hits, l2_hits, got = store_evict_prefetch(sm, events, keys, chunks, W1)
    finally:
        sm.close()
        events.stop()

    assert (ok, failed) == (N_CHUNKS, 0), "L2 stores failed (see the serde log above)"
    assert (hits, l2_hits) == (N_CHUNKS, N_CHUNKS), f"prefetch: {events.prefetch_failed}"
    assert not events.prefetch_failed

    # Bytes on disk: exactly our serialized size, one TQ01 blob per chunk.
    files = sorted(pathlib.Path(tmp_path).rglob("*.data"))
    size = tq_jax.serialized_size(STORED, "bfloat16", bits)
    assert len(files) == N_CHUNKS
    assert {f.stat().st_size for f in files} == {size}
    if bits == 4:
        assert size <= 0.26 * BF16_BYTES
    # ... and each is the blob tq_jax writes offline for that chunk (same bits, seed 42).
    blobs = {f.read_bytes() for f in files}
    assert tq_jax.dumps(dlpack.numpy_view(chunks[0]).reshape(STORED), bits=bits) in blobs
    assert all(tq_jax.peek_header(b).shape == STORED for b in blobs)

    for x, y in zip(chunks, got):
        assert y.shape == W1 and y.dtype == torch.bfloat16
        assert not (y == -7).all()
        assert mean_cosine(x, y, 128) >= COSINE_FLOOR[bits]


@pytest.mark.slow  # see above; the raw edge layers through the serde run only here
def test_fs_round_trip_w1_v2_options(tmp_path, chunks):
    """TQ01 v2 through the real StorageManager: K 4 / V 3 bits, 2 + 2 raw layers, fast
    rotation, float32 norms, norm correction and a checksum; sizes stay exact."""
    register()
    events = Events()
    serde = {"type": "tq_jax", "head_dim": 128, "preset": "k4v3-edges"}
    sm = build_manager({"type": "fs", "base_path": str(tmp_path), "serde": serde}, l1_gb=0.6)
    keys = [key(i, "w1-v2") for i in range(N_CHUNKS)]
    try:
        ok, failed, hits, l2_hits, got = store_evict_prefetch(sm, events, keys, chunks, W1)
    finally:
        sm.close()
        events.stop()
    assert (ok, failed) == (N_CHUNKS, 0)
    assert (hits, l2_hits) == (N_CHUNKS, N_CHUNKS), f"prefetch: {events.prefetch_failed}"
    opts = tq_jax.Options(key_bits=4, value_bits=3, skip_first_layers=2, skip_last_layers=2,
                          rotation="hadamard", norm_dtype="float32", norm_correction=True, checksum=True)
    size = opts.serialized_size(STORED, "bfloat16")
    files = sorted(pathlib.Path(tmp_path).rglob("*.data"))
    # A checksummed blob is followed by its key trailer (bound to the key it was stored under).
    assert {f.stat().st_size for f in files} == {size + KEY_TRAILER_BYTES}
    assert all(tq_jax.peek_header(f.read_bytes()).version == 2 for f in files)
    for x, y in zip(chunks, got):
        # Raw edge layers come back bit-exact; the rest at K 4 / V 3 bits quality.
        for layer in (0, 1, 30, 31):
            assert torch.equal(x[:, layer], y[:, layer])
        assert mean_cosine(x[0], y[0], 128) >= 0.995
        assert mean_cosine(x[1], y[1], 128) >= 0.983


# Slow as the two above. The quick tier stores TQ01 v2 with its key trailer through a real
# StorageManager in test_faults (fs, checksum) and test_redis_store (turbo-3.5).
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["turbo-3.5", "turbo-2.5"])
def test_fs_round_trip_w1_turbo_presets(tmp_path, chunks, preset):
    """The turbo-* presets (mixed key/value bits) through the real StorageManager: exact
    sizes from the layout (log-coded norms included), the bytes tq_jax writes offline,
    quality per group."""
    register()
    events = Events()
    serde = {"type": "tq_jax", "head_dim": 128, "preset": preset}
    sm = build_manager({"type": "fs", "base_path": str(tmp_path), "serde": serde}, l1_gb=0.6)
    keys = [key(i, f"w1-{preset}") for i in range(N_CHUNKS)]
    try:
        ok, failed, hits, l2_hits, got = store_evict_prefetch(sm, events, keys, chunks, W1)
    finally:
        sm.close()
        events.stop()
    assert (ok, failed) == (N_CHUNKS, 0), "L2 stores failed (see the serde log above)"
    assert (hits, l2_hits) == (N_CHUNKS, N_CHUNKS), f"prefetch: {events.prefetch_failed}"
    opts = tq_jax.Options(**tq_jax.PRESETS[preset])
    size = opts.serialized_size(STORED, "bfloat16")
    files = sorted(pathlib.Path(tmp_path).rglob("*.data"))
    assert {f.stat().st_size for f in files} == {size + KEY_TRAILER_BYTES}  # + the key trailer
    assert 8 * size / (BF16_BYTES / 2) <= {"turbo-3.5": 3.6, "turbo-2.5": 2.6}[preset]  # bits per element
    blobs = {f.read_bytes()[:size] for f in files}
    assert tq_jax.dumps(dlpack.numpy_view(chunks[0]).reshape(STORED), **tq_jax.PRESETS[preset]) in blobs
    kb, vb = opts.key_bits, opts.value_bits
    for x, y in zip(chunks, got):
        assert y.shape == W1 and y.dtype == torch.bfloat16
        assert mean_cosine(x[0], y[0], 128) >= COSINE_FLOOR[kb] - 0.002  # 6-bit norms: within half a grid step
        assert mean_cosine(x[1], y[1], 128) >= COSINE_FLOOR[vb] - 0.002


def test_fs_round_trip_of_turbo_4t_small_chunks(tmp_path):
    """``"preset": "turbo-4t"`` (trellis-coded indices) through the real StorageManager:
    the values on disk are tq_jax.dumps' bytes plus the key trailer, of the preset's exact
    size, and a prefetch gives back what tq_jax.loads decodes from them."""
    shape, stored = (2, 4, 32, 256), (2, 4, 32, 4, 64)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2)]
    register()
    events = Events()
    sm = build_manager({"type": "fs", "base_path": str(tmp_path),
                        "serde": {"type": "tq_jax", "head_dim": 64, "preset": "turbo-4t"}}, l1_gb=0.05)
    keys = [key(i, "turbo-4t") for i in range(2)]
    try:
        ok, failed, hits, l2_hits, got = store_evict_prefetch(sm, events, keys, data, shape)
    finally:
        sm.close()
        events.stop()
    assert (ok, failed, hits, l2_hits) == (2, 0, 2, 2), f"prefetch: {events.prefetch_failed}"
    size = tq_jax.serialized_size(stored, "bfloat16", options="turbo-4t")
    for x, y in zip(data, got):
        blob = tq_jax.dumps(dlpack.numpy_view(x).reshape(stored), options="turbo-4t")
        assert len(blob) == size and tq_jax.peek_header(blob).trellis
        on_disk = {f.read_bytes()[:size] for f in pathlib.Path(tmp_path).rglob("*.data")}
        assert blob in on_disk
        want = np.asarray(tq_jax.loads(blob)).reshape(shape)
        np.testing.assert_array_equal(dlpack.numpy_view(y).view(np.uint16), want.view(np.uint16))
