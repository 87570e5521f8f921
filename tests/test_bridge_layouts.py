"""The serde's ``kv_layout``: which vectors of an LMCache chunk are keys and which are values.

The chunks come from LMCache's own gather (``gather_paged_kv_to_cpu``) over engine KV
caches built as each vLLM backend fills them, so the test checks the serde against
LMCache's real chunk order, not against the serde's own description of it. The
expectation is independent of the code under test: with ``key_bits=8, value_bits=2``
the keys must come back at 8-bit error and the values at 2-bit error (Lloyd–Max
expected MSE of the unit vector: ``codebook.expected_mse``), and raw layers exactly.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from lmcache.v1.multiprocess.transfer_context.base import gather_paged_kv_to_cpu  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax._src import codebook  # noqa: E402
from tq_jax.bridge._src import layouts  # noqa: E402
from tq_jax.bridge._src import serde as S  # noqa: E402

from bridge_util import byte_obj, key, layout, make_obj  # noqa: E402

from conftest import LMCACHE_WARNINGS

pytestmark = LMCACHE_WARNINGS
BF16 = torch.bfloat16
NL, NB, NH, BS, HS = 3, 4, 2, 16, 32  # layers, engine blocks, KV heads, block size, head size
BLOCKS = [2, 0, 3, 1]  # the chunk's pages, out of order
CHUNK_T = len(BLOCKS) * BS


def _gather(caches: dict) -> torch.Tensor:
    (chunk,) = gather_paged_kv_to_cpu(caches, BLOCKS, blocks_per_chunk=len(BLOCKS))
    return chunk


def _caches(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(BF16) for i in range(NL)}


def _tokens(cache_kv: torch.Tensor) -> np.ndarray:
    """``[NB, NH, BS, HS]`` per-block K or V -> ``[CHUNK_T, NH, HS]`` in the chunk's token order."""
    return cache_kv[BLOCKS].permute(0, 2, 1, 3).reshape(CHUNK_T, NH, HS).float().numpy()


def fused_gpu():
    """vLLM's GPU FlashAttention/Triton cache ``[NB, NH, BS, 2*HS]``: per token, K then V."""
    caches = _caches((NB, NH, BS, 2 * HS))
    k = np.stack([_tokens(c[..., :HS]) for c in caches.values()])
    v = np.stack([_tokens(c[..., HS:]) for c in caches.values()])
    return _gather(caches), k, v


def vllm_cpu():
    """vLLM's CPU attention cache: the same ``[NB, NH, BS, 2*HS]`` tensor, which
    ``cpu_attn.py`` views as ``[NB, NH, 2*BS, HS]`` and splits on axis 2: each (block,
    head) region holds its keys, then its values. Its vec/vec16 kernels write a block's
    keys dimension-major (``[HS, BS]``) and its values token-major (``[BS, HS]``);
    tests/test_vllm_lmcache.py checks that against vLLM's own ``reshape_and_cache``."""
    g = torch.Generator().manual_seed(1)
    caches, ks, vs = {}, [], []
    for i in range(NL):
        k, v = torch.randn(2, NB, NH, BS, HS, generator=g).to(BF16)
        region = torch.cat([k.transpose(-1, -2).reshape(NB, NH, HS * BS), v.reshape(NB, NH, BS * HS)], dim=-1)
        caches[f"model.layers.{i}.self_attn.attn"] = region.view(NB, NH, BS, 2 * HS)
        ks.append(_tokens(k))
        vs.append(_tokens(v))
    return _gather(caches), np.stack(ks), np.stack(vs)


def split():
    """``[2, NB, NH, BS, HS]``, LMCache's split K/V planes: the chunk is ``[2, L, T, H*D]``."""
    caches = _caches((2, NB, NH, BS, HS), seed=2)
    k = np.stack([_tokens(c[0]) for c in caches.values()])
    v = np.stack([_tokens(c[1]) for c in caches.values()])
    return _gather(caches), k, v


