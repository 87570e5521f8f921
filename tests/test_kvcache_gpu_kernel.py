"""tq_jax._src.kvcache.pallas_gpu: the Pallas/Triton decode kernel, run by the Pallas
interpreter on CPU, against dense float64 attention over the decoded blob
(``tq_jax._src.kvcache.reference``; tests/test_kvcache.py also runs this kernel through its
impl-parametrized tests), plus its lowering to Triton IR for CUDA (JAX lowers for a
platform it does not run on, so Triton lowering errors show up here too).
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tq_jax import kvcache
from tq_jax._src.kvcache import pallas_gpu, scoring
from tq_jax._src.kvcache.reference import dense_attention

from kvcache_helpers import D, H, decoded_kv, fill


def _decoded(cache, ks, vs):
    """Each sequence's K/V as the blob decodes them: float64 ``[2, T, H, D]``."""
    return [decoded_kv(k, v, cache.config) for k, v in zip(ks, vs)]


def _attend(cache, q, tuning=pallas_gpu.DEFAULT_TUNING):
    return jax.jit(lambda c, x: pallas_gpu.attend(c, x, interpret=True, tuning=tuning))(cache, q)


# rotation x (key, value bits) x GQA x paging, cycled so every value of each axis appears
BITS = [(2, 2), (3, 3), (4, 4), (4, 3), (2, 4), (3, 2)]
MATRIX = [
    pytest.param(rot, kb, vb, (1, 3, 4)[i % 3], (None, 8, 16)[i % 3], (1, 3)[i % 2], marks=pytest.mark.slow,
                 id=f"{rot}-{kb}/{vb}-gqa{(1, 3, 4)[i % 3]}-page{(None, 8, 16)[i % 3]}-q{(1, 3)[i % 2]}")
    for i, (rot, (kb, vb)) in enumerate(itertools.product(("haar", "hadamard"), BITS))
]


@pytest.mark.parametrize("rotation,kb,vb,group,page_size,q_len", MATRIX)
def test_attend_matrix_matches_dense_attention_over_decoded_blob(rotation, kb, vb, group, page_size, q_len):
    rng = np.random.default_rng(kb * 10 + vb + group)
    cache = kvcache.init(3, 48, H, D, key_bits=kb, value_bits=vb, rotation=rotation, seed=11, page_size=page_size, dtype=jnp.float32,
                         block_tokens=16, window=0, sinks=0)
    cache, ks, vs = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])  # ragged: 32, 27, 25
    q = rng.standard_normal((3, q_len, H * group, D)).astype(np.float32)
    out = np.asarray(_attend(cache, q, pallas_gpu.Tuning(block=16, splits=2)))
    for b, (k, v) in enumerate(_decoded(cache, ks, vs)):
        ref = dense_attention(q[b], k, v)
        assert np.abs(out[b] - ref).max() <= 1e-3 * np.abs(ref).max()


# Slow: seconds in the interpreter. The kernel at its default tuning runs quick through
# kvcache.attend (test_kvcache, test_kvcache_window); these tunings and row tiles run here.
@pytest.mark.slow
def test_splits_row_tiles_and_both_lookups_agree_with_the_xla_path():
    rng = np.random.default_rng(5)
    cache = kvcache.init(3, 48, H, D, key_bits=4, value_bits=3, rotation="hadamard", seed=11, page_size=8, dtype=jnp.float32, block_tokens=16, window=0, sinks=0)
    cache, _, _ = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    q = rng.standard_normal((3, 24, H * 3, D)).astype(np.float32)  # 72 rows: two row tiles of 64
    ref = np.asarray(kvcache.attend(cache, q, impl="xla"))
    for tuning in (pallas_gpu.Tuning(block=16, splits=3, lookup="gather"), pallas_gpu.Tuning(block=32, splits=1)):
        out = np.asarray(_attend(cache, q, tuning))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


