"""tq_jax.adapters.easydel against EasyDeL itself: a tiny Llama built by EasyDeL, attended
over tq_jax's pool, checked against the same model on EasyDeL's own bfloat16 cache.

These tests need the easydel environment (easydel 0.3.0 pins jax 0.9): in any other
environment they skip, naming the install command. CI runs them in one (README).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import numpy as np
import pytest

try:
    from tq_jax.adapters import easydel as tq_easydel
except ImportError as e:  # easydel missing (or another version): the message names the install command
    pytest.skip(str(e), allow_module_level=True)

import easydel as ed  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from easydel.caching import RaggedPagesMetadata  # noqa: E402
from easydel.utils import set_inference_mode  # noqa: E402
from flax import nnx  # noqa: E402

PAGE = 16
VOCAB = 96
WORDS = [f"w{i}" for i in range(VOCAB - 1)]


@pytest.fixture(scope="module")
def budget():
    """EasyDeL sizes page pools on CPU from an assumed 4 GiB (a CPU reports no memory
    stats); the tests give every pool 4 MiB instead."""
    import easydel.caching.ragged_page.cache as rpc

    saved = rpc.per_device_hbm_budget_bytes
    rpc.per_device_hbm_budget_bytes = lambda *a, **k: 4 << 20
    yield
    rpc.per_device_hbm_budget_bytes = saved


@pytest.fixture(scope="module")
def model(budget):
    """A 2-layer Llama (4 query heads, 2 KV heads, head_dim 64) with random weights, on
    EasyDeL's ragged paged attention v3. Weights drawn at 0.02 (Llama's initializer range)
    keep attention soft: larger random weights make it so sharp that bfloat16 rounding
    alone moves EasyDeL's own log-probs by tenths."""
    cfg = ed.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         sharding_axis_dims=(1, 1, 1, -1, 1),
                         attn_mechanism="ragged_page_attention_v3", attn_dtype=jnp.bfloat16, kvdtype=jnp.bfloat16)
    yield ed.LlamaForCausalLM(config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    tq_easydel.uninstall()


def variant(model, **updates):
    return nnx.merge(model.new_graphdef(recursive_update=True, **updates), model.graphstate, model.graphother)


# --------------------------------------------------------------------------- pure parts


def test_rpa_slots_place_each_token_where_its_sequence_puts_it():
    # page 4; seq 0 decodes its 6th token, seq 1 prefills 5 tokens, seq 2 adds 2 tokens at 7..8;
    # seq 3 is unused; rows 8..9 are padding
    kv_lens = np.array([6, 5, 9, 0], np.int32)
    pages = np.array([[3, 1, -1], [0, 5, -1], [2, 4, 6], [-1, -1, -1]], np.int32)
    cu = np.array([0, 1, 6, 8, 8], np.int32)
    want_slots, want_pos = [], []
    for s in range(3):
        q = cu[s + 1] - cu[s]
        for i in range(q):
            p = kv_lens[s] - q + i
            want_pos.append(p)
            want_slots.append(pages[s, p // 4] * 4 + p % 4)
    want_slots += [-1, -1]
    want_pos += [0, 0]
    slots, pos = tq_easydel.rpa_slots(jnp.asarray(kv_lens), jnp.asarray(pages), jnp.asarray(cu),
                                      jnp.asarray([3], jnp.int32), 10, 4)
    assert np.asarray(slots).tolist() == want_slots
    assert np.asarray(pos).tolist() == want_pos


def test_another_easydel_version_is_refused_by_name(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.2.9" if d == "easydel" else real(d))
    spec = importlib.util.spec_from_file_location("tq_easydel_other", tq_easydel.__file__)
    with pytest.raises(ImportError, match=r"easydel==0\.3\.0, found easydel 0\.2\.9.*pip install -e \"\.\[easydel\]\""):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_settings_are_json_and_refuse_bad_input():
    s = tq_easydel.settings("turbo-4", window=32, sinks=4, max_seqs=2)
    assert json.loads(json.dumps(s)) == s and s["options"]["key_bits"] == 5
    with pytest.raises(ValueError, match="names no preset"):
        tq_easydel.settings("turbo-9")
    with pytest.raises(ValueError, match="window"):
        tq_easydel.settings(None, window=-1)


def test_use_refuses_what_it_cannot_serve(model):
    with pytest.raises(ValueError, match="attn_mechanism is 'vanilla'"):
        tq_easydel.use(variant(model, attn_mechanism="vanilla"), "turbo-4")
    with pytest.raises(ValueError, match="exclude each other"):
        tq_easydel.use(variant(model, kv_cache_quantization_config=ed.TurboQuantConfig(bits=4)), "turbo-4")


def test_the_codes_cache_spends_the_bf16_budget_and_uninstall_restores(model):
    bf16 = variant(model).create_ragged_page_cache_config(max_length=256, page_size=PAGE)
    ours_model = tq_easydel.use(variant(model), "turbo-3.5", max_seqs=2)
    ours = ours_model.create_ragged_page_cache_config(max_length=256, page_size=PAGE)
    assert isinstance(ours, tq_easydel.CodesCacheConfig) and ours.version == "v3"
    shape, _ = bf16.get_shape_and_axes()
    budget = int(np.prod(shape)) * 2  # bfloat16 bytes of one layer's pages
    views = ours_model.init_operations_cache(batch_size=2, max_length=256, page_size=PAGE, ragged_config=ours)
    assert all(isinstance(v, tq_easydel.CodesCacheView) for v in views.views)
    used = tq_easydel.cache_nbytes(views) // len(views.views)
    per_page = PAGE * 2 * (32 + 2 + 24 + 2) + 8  # K4V3 rows at head_dim 64, float16 norms, 2 KV heads; 2 int32 page maps
    assert used <= budget < used + per_page
    assert ours.num_pages > 3 * bf16.num_pages  # the same bytes hold over 3x the tokens
    tq_easydel.uninstall()
    assert not tq_easydel.installed()
    assert type(ours_model.create_ragged_page_cache_config(max_length=256, page_size=PAGE)) is type(bf16)
    tq_easydel.install()


def test_model_generate_names_esurge(model):
    """EasyDeL's model.generate builds no ragged metadata (its own ragged cache fails on it
    too): the pool says so and names eSurge, rather than failing on a None."""
    from transformers import GenerationConfig

    ours = tq_easydel.use(variant(model), "turbo-4", max_seqs=2)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, (1, 12)), jnp.int32)
    with ours.mesh, pytest.raises(ValueError, match=r"model\.generate does not build it.*eSurge"):
        ours.generate(ids, generation_config=GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0,
                                                              eos_token_id=0))


# --------------------------------------------------------------------------- in the model


def _steps(model):
    """The model called as eSurge's runner calls it, on one flat batch of sequences."""
    graphdef, state, other = model.split_module()
    mech = model.config.get_text_config().attn_mechanism
    v2 = str(getattr(mech, "value", mech)).endswith("v2")

    @jax.jit
    def step(cache, ids, positions, kv_lens, cu, tables, slices):
        n = kv_lens.shape[0]
        md = RaggedPagesMetadata(
            pages_tables=tables, context_lens=kv_lens, query_start_loc=cu, num_seqs=jnp.asarray([n], jnp.int32),
            request_distribution=None if v2 else jnp.asarray([0, n, n], jnp.int32),
            slot_mapping=slices if v2 else None, num_kv_update_slices=jnp.asarray([n], jnp.int32) if v2 else None,
            page_size=PAGE, version="v2" if v2 else "v3")
        m = nnx.merge(graphdef, state, other)
        with m.mesh, set_inference_mode():
            out = m(input_ids=ids[None], position_ids=positions[None], past_key_values=cache, cache_metadata=md)
        return jax.nn.log_softmax(out.logits[0].astype(jnp.float32), -1), out.past_key_values

    return step


def _run(model, tokens):
    """Two sequences (pages 0-3 and 4-7): a prefill of 40 and of 23 tokens in one flat
    batch, then a decode token and a chunk of 9 in the next. Returns every log-prob."""
    cfg = model.create_ragged_page_cache_config(max_length=4 * PAGE, page_size=PAGE).replace(num_pages=8)
    cache = model.init_operations_cache(batch_size=2, max_length=4 * PAGE, page_size=PAGE, ragged_config=cfg)
    step = _steps(model)
    tables = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    out = []
    for (a0, a1), (b0, b1) in (((0, 40), (0, 23)), ((40, 41), (23, 32))):
        ids = np.concatenate([tokens[0, a0:a1], tokens[1, b0:b1]])
        pos = np.concatenate([np.arange(a0, a1), np.arange(b0, b1)]).astype(np.int32)
        cu = np.array([0, a1 - a0, a1 - a0 + b1 - b0], np.int32)
        slices = np.array([[a0, 4 * PAGE + b0], [0, a1 - a0], [a1 - a0, b1 - b0]], np.int32)  # v2: (slot, row, length)
        logp, cache = step(cache, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray([a1, b1], np.int32), jnp.asarray(cu),
                           tables, jnp.asarray(slices))
        out.append(np.asarray(logp))
    return np.concatenate(out), cache


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(1, VOCAB, (2, 41)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(model, tokens):
    """EasyDeL's own bfloat16 cache (ragged_page_attention_v2: v3's CPU path fails at head_dim 64)."""
    return _run(variant(model, attn_mechanism="ragged_page_attention_v2"), tokens)[0]


def _probs_distance(a, b):
    return float(np.abs(np.exp(a) - np.exp(b)).sum(-1).max())  # twice the largest total variation


def _flips(got, reference):
    """Positions whose greedy token differs, and the reference's top-2 margin there."""
    top2 = np.sort(reference, -1)[:, -2:]
    flip = got.argmax(-1) != reference.argmax(-1)
    return top2[flip, 1] - top2[flip, 0]


def test_exact_window_reproduces_easydel_bf16_cache(model, tokens, reference):
    """A window over every token: attention reads the bf16 K/V exactly, as EasyDeL's cache
    does; the two differ by bfloat16 rounding (EasyDeL's kernel computes in bfloat16)."""
    got, cache = _run(tq_easydel.use(variant(model), "turbo-4", window=64, sinks=4, max_seqs=2), tokens)
    assert all(isinstance(v, tq_easydel.CodesCacheView) for v in cache.views)
    assert np.abs(got - reference).max() < 0.03
    assert (_flips(got, reference) < 0.03).all()


def test_codes_only_stay_close_to_easydel_bf16_cache(model, tokens, reference):
    """No window, no sinks: every K/V read from 4-bit codes; farther than exact, still close."""
    exact, _ = _run(tq_easydel.use(variant(model), None, window=64, sinks=4, max_seqs=2), tokens)
    coded, cache = _run(tq_easydel.use(variant(model), None, window=0, sinks=0, max_seqs=2), tokens)
    assert cache.views[0].pool.config.window == 0 and cache.views[0].pool.config.sinks == 0
    d_exact, d_coded = _probs_distance(exact, reference), _probs_distance(coded, reference)
    assert 2 * d_exact < d_coded < 0.1
    assert (_flips(coded, reference) < 0.1).all()


# --------------------------------------------------------------------------- in eSurge


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """eSurge reads its tokenizer from a directory: a word-level one over WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>").save_pretrained(path)
    return str(path)


def _greedy(model, tokenizer_dir, prompts, n):
    engine = ed.eSurge(model=model, tokenizer=tokenizer_dir, max_model_len=128, max_num_seqs=2,
                       max_num_seq_buckets=[2], page_size=PAGE, min_input_pad=2, min_token_pad=8,
                       max_num_batched_tokens=16, compile_runner=True, enable_prefix_caching=False, silent_mode=True)
    try:
        views = engine.runner.executor_manager.kv_pages.views
        outs = engine.generate(prompts, ed.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs], views
    finally:
        engine.terminate()


def _prefill(model, ids):
    """Log-probs of one sequence prefilled in one step (the reference's next-token scores)."""
    pages = -(-len(ids) // PAGE)
    cfg = model.create_ragged_page_cache_config(max_length=pages * PAGE, page_size=PAGE).replace(num_pages=pages)
    cache = model.init_operations_cache(batch_size=1, max_length=pages * PAGE, page_size=PAGE, ragged_config=cfg)
    n = len(ids)
    logp, _ = _steps(model)(cache, jnp.asarray(ids, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                            jnp.asarray([n], jnp.int32), jnp.asarray([0, n], jnp.int32),
                            jnp.arange(pages, dtype=jnp.int32)[None], jnp.asarray([[0], [0], [n]], jnp.int32))
    return np.asarray(logp)


@pytest.mark.slow
def test_esurge_serves_on_the_pool(model, tokenizer_dir):
    """eSurge end to end (scheduler, chunked prefill, decode batches) with the pool as its
    cache, every token in the exact window: the greedy tokens of EasyDeL's bf16 engine, up
    to the first near-tie of the bf16 model's scores (a top-2 margin under 0.03: bfloat16
    rounding of either engine can flip it)."""
    rng = np.random.default_rng(1)
    prompts = [rng.choice(WORDS, 30), rng.choice(WORDS, 19)]
    texts = [" ".join(p) for p in prompts]
    bf16 = variant(model, attn_mechanism="ragged_page_attention_v2")
    want, views = _greedy(bf16, tokenizer_dir, texts, 12)
    assert type(views[0]).__name__ == "RaggedPagesCacheView"
    got, views = _greedy(tq_easydel.use(variant(model), "turbo-4", window=64, max_seqs=2), tokenizer_dir, texts, 12)
    assert all(isinstance(v, tq_easydel.CodesCacheView) for v in views)
    for prompt, w, g in zip(prompts, want, got):
        assert len(g) == len(w) == 12
        ids = [WORDS.index(t) + 1 for t in prompt] + w[:-1]
        ref = _prefill(bf16, ids)[len(prompt) - 1:]  # the bf16 model's scores of each generated token
        assert (ref.argmax(-1) == np.asarray(w)).all()  # the bf16 engine is greedy on its own model
        first = next((i for i in range(12) if g[i] != w[i]), 12)
        if first < 12:
            top2 = np.sort(ref[first])[-2:]
            assert top2[1] - top2[0] < 0.03, (first, g, w)