def latent():
    """MLA ``[NB, BS, D]``: the chunk is ``[L, T, D]``, one latent vector per token."""
    caches = _caches((NB, BS, 2 * HS), seed=3)
    lat = np.stack([c[BLOCKS].reshape(CHUNK_T, 1, 2 * HS).float().numpy() for c in caches.values()])
    return _gather(caches), lat, None


ENGINES = {"fused": fused_gpu, "vllm-cpu": vllm_cpu, "split": split}


def _round_trip(chunk, head_dim, **kw):
    if kw.get("kv_layout") == "vllm-cpu":
        kw.setdefault("block_size", BS)  # the engine caches' block size
    layout_kw = {k: kw.pop(k) for k in ("kv_layout", "block_size") if k in kw}
    ser = S.TQJaxSerializer(head_dim=head_dim, **layout_kw, **kw)
    de = S.TQJaxDeserializer(**layout_kw)
    src = make_obj([chunk.shape], [chunk.dtype])
    src.tensor.copy_(chunk)
    n = ser.estimate_serialized_size(layout([chunk.shape], [chunk.dtype]))
    buf = byte_obj(n)
    assert ser.serialize(src, buf, key(0)) == n
    out = make_obj([chunk.shape], [chunk.dtype])
    out.tensor.fill_(-7)
    de.deserialize(buf, out, key(0))
    return bytes(buf.tensor.numpy()), out.tensor.clone()


def _parts(chunk: torch.Tensor, engine: str):
    """The chunk's K and V vectors, read by the engine's layout (the gathers above)."""
    x = chunk.float().numpy()
    if engine == "split":
        return x[0].reshape(NL, CHUNK_T, NH, HS), x[1].reshape(NL, CHUNK_T, NH, HS)
    if engine == "fused":
        x = x.reshape(NL, CHUNK_T, NH, 2, HS)
        return x[..., 0, :], x[..., 1, :]
    # vllm-cpu: chunk row t of head h is row t % BS of its (block, head) region's [BS, 2*HS]
    # view; the region is the block's keys [HS, BS], then its values [BS, HS]
    nb = len(BLOCKS)
    region = x.reshape(NL, nb, BS, NH, 2 * HS).transpose(0, 1, 3, 2, 4).reshape(NL, nb, NH, 2 * BS * HS)
    k = region[..., : BS * HS].reshape(NL, nb, NH, HS, BS).transpose(0, 1, 4, 2, 3)
    v = region[..., BS * HS :].reshape(NL, nb, NH, BS, HS).transpose(0, 1, 3, 2, 4)
    return k.reshape(NL, CHUNK_T, NH, HS), v.reshape(NL, CHUNK_T, NH, HS)


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _bits_error(bits: int) -> float:
    """The relative error of a vector's Lloyd–Max code: sqrt(dim * expected MSE per coordinate)."""
    return math.sqrt(HS * codebook.expected_mse(HS, bits))


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_gathered_chunk_parts_are_the_engines_keys_and_values(engine):
    """The test's own reading of each gathered chunk (``_parts``) is right: it returns the
    engine cache's keys and values, token by token, independently of the serde."""
    chunk, k, v = ENGINES[engine]()
    kk, vv = _parts(chunk, engine)
    np.testing.assert_array_equal(kk, k)
    np.testing.assert_array_equal(vv, v)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_keys_and_values_get_their_own_bits(engine):
    chunk, k, v = ENGINES[engine]()
    kv_layout = "auto" if engine == "fused" else engine  # auto reads [L, T, H*2*D] as fused
    blob, out = _round_trip(chunk, HS, key_bits=8, value_bits=2, kv_layout=kv_layout)
    ko, vo = _parts(out, engine)
    ek, ev = _rel(ko, k), _rel(vo, v)
    assert ek < 1.5 * _bits_error(8) + 0.01, (ek, _bits_error(8))  # bf16 output adds ~0.004
    assert 0.7 * _bits_error(2) < ev < 1.3 * _bits_error(2), (ev, _bits_error(2))
    # the blob is a K/V tensor: slot 0 the keys, slot 1 the values (as a split engine stores them)
    h = tq_jax.peek_header(np.frombuffer(blob, np.uint8))
    assert h.kv_layout and (h.bits, h.value_bits) == (8, 2) and h.shape[0] == 2
    stored = np.asarray(tq_jax.loads(blob), np.float32)
    if engine == "vllm-cpu":  # the same per-token vectors, tokens as (blocks, block)
        assert stored.shape == (2, NL, len(BLOCKS), BS, NH, HS)
        stored = stored.reshape(2, NL, CHUNK_T, NH, HS)
    assert stored.shape == (2, NL, CHUNK_T, NH, HS)
    assert _rel(stored[0], k) < 0.02 and _rel(stored[1], v) > 0.2


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_raw_edge_layers_come_back_exactly(engine):
    chunk, _, _ = ENGINES[engine]()
    kv_layout = "auto" if engine == "fused" else engine
    _, out = _round_trip(chunk, HS, bits=3, skip_first_layers=1, skip_last_layers=1, kv_layout=kv_layout, rotation="hadamard")
    if engine == "split":
        assert torch.equal(out[:, 0], chunk[:, 0]) and torch.equal(out[:, -1], chunk[:, -1])
        assert not torch.equal(out[:, 1], chunk[:, 1])
    else:
        assert torch.equal(out[0], chunk[0]) and torch.equal(out[-1], chunk[-1])
        assert not torch.equal(out[1], chunk[1])