# Slow: seconds a case in the interpreter. The quick tier runs this kernel's partial state
# through attend, merged with an exact window and sinks (test_kvcache_window's pallas_gpu case).
@pytest.mark.slow
@pytest.mark.parametrize("page_size", [None, 8])
def test_partial_returns_the_online_softmax_state_of_the_coded_tokens_only(page_size):
    rng = np.random.default_rng(9)
    base = kvcache.init(3, 48, H, D, key_bits=3, value_bits=4, rotation="haar", seed=11, page_size=page_size, dtype=jnp.float32,
                        block_tokens=16, window=0, sinks=0)
    base, ks, vs = fill(base, rng, first=[16, 11, 16], second=[16, 16, 9])  # 32, 27, 25 tokens
    sinks = 4
    cache = dataclasses.replace(base, config=dataclasses.replace(base.config, sinks=sinks))
    hi = np.array([20, 27, 3], np.int32)  # the last tokens (a window) are not coded; seq 2 keeps only sinks-range
    sink_lo = np.array([2, 0, 1], np.int32)  # tokens sink_lo..sinks-1 are exact sinks, not coded
    q = rng.standard_normal((3, 2, H * 4, D)).astype(np.float32)
    query = scoring.query(cache, q)._replace(hi=jnp.asarray(hi), sink_lo=jnp.asarray(sink_lo))
    m, l, acc = pallas_gpu.partial(cache, query, interpret=True, tuning=pallas_gpu.Tuning(block=16, splits=2))
    out = np.asarray(scoring.finish(cache, q, acc, l))
    m, l = np.asarray(m), np.asarray(l)  # [B, H, R], row r = g * q_len + i
    lengths = np.asarray(cache.lengths)
    for b, (k, v) in enumerate(_decoded(cache, ks, vs)):
        t = np.arange(lengths[b])
        coded = (t < hi[b]) & ((t < sink_lo[b]) | (t >= sinks))
        last = lengths[b] - 2 + np.arange(2)
        for i in range(2):  # query i: dense attention over the coded tokens it sees
            seen = coded & (t <= last[i])
            qi = q[b, i].reshape(H, 4, D).astype(np.float64)
            s = np.einsum("hgd,thd->hgt", qi, k[seen].astype(np.float64)) / np.sqrt(D)  # [H, G, T']
            if not seen.any():
                assert (m[b, :, i::2] == -np.inf).all() and not l[b, :, i::2].any() and not out[b, i].any()
                continue
            top = s.max(-1)
            np.testing.assert_allclose(m[b, :, i::2], top, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(l[b, :, i::2], np.exp(s - top[..., None]).sum(-1), rtol=1e-4)
            ref = dense_attention(q[b, i : i + 1], k[seen], v[seen])[0]  # all seen tokens precede the query
            assert np.abs(out[b, i] - ref).max() <= 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize(
    "kb,vb,rotation,page_size,group,q_len,dim,tuning",
    [
        (4, 3, "hadamard", 16, 4, 1, 128, pallas_gpu.Tuning()),  # the benchmark's K4V3: dots on every lane
        (3, 3, "haar", 8, 3, 3, 64, pallas_gpu.Tuning(lookup="gather", dot="tf32x3")),  # 8-wide lanes: multiply-reduce
    ],
)
def test_kernel_lowers_to_triton_ir_for_cuda(kb, vb, rotation, page_size, group, q_len, dim, tuning):
    cache = kvcache.init(2, 100, 2, dim, key_bits=kb, value_bits=vb, rotation=rotation, seed=3, page_size=page_size, window=0, sinks=0)
    q = jax.ShapeDtypeStruct((2, q_len, 2 * group, dim), jnp.bfloat16)
    fn = jax.jit(lambda c, x: pallas_gpu.attend(c, x, interpret=False, tuning=tuning))
    text = fn.trace(cache, q).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1  # one Triton kernel, the rest is XLA


def test_attend_exports_for_cuda_with_the_triton_kernel_from_this_cpu_host():
    """jax.export for platforms=["cuda"] on this CPU host: attend's program holds the Triton
    kernel (the target's form, not the interpreter) for impl "pallas_gpu";
    "auto" traced off a GPU host is the XLA loop (resolve_impl). Triton calls are not among
    export's stable custom calls (their IR is tied to the jax version), so the export names
    the check it waives."""
    cache = jax.eval_shape(lambda: kvcache.init(4, 512, 2, 128, key_bits=4, value_bits=3, page_size=16))
    q = jax.ShapeDtypeStruct((4, 1, 8, 128), jnp.bfloat16)
    triton = "__gpu$xla.gpu.triton"
    for impl, kernels in (("pallas_gpu", 1), ("auto", 0)):
        exported = jax.export.export(
            jax.jit(lambda c, x, impl=impl: kvcache.attend(c, x, impl=impl)), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)],
        )(cache, q)
        assert exported.mlir_module().count(f"stablehlo.custom_call @{triton}") == kernels, impl
    loaded = jax.export.deserialize(exported.serialize())
    assert loaded.platforms == ("cuda",) and loaded.mlir_module() == exported.mlir_module()


