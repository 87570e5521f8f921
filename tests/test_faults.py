"""Injected faults: failing and corrupting L2 storage under the tq_jax serde.

Through a real LMCache 0.5.6 ``StorageManager`` (``fs`` L2 adapter, serde on the
outer dict): every load must end as either the right KV in L1 (compared bit for bit
with ``tq_jax.loads`` of the clean blob) or a miss that LMCache reports — never other
values — *except* where TQ01 version 1 cannot know: it has no checksum, so a bit flip
in the payload (indices, norms) or in the seed decodes silently to wrong values. Those
cases are demonstrated here and in ``test_v1_single_bit_flip_map`` (the numbers quoted
in docs/hardening.md); with ``checksum: true`` (TQ01 v2) every one of them is a miss.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import tq_jax
from tq_jax._src import wire

from conftest import LMCACHE_WARNINGS  # noqa: E402

pytestmark = LMCACHE_WARNINGS

HEAD_DIM, HEADS = 16, 2
SHAPE = (2, 2, 16, HEADS * HEAD_DIM)  # [K/V, layers, tokens, H*D]
STORED = (2, 2, 16, HEADS, HEAD_DIM)


# ----------------------------------------------------------------------------- v1 facts


def _blob_regions(blob: bytes) -> list[str]:
    """The region name of every byte of a valid v1 blob."""
    h = wire.peek_header(blob)
    names = ["magic"] * 4 + ["version", "bits", "use_qjl", "qjl_m", "qjl_m"] + ["seed"] * 4 + ["ndim"]
    names += ["shape"] * (8 * len(h.shape)) + ["dtype_len"] + ["dtype"] * len(h.dtype)
    idx, nrm, _, _ = wire.section_sizes(h.shape, h.bits)
    names += ["length"] * 8 + ["indices"] * idx + ["length"] * 8 + ["norms"] * nrm
    assert len(names) == len(blob)
    return names


def test_v1_single_bit_flip_map():
    """Flip every bit of a v1 blob: what the parser refuses and what decodes wrong."""
    x = np.random.default_rng(5).standard_normal((2, 2, 3, 16)).astype(np.float32)
    blob = tq_jax.dumps(x, bits=4)
    clean = np.asarray(tq_jax.loads(blob))
    regions = _blob_regions(blob)
    outcome: dict[str, dict[str, int]] = {}
    for pos in range(len(blob) * 8):
        bad = bytearray(blob)
        bad[pos // 8] ^= 1 << (pos % 8)
        region = regions[pos // 8]
        try:
            y = np.asarray(tq_jax.loads(bytes(bad)))
        except wire.WireError:
            kind = "refused"
        else:
            diff = np.any(y.reshape(-1, 16) != clean.reshape(-1, 16), axis=1)
            kind = "same" if not diff.any() else "one vector wrong" if diff.sum() == 1 else "all wrong"
            if region == "indices" and kind == "one vector wrong":
                # One coordinate moved to another centroid: the vector stays close.
                v, c = y.reshape(-1, 16)[diff][0], clean.reshape(-1, 16)[diff][0]
                assert v @ c / (np.linalg.norm(v) * np.linalg.norm(c)) > 0.5
        outcome.setdefault(region, {}).setdefault(kind, 0)
        outcome[region][kind] += 1
    # Structure: every flip of magic, version, bits, use_qjl, ndim, shape, dtype and the
    # section lengths is refused (the sizes no longer add up, or a field is invalid).
    for region in ("magic", "version", "bits", "use_qjl", "ndim", "shape", "dtype_len", "dtype", "length"):
        assert set(outcome[region]) == {"refused"}, (region, outcome[region])
    # qjl_m is unused without QJL: its flips change nothing.
    assert outcome["qjl_m"] == {"same": 16}
    # Undetectable in v1: the seed picks another rotation (every vector wrong) ...
    assert outcome["seed"] == {"all wrong": 32}
    # ... an index flip moves one coordinate of one vector (8 * 96 bits, none unused) ...
    assert outcome["indices"] == {"one vector wrong": 8 * 96}
    # ... a norm flip rescales, negates (sign bit) or blows up one vector.
    assert outcome["norms"] == {"one vector wrong": 8 * 24}
    # With the v2 CRC32, every single-bit flip anywhere is refused.
    crc = tq_jax.dumps(x, bits=4, checksum=True)
    for pos in range(len(crc) * 8):
        bad = bytearray(crc)
        bad[pos // 8] ^= 1 << (pos % 8)
        with pytest.raises(wire.WireError):
            wire.parse(bytes(bad))


# ----------------------------------------------------------------------------- LMCache


@pytest.fixture(scope="module")
def lmc():
    torch = pytest.importorskip("torch")
    pytest.importorskip("lmcache")
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename

    from tq_jax.bridge._src import dlpack
    from tq_jax.bridge import register

    import bridge_util

    register()
    return dict(torch=torch, Grouped=GroupedObjectKeys, Spec=PrefetchTaskSpec, fname=_object_key_to_filename,
                dlpack=dlpack, bu=bridge_util)


class Cache:
    """A StorageManager with one L2 adapter and its event counters."""

    def __init__(self, lmc, adapter: dict):
        self.lmc, self.bu, self.torch = lmc, lmc["bu"], lmc["torch"]
        self.events = self.bu.Events()
        self.sm = self.bu.build_manager(adapter, l1_gb=0.05)
        self.layout = self.bu.layout([SHAPE], [self.torch.bfloat16])

    def close(self):
        self.sm.close()
        self.events.stop()

    def store_and_evict(self, keys, data):
        sm = self.sm
        objs = sm.reserve_write(keys, self.layout)
        assert len(objs) == len(keys)
        for k, x in zip(keys, data):
            objs[k].tensor.copy_(x)
        views = [objs[k].tensor for k in keys]
        sm.finish_write(keys)
        ok, failed = self.events.wait_stores(len(keys))
        deleted, deadline = 0, time.monotonic() + 30
        while True:
            d, skipped = sm.delete_l1_keys(keys)
            deleted += d
            if not skipped or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert deleted == len(keys)
        for v in views:
            v.fill_(-7.0)  # scribble over the freed L1 memory
        return ok, failed

    def prefetch(self, keys):
        """Prefetches ``keys``; returns {index: tensor copy} for the hits."""
        sm = self.sm
        spec = self.lmc["Spec"](key_groups=[self.lmc["Grouped"](keys=keys, object_group_id=0, layout_desc=self.layout)])
        handle = sm.submit_prefetch_task(spec)
        assert sm.wait_prefetch_status(handle, timeout=60)
        res = sm.query_prefetch_status(handle)
        hits = [] if res is None or not res.hit_cells else res.hit_cells[0].get_indices_list()
        got = {}
        if hits:
            hit_keys = [keys[i] for i in hits]
            with sm.read_prefetched_results(hit_keys) as objs:
                assert objs is not None
                got = {i: o.tensor.clone() for i, o in zip(hits, objs)}
            sm.finish_read_prefetched(hit_keys)
        for i, k in enumerate(keys):  # a miss leaves nothing readable in L1
            if i not in got:
                with sm.read_prefetched_results([k]) as objs:
                    assert objs is None, f"key {i} missed but is readable in L1"
        return got


def _data(torch, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(torch.bfloat16) for _ in range(n)]


def _same(lmc, got, blob: bytes) -> bool:
    """``got`` equals the decode of the stored value ``blob`` (a checksummed value's key
    trailer after the TQ01 blob is not part of the blob)."""
    torch = lmc["torch"]
    blob = blob[: wire.blob_nbytes(wire.peek_header(blob))]
    want = np.asarray(tq_jax.loads(blob)).reshape(SHAPE)
    have = lmc["dlpack"].numpy_view(got.contiguous())
    return bool(np.array_equal(have.view(np.uint16), want.view(np.uint16))) and got.dtype == torch.bfloat16


def test_fault_inject_drops_become_misses_never_wrong_kv(lmc, tmp_path):
    torch = lmc["torch"]
    keys = [lmc["bu"].key(i, "fi") for i in range(12)]
    data = _data(torch, len(keys))
    cache = Cache(lmc, {"type": "fault_inject", "rate": 0.4, "seed": 3, "gap_indices": [5],
                        "inner": {"type": "fs", "base_path": str(tmp_path)},
                        "serde": {"type": "tq_jax", "head_dim": HEAD_DIM, "bits": 4}})
    try:
        assert cache.store_and_evict(keys, data) == (len(keys), 0)
        files = {i: (tmp_path / lmc["fname"](k)).read_bytes() for i, k in enumerate(keys)}
        got = {}
        for i, k in enumerate(keys):  # one key per prefetch: each has its own outcome
            got.update({i: t for t in cache.prefetch([k]).values()})
        # A batch prefetch too: LMCache's prefix policy stops at the first dropped key.
        batch = cache.prefetch(keys)
    finally:
        cache.close()
    assert 0 < len(got) < len(keys), sorted(got)  # rate 0.4 dropped some keys, not all
    for i, t in list(got.items()) + list(batch.items()):
        assert _same(lmc, t, files[i]), i
    assert 5 not in batch and set(batch) <= set(got) and len(batch) < len(got)
    assert len(cache.events.prefetch_failed) > 0  # the misses were reported


@pytest.mark.parametrize("checksum", [False, True], ids=["v1", "v2-crc32"])
def test_corrupted_files_are_misses_or_documented_v1_blind_spots(lmc, tmp_path, checksum):
    torch = lmc["torch"]
    serde = {"type": "tq_jax", "head_dim": HEAD_DIM, "bits": 4, "checksum": checksum}  # false: v1, by its settings
    keys = [lmc["bu"].key(i, f"cor{int(checksum)}") for i in range(10)]
    data = _data(torch, len(keys), seed=1)
    cache = Cache(lmc, {"type": "fs", "base_path": str(tmp_path), "serde": serde})
    try:
        assert cache.store_and_evict(keys, data) == (len(keys), 0)
        paths = [tmp_path / lmc["fname"](k) for k in keys]
        clean = [p.read_bytes() for p in paths]
        h = wire.peek_header(clean[0])
        assert h.version == (2 if checksum else 1) and h.checksum == checksum
        assert h.shape == STORED
        hdr = wire.header_nbytes(len(h.shape), h.dtype, h.version)
        idx_off = hdr + 8  # first byte of the indices section
        blob0 = clean[0][: wire.blob_nbytes(h)]  # a checksummed value ends with its key trailer
        nrm_off = idx_off + len(wire.parse(blob0).indices[0]) + 8  # first byte of the norms
        seed_off = 9 if h.version == 1 else 13

        def flip(b, off, bit=0):
            b = bytearray(b)
            b[off] ^= 1 << bit
            return bytes(b)

        corrupt = {
            1: flip(clean[1], 0),  # magic
            2: clean[2][:-1],  # truncated file: fs reads fewer bytes than the estimate
            3: clean[3] + b"\xff" * 100,  # longer file: fs reads the estimate's bytes
            4: flip(clean[4], hdr - len(h.dtype) - 1 - 8 * 3, 2),  # a shape entry
            5: flip(clean[5], idx_off + 7, 5),  # one index bit
            6: flip(clean[6], nrm_off + 2 * 1 + 1, 7),  # the sign bit of vector 1's float16 norm
            7: flip(clean[7], seed_off, 0),  # the rotation seed
            8: bytes(len(clean[8])),  # zeroed
            9: flip(clean[9], len(clean[9]) - 1, 6),  # the last byte (v1: norms; v2: key trailer)
        }
        for i, b in corrupt.items():
            paths[i].write_bytes(b)
        got = {}
        for i, k in enumerate(keys):
            got.update({i: t for t in cache.prefetch([k]).values()})
    finally:
        cache.close()

    # Right KV: untouched, and a file longer than the blob (fs reads estimate bytes).
    for i in (0, 3):
        assert i in got and _same(lmc, got[i], clean[i]), i
    # Misses: corrupted structure, truncation, zeroed file.
    for i in (1, 2, 4, 8):
        assert i not in got, i
    if checksum:
        # The CRC32 turns every payload or seed corruption into a miss.
        for i in (5, 6, 7, 9):
            assert i not in got, i
        assert sorted(got) == [0, 3]
    else:
        # v1's blind spots: these decode, silently, to other values.
        for i in (5, 6, 7, 9):
            assert i in got and not _same(lmc, got[i], clean[i]), i
            assert _same(lmc, got[i], corrupt[i]), i  # exactly what the corrupted bytes say
        ref = [np.asarray(tq_jax.loads(clean[i]), np.float32).reshape(-1, HEAD_DIM) for i in (5, 6, 7)]
        out = [lmc["dlpack"].numpy_view(got[i]).astype(np.float32).reshape(-1, HEAD_DIM) for i in (5, 6, 7)]
        changed = [np.any(o != r, axis=1).sum() for o, r in zip(out, ref)]
        assert changed[0] == 1 and changed[1] == 1  # one vector: an index, a norm sign
        assert np.allclose(out[1][np.any(out[1] != ref[1], axis=1)], -ref[1][np.any(out[1] != ref[1], axis=1)])
        assert changed[2] == len(ref[2])  # the seed: every vector, with another rotation
        cos = (out[2] * ref[2]).sum(1) / (np.linalg.norm(out[2], axis=1) * np.linalg.norm(ref[2], axis=1))
        assert abs(cos.mean()) < 0.2