def test_wrong_layout_for_a_cpu_chunk_costs_quality_not_correctness():
    """A CPU vLLM chunk read as ``fused`` (the launcher warns about it): every vector
    still round-trips, but half of the keys get value bits."""
    chunk, k, v = vllm_cpu()
    _, out = _round_trip(chunk, HS, key_bits=8, value_bits=2, kv_layout="fused")
    ko, vo = _parts(out, "vllm-cpu")
    assert _rel(ko, k) > 0.2 and _rel(vo, v) > 0.2  # mixed: neither at its own bits


def test_latent_chunk_takes_key_bits_and_raw_layers():
    chunk, lat, _ = latent()
    blob, out = _round_trip(chunk, 2 * HS, key_bits=8, value_bits=2, skip_first_layers=1)
    h = tq_jax.peek_header(np.frombuffer(blob, np.uint8))
    assert h.shape == (1, NL, CHUNK_T, 1, 2 * HS) and h.kv_layout
    assert torch.equal(out[0], chunk[0])
    assert _rel(out.float().numpy()[1:], chunk.float().numpy()[1:]) < 0.02


def test_v1_settings_keep_the_chunks_own_order_when_its_rows_are_tokens():
    """With the reference's settings a ``fused`` chunk's blob is version 1 in the chunk's
    own order, byte for byte ``dumps`` of the chunk split into heads (what the reference
    writes); a ``vllm-cpu`` chunk's rows are not tokens' vectors, so it is stored in K/V
    order even then, still version 1."""
    chunk, k, v = fused_gpu()
    blob, _ = _round_trip(chunk, HS, bits=4, kv_layout="fused")
    heads = chunk.float().numpy().astype(jnp.bfloat16).reshape(NL, CHUNK_T, 2 * NH, HS)
    assert blob == tq_jax.dumps(heads, bits=4)
    chunk, k, v = vllm_cpu()
    blob, out = _round_trip(chunk, HS, bits=4, kv_layout="vllm-cpu")
    h = tq_jax.peek_header(np.frombuffer(blob, np.uint8))
    assert h.version == 1 and h.shape == (2, NL, len(BLOCKS), BS, NH, HS)
    kv = np.stack([k, v]).astype(jnp.bfloat16).reshape(h.shape)
    assert blob == tq_jax.dumps(kv, bits=4)


