"""tq_jax._src.kvcache.pallas_gpu's bf16 mode (``Tuning(mode="bf16")``), run by the Pallas
interpreter on CPU, held to dense bf16 attention's accuracy: over the attend matrix of
tests/test_kvcache_gpu_kernel.py plus exact windows and sinks, its error against float64
attention over the same K/V (the blob's decoded vectors where the cache holds codes, the
exact vectors where it holds them) is at most ``BOUND`` times the error of
``jax.nn.dot_product_attention`` over those K/V rounded to bf16. Queries are bf16, so both
outputs are bf16. The exact mode stays float32-level (tests/test_kvcache_gpu_kernel.py);
this file also lowers the bf16 mode to Triton IR for CUDA.

The error is relative RMS over the batch's outputs (``|out - ref|_2 / |ref|_2``): the
largest single element of a bf16 output is one rounding draw (over these fifteen cases the
kernel's max-element ratio spans 0.49-2.46 where its RMS ratio spans 0.67-0.96), the RMS
is the accuracy. docs/accelerator.md has both, per case.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from tq_jax import kvcache
from tq_jax._src.kvcache import pallas_gpu, reference

from kvcache_helpers import D, H, decoded_kv, fill

BOUND = 1.5  # x the error of jax.nn.dot_product_attention in bf16 (docs/accelerator.md)


def _reference_kv(cache, ks, vs):
    """Each sequence's K/V as attention should read them (``reference.read_kv``), float64
    ``[2, T, H, D]``: the blob's decoded vectors, except the exact window and sinks, which
    the cache holds in its dtype (float32 in these tests: the appended values)."""
    cfg = cache.config
    return [reference.read_kv(np.stack([k, v]), decoded_kv(k, v, cfg), window=cfg.window, sinks=cfg.sinks)
            for k, v in zip(ks, vs)]


# jitted: op by op it compiled ~40 programs per shape; the outputs are the same bits
_dpa_xla = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="xla"))


def _dpa_bf16(q, k, v):
    """``jax.nn.dot_product_attention`` over bf16 q ``[Q, Hq, D]``, k/v ``[T, H, D]``, the
    queries at the last Q positions (causal)."""
    n_q, t = q.shape[0], k.shape[0]
    allowed = np.arange(t)[None, :] <= (t - n_q + np.arange(n_q))[:, None]  # [Q, T]
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)[None]  # noqa: E731
    out = _dpa_xla(bf(q), bf(k), bf(v), mask=jnp.asarray(allowed)[None, None])
    return np.asarray(out[0], np.float64)


def _rms_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.sum((out - ref) ** 2) / np.sum(ref**2)))


def _max_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def errors(cache, ks, vs, q, tuning, err=_rms_err):
    """``(kernel error, dot_product_attention error)`` over the batch, both against float64."""
    out = np.asarray(jax.jit(lambda c, x: pallas_gpu.attend(c, x, interpret=True, tuning=tuning))(cache, q), np.float64)
    q64 = np.asarray(q, np.float64)  # the bf16 queries' values
    refs, dpas = [], []
    for b, (k, v) in enumerate(_reference_kv(cache, ks, vs)):
        refs.append(reference.dense_attention(q64[b], k, v))
        dpas.append(_dpa_bf16(q64[b], k, v))
    ref = np.stack(refs)
    return err(out, ref), err(np.stack(dpas), ref)


# the exact mode's matrix (rotation x bits x GQA x paging x q_len), then exact windows and sinks
BITS = [(2, 2), (3, 3), (4, 4), (4, 3), (2, 4), (3, 2)]
CASES = [
    (rot, kb, vb, (1, 3, 4)[i % 3], (None, 8, 16)[i % 3], (1, 3)[i % 2], 0, 0)
    for i, (rot, (kb, vb)) in enumerate(itertools.product(("haar", "hadamard"), BITS))
] + [
    ("hadamard", 4, 4, 4, 8, 1, 8, 2),
    ("haar", 3, 2, 3, None, 3, 8, 4),
    ("haar", 4, 3, 1, 16, 1, 16, 0),
]
QUICK = {12}  # hadamard 4/4 GQA 4 paged, with a window and sinks (haar 4/4 runs quick at head_dim 128 below)
MATRIX = [
    pytest.param(*case, marks=() if i in QUICK else pytest.mark.slow,
                 id=f"{case[0]}-{case[1]}/{case[2]}-gqa{case[3]}-page{case[4]}-q{case[5]}-w{case[6]}s{case[7]}")
    for i, case in enumerate(CASES)
]


@pytest.mark.parametrize("rotation,kb,vb,group,page_size,q_len,window,sinks", MATRIX)
def test_bf16_mode_error_is_within_dense_bf16_attentions(rotation, kb, vb, group, page_size, q_len, window, sinks):
    rng = np.random.default_rng(kb * 10 + vb + group + window)
    cache = kvcache.init(3, 48, H, D, key_bits=kb, value_bits=vb, rotation=rotation, seed=11, page_size=page_size,
                         dtype=jnp.float32, block_tokens=16, window=window, sinks=sinks)
    cache, ks, vs = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])  # ragged: 32, 27, 25
    q = jnp.asarray(rng.standard_normal((3, q_len, H * group, D)), jnp.bfloat16)
    kernel, dpa = errors(cache, ks, vs, q, pallas_gpu.Tuning(mode="bf16", block=16, splits=2))
    assert kernel <= BOUND * dpa, (kernel, dpa, kernel / dpa)


@pytest.mark.parametrize("init_kw,group,page_size,window,sinks", [
    pytest.param(dict(key_bits=4, value_bits=4, rotation="haar"), 4, None, 0, 0, id="4/4-haar-gqa4-unpaged"),
    pytest.param(dict(options="turbo-3.5"), 4, 16, 16, 4, marks=pytest.mark.slow, id="turbo-3.5-gqa4-page16-w16s4"),
    pytest.param(dict(key_bits=3, value_bits=3, rotation="hadamard"), 3, 8, 0, 0, marks=pytest.mark.slow,
                 id="3/3-hadamard-gqa3-page8"),
])
def test_bf16_mode_bound_at_head_dim_128(init_kw, group, page_size, window, sinks):
    """The benchmark's head_dim (64-wide 4-bit lanes, 16-wide 3-bit lanes), a preset with norm
    correction among them: the reference decodes each sequence's ``export``, which equals
    ``dumps`` of its K/V (tests/test_kvcache.py)."""
    dim, heads, batch = 128, 2, 2
    rng = np.random.default_rng(group + window)
    cache = kvcache.init(batch, 64, heads, dim, seed=11, page_size=page_size, dtype=jnp.float32, block_tokens=16,
                         window=window, sinks=sinks, **init_kw)
    n = [40, 29]
    k = rng.standard_normal((batch, 40, heads, dim)).astype(np.float32)
    v = rng.standard_normal((batch, 40, heads, dim)).astype(np.float32)
    cache = kvcache.append(cache, k, v, new_lengths=np.array(n))
    q = jnp.asarray(rng.standard_normal((batch, 1, heads * group, dim)), jnp.bfloat16)
    out = np.asarray(jax.jit(lambda c, x: pallas_gpu.attend(c, x, interpret=True, tuning=pallas_gpu.Tuning(
        mode="bf16", block=16, splits=2)))(cache, q), np.float64)
    q64 = np.asarray(q, np.float64)
    refs, dpas = [], []
    for b in range(batch):
        decoded = np.asarray(tq_jax.loads(kvcache.export(cache, seq=b), dtype=jnp.float32))[:, 0]
        exact = np.stack([k[b, : n[b]], v[b, : n[b]]])
        kb, vb = reference.read_kv(exact, decoded, window=window, sinks=sinks)
        refs.append(reference.dense_attention(q64[b], kb, vb))
        dpas.append(_dpa_bf16(q64[b], kb, vb))
    ref = np.stack(refs)
    kernel, dpa = _rms_err(out, ref), _rms_err(np.stack(dpas), ref)
    assert kernel <= BOUND * dpa, (kernel, dpa, kernel / dpa)


def test_bf16_mode_through_attend_and_its_tuning_argument():
    rng = np.random.default_rng(3)
    cache = kvcache.init(3, 48, H, D, key_bits=4, value_bits=3, rotation="hadamard", seed=11, page_size=8,
                         dtype=jnp.float32, block_tokens=16, window=8, sinks=2)
    cache, ks, vs = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    q = jnp.asarray(rng.standard_normal((3, 1, H * 4, D)), jnp.bfloat16)
    tuning = pallas_gpu.Tuning(mode="bf16", block=32)  # splits: the default, one program per block here
    out = np.asarray(kvcache.attend(cache, q, impl="pallas_gpu", tuning=tuning), np.float64)
    from tq_jax._src.kvcache import attention

    traces = attention._attend_jit._cache_size()
    kvcache.attend(cache, q, impl="pallas_gpu", tuning=pallas_gpu.Tuning(mode="bf16", block=32))  # an equal tuning
    assert attention._attend_jit._cache_size() == traces  # is the same static argument: no recompile
    direct = np.asarray(jax.jit(lambda c, x: pallas_gpu.attend(c, x, interpret=True, tuning=tuning))(cache, q), np.float64)
    np.testing.assert_array_equal(out, direct)
    exact = np.asarray(kvcache.attend(cache, q, impl="pallas_gpu"), np.float64)  # tuning=None: the exact mode
    assert 0 < np.abs(out - exact).max() <= 2e-2 * np.abs(exact).max()
    with pytest.raises(ValueError, match="`tuning` is the GPU kernel's .* impl='xla'"):
        kvcache.attend(cache, q, impl="xla", tuning=tuning)


@pytest.mark.parametrize("kb,vb,page_size", [(4, 4, None), pytest.param(4, 3, 8, marks=pytest.mark.slow),
                                              pytest.param(2, 4, 16, marks=pytest.mark.slow)])
def test_pair_lookup_equals_the_gather_bit_for_bit(kb, vb, page_size):
    rng = np.random.default_rng(kb + vb)
    cache = kvcache.init(3, 48, H, D, key_bits=kb, value_bits=vb, rotation="haar", seed=11, page_size=page_size,
                         dtype=jnp.float32, block_tokens=16, window=8, sinks=2)
    cache, _, _ = fill(cache, rng, first=[16, 11, 16], second=[16, 16, 9])
    q = jnp.asarray(rng.standard_normal((3, 1, H * 4, D)), jnp.bfloat16)
    run = lambda t: np.asarray(jax.jit(lambda c, x: pallas_gpu.attend(c, x, interpret=True, tuning=t))(cache, q))  # noqa: E731
    gather = run(pallas_gpu.Tuning(mode="bf16", block=16, splits=2))
    np.testing.assert_array_equal(run(pallas_gpu.Tuning(mode="bf16", block=16, splits=2, lookup="pair")), gather)


def test_pair_table_holds_both_nibbles_bf16_bits():
    c = np.linspace(-1.5, 1.5, 16).astype(np.float32)
    t = pallas_gpu.pair_table(c).view(np.uint32)
    as_bf16 = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    byte = np.arange(256)
    np.testing.assert_array_equal(as_bf16(t & 0xFFFF), c.astype(jnp.bfloat16).astype(np.float32)[byte & 15])
    np.testing.assert_array_equal(as_bf16(t >> 16), c.astype(jnp.bfloat16).astype(np.float32)[byte >> 4])
    with pytest.raises(ValueError, match="16 centroids of 4-bit codes, got 8"):
        pallas_gpu.pair_table(c[:8])


def test_bf16_mode_defaults_and_bad_mode():
    assert pallas_gpu.Tuning().block_tokens == 64 and pallas_gpu.Tuning().mode == "exact"
    assert pallas_gpu.BF16_TUNING.block_tokens == 128 and pallas_gpu.BF16_TUNING.mode == "bf16"
    assert pallas_gpu.Tuning(mode="bf16", block=256).block_tokens == 256
    with pytest.raises(ValueError, match="`mode` must be one of \\('exact', 'bf16'\\), got 'fp8'"):
        pallas_gpu.Tuning(mode="fp8")
    with pytest.raises(ValueError, match="`lookup='pair'` needs mode='bf16'"):
        pallas_gpu.Tuning(lookup="pair")


@pytest.mark.parametrize(
    "kb,vb,rotation,page_size,group,q_len,dim,tuning",
    [
        (4, 4, "haar", None, 4, 1, 128, pallas_gpu.BF16_TUNING),  # the benchmark's 4/4: bf16 dots on 64-wide lanes
        (3, 3, "hadamard", 16, 3, 1, 128, pallas_gpu.Tuning(mode="bf16", block=256, lookup="select")),  # 16-wide lanes
        (3, 2, "haar", 8, 4, 3, 64, pallas_gpu.Tuning(mode="bf16", num_warps=8)),  # 8-wide key lanes: multiply-reduce
        (4, 3, "hadamard", 16, 4, 1, 128, pallas_gpu.Tuning(mode="bf16", lookup="pair")),  # pairs for K, gather for V
    ],
)
def test_bf16_mode_lowers_to_triton_ir_for_cuda(kb, vb, rotation, page_size, group, q_len, dim, tuning):
    cache = kvcache.init(2, 300, 2, dim, key_bits=kb, value_bits=vb, rotation=rotation, seed=3, page_size=page_size)
    q = jax.ShapeDtypeStruct((2, q_len, 2 * group, dim), jnp.bfloat16)
    fn = jax.jit(lambda c, x: pallas_gpu.attend(c, x, interpret=False, tuning=tuning))
    text = fn.trace(cache, q).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1  # one Triton kernel, the rest is XLA
    assert "tq_decode_k%dv%d_bf16" % (kb, vb) in text


def test_mosaic_gpu_lowering_is_not_checked_on_cpu():
    pytest.skip(
        "no Mosaic GPU kernel ships, so there is no Mosaic GPU lowering to check: both modes are the Triton kernel "
        "(tq_jax/_src/kvcache/pallas_gpu.py). A CPU jaxlib can lower Pallas to Mosaic GPU (jax 0.10.2 lowers a toy "
        "kernel for 'cuda'), so a Mosaic GPU kernel, once one is measured faster on a GPU, gets its lowering test "
        "here; docs/accelerator.md."
    )