def test_bad_tuning_and_unsupported_head_dim_are_clear_errors():
    with pytest.raises(ValueError, match="`block` must be a power of two >= 16, got 48"):
        pallas_gpu.Tuning(block=48)
    with pytest.raises(ValueError, match="`lookup` must be one of"):
        pallas_gpu.Tuning(lookup="table")
    with pytest.raises(ValueError, match="`splits` must be None or an int >= 1, got 0"):
        pallas_gpu.Tuning(splits=0)
    cache = kvcache.init(1, 16, 1, 96, key_bits=4, value_bits=4, rotation="haar", seed=3, window=0, sinks=0)  # 96 / 2 = 48-wide lanes: not a Triton tile
    with pytest.raises(ValueError, match="head_dim=96 .* use impl='xla'"):
        kvcache.attend(cache, np.zeros((1, 1, 1, 96), np.float32), impl="pallas_gpu")


def test_auto_impl_is_the_gpu_kernel_on_a_gpu_when_head_dim_tiles(monkeypatch):
    from tq_jax._src.kvcache import attention

    tiles = kvcache.init(1, 16, 1, 64, key_bits=4, value_bits=3, window=0, sinks=0)
    odd = kvcache.init(1, 16, 1, 96, key_bits=4, value_bits=4, window=0, sinks=0)  # 48-wide lanes
    assert attention.resolve_impl(tiles, "auto") == "xla"  # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attention.resolve_impl(tiles, "auto") == "pallas_gpu"
    assert attention.resolve_impl(odd, "auto") == "xla"
    assert attention.resolve_impl(tiles, "xla") == "xla"


def test_auto_falls_back_to_xla_with_one_warning_on_a_gpu_without_triton(monkeypatch):
    """A jax without Pallas's Triton backend (jax 0.11 deprecated it), simulated on CPU:
    the backend reads as a GPU and the module cannot be imported."""
    import sys

    import jax.experimental.pallas as pallas_pkg

    from tq_jax._src.kvcache import attention

    rng = np.random.default_rng(4)
    cache = kvcache.init(3, 48, H, D, key_bits=4, value_bits=4, rotation="haar", seed=11, dtype=jnp.float32,
                         block_tokens=16, window=8, sinks=2)
    cache, _, _ = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    q = rng.standard_normal((3, 1, H * 2, D)).astype(np.float32)
    ref = np.asarray(kvcache.attend(cache, q, impl="xla"))
    assert pallas_gpu.available()  # this jax has it

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delattr(pallas_pkg, "triton", raising=False)
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)  # the import now fails
    monkeypatch.setattr(attention, "_warned", set())
    assert not pallas_gpu.available()
    with pytest.warns(RuntimeWarning, match="runs the XLA loop on this GPU: jax .* has no Pallas Triton backend") as rec:
        assert attention.resolve_impl(cache, "auto") == "xla"
        out = np.asarray(kvcache.attend(cache, q))  # impl="auto"
        np.asarray(kvcache.attend(cache, q, tuning=pallas_gpu.BF16_TUNING))  # a tuning is ignored by the fallback
    assert len(rec) == 1  # once per process, not per call
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(RuntimeError, match="impl='pallas_gpu' needs Pallas's Triton backend .* use impl='xla'"):
        kvcache.attend(cache, q, impl="pallas_gpu")
    with pytest.raises(RuntimeError, match="needs Pallas's Triton backend"):
        pallas_gpu.compiler_params(4, 2)