@pytest.mark.parametrize("preset", ["turbo-4", "turbo-4t", "turbo-3.5", "turbo-2.5"])
@pytest.mark.parametrize("engine", ["fused", "vllm-cpu"])
def test_presets_on_single_plane_chunks_round_trip_with_exact_sizes(engine, preset):
    chunk, k, v = ENGINES[engine]()
    _, out = _round_trip(chunk, HS, kv_layout=engine, **tq_jax.PRESETS[preset])
    ko, vo = _parts(out, engine)
    p = tq_jax.PRESETS[preset]
    assert _rel(ko, k) < 1.3 * _bits_error(p["key_bits"]) + 0.01
    assert _rel(vo, v) < 1.3 * _bits_error(p["value_bits"]) + 0.01
    assert _rel(ko, k) < _rel(vo, v)


def test_a_reader_with_another_layout_refuses_the_blob():
    chunk, _, _ = fused_gpu()
    blob, _ = _round_trip(chunk, HS, key_bits=5, value_bits=3, kv_layout="fused")
    buf = byte_obj(len(blob))
    buf.tensor.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    out = make_obj([chunk.shape], [BF16])
    with pytest.raises(ValueError, match=r"kv_layout changed"):
        S.TQJaxDeserializer(kv_layout="vllm-cpu", block_size=BS).deserialize(buf, out, key(0))
    S.TQJaxDeserializer(kv_layout="auto").deserialize(buf, out, key(0))  # auto == fused here


def test_layout_errors_name_the_option_to_change():
    with pytest.raises(ValueError, match="2\\*head_dim = 64"):
        layouts.form((3, 32, 96), 32, "fused")
    with pytest.raises(ValueError, match="block_size=48"):
        layouts.form((3, 64, 128), 32, "vllm-cpu", 48)
    with pytest.raises(ValueError, match="expects \\[layers, tokens, H\\*2\\*head_dim\\]"):
        layouts.form((2, 3, 64, 128), 32, "fused")
    ser = S.TQJaxSerializer(head_dim=32, key_bits=4, value_bits=2)  # auto: [L, T, 3*32] is neither
    with pytest.raises(ValueError, match="no key/value"):
        ser.estimate_serialized_size(layout([(3, 64, 96)], [BF16]))
    with pytest.raises(ValueError, match="kv_layout"):
        S.TQJaxSerializer(head_dim=32, kv_layout="nhd")


def test_to_stored_and_back_are_inverse_permutations():
    rng = np.random.default_rng(0)
    for shape, name, block in [((3, 64, 256), "fused", 0), ((3, 64, 256), "vllm-cpu", 16), ((3, 64, 256), "vllm-cpu", 64),
                               ((3, 64, 512), "vllm-cpu", 4), ((3, 64, 128), "vllm-cpu", 32),
                               ((3, 96, 192), "vllm-cpu", 48),  # neither block nor 2*D divides the other
                               ((2, 3, 64, 128), "split", 0), ((3, 64, 32), "latent", 0)]:
        f = layouts.form(shape, 32, name, block or 128)
        x = rng.standard_normal(shape)
        y = np.ascontiguousarray(layouts.to_stored(x, f, True))
        assert y.shape == f.kv and sorted(y.ravel()) == sorted(x.ravel())
        np.testing.assert_array_equal(layouts.from_stored(y, f, True), x)
        out = np.empty_like(x)
        layouts.restore_into(y, f, True, out)
        np.testing.assert_array_equal(out, x)


def test_docs_vllm_sizes_are_the_serializers():
    """docs/vllm.md's bytes-per-chunk table for SmolLM2's CPU chunk, read off the page."""
    import re
    from pathlib import Path

    from tq_jax.bridge._src import registry

    text = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    rows = dict(re.findall(r"^\| `(\{\}|\"\w+\": [^`]+)`[^|]*\| ([\d,]+) \|", text, re.M))
    assert set(rows) == {"{}", '"bits": 4', '"preset": "turbo-4t"', '"preset": "turbo-3.5"', '"format": "v1"'}
    raw = layout([(30, 256, 384)], [BF16])
    for key, nbytes in rows.items():
        o = registry.parse_options({"head_dim": 64, "kv_layout": "vllm-cpu", **json.loads("{" + key.strip("{}") + "}")})
        ser, _ = registry.build_serde(o)
        assert ser.estimate_serialized_size(raw) == int(nbytes.replace(",", "")), key
