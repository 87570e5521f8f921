"""tq_jax.adapters.easydel against EasyDeL itself: a tiny Llama built by EasyDeL, attended
over tq_jax's pool (eSurge's steps) and tq_jax.kvcache (model.generate's), checked against
the same model on EasyDeL's own bfloat16 cache.

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
import tq_jax  # noqa: E402
from easydel.caching import RaggedPagesMetadata  # noqa: E402
from easydel.utils import set_inference_mode  # noqa: E402
from flax import nnx  # noqa: E402
from tq_jax import kvcache  # noqa: E402

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
    yield _llama(jnp.bfloat16)
    tq_easydel.uninstall()


def _llama(dtype):
    """:func:`model`'s Llama with activations and attention in ``dtype`` (the same
    bfloat16 weights and K/V whatever ``dtype``)."""
    cfg = ed.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         sharding_axis_dims=(1, 1, 1, -1, 1),
                         attn_mechanism="ragged_page_attention_v3", attn_dtype=dtype, kvdtype=jnp.bfloat16)
    return ed.LlamaForCausalLM(config=cfg, dtype=dtype, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


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


def test_settings_take_a_window_longer_than_any_default_pool():
    """A window of a long context (every token of a 4k sequence exact, say) is a valid
    setting: it was refused by the size of the probe pool that validates settings."""
    s = tq_easydel.settings("turbo-4", window=4096, sinks=0, max_seqs=1)
    assert (s["window"], s["sinks"]) == (4096, 0)
    assert tq_easydel.settings(None, window=2000, sinks=8)["window"] == 2000


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


@pytest.fixture(scope="module")
def model_f32(model):
    """The same Llama (the same bfloat16 weights) with activations and attention in
    float32; both caches still hold bfloat16 K/V. EasyDeL's bf16 cache attends in
    bfloat16 whatever the model's dtype (ejkernel's ``compute_dtype`` default: EasyDeL
    0.3.0 does not pass one), so while this fixture lives it attends in the query's."""
    from easydel.operations.kernels.ragged_page_attention import _RaggedPageAttn

    twin = _llama(jnp.float32)
    for a, b in zip(jax.tree.leaves(nnx.state(twin, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        assert a.dtype == jnp.bfloat16 and (np.asarray(a) == np.asarray(b)).all()
    forward_v2 = _RaggedPageAttn.forward_v2

    def forward(self, query, *args, compute_dtype=None, **kwargs):
        return forward_v2(self, query, *args, compute_dtype=query.dtype, **kwargs)

    _RaggedPageAttn.forward_v2 = forward
    yield twin
    _RaggedPageAttn.forward_v2 = forward_v2


def test_exact_window_in_float32_arithmetic_is_easydel_bf16_cache(model_f32, tokens):
    """With float32 arithmetic on both sides, the exact window over the same bfloat16 K/V
    is EasyDeL's bfloat16 cache up to float32 rounding: no near-tie allowance needed. (In
    bfloat16 arithmetic the two differ by up to 0.03: the test above.)"""
    want, _ = _run(variant(model_f32, attn_mechanism="ragged_page_attention_v2"), tokens)
    got, cache = _run(tq_easydel.use(variant(model_f32), "turbo-4", window=64, sinks=4, max_seqs=2), tokens)
    assert jnp.dtype(cache.views[0].pool.config.dtype) == jnp.bfloat16
    assert np.abs(got - want).max() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_codes_only_stay_close_to_easydel_bf16_cache(model, tokens, reference):
    """No window, no sinks: every K/V read from 4-bit codes; farther than exact, still close."""
    exact, _ = _run(tq_easydel.use(variant(model), None, window=64, sinks=4, max_seqs=2), tokens)
    coded, cache = _run(tq_easydel.use(variant(model), None, window=0, sinks=0, max_seqs=2), tokens)
    assert cache.views[0].pool.config.window == 0 and cache.views[0].pool.config.sinks == 0
    d_exact, d_coded = _probs_distance(exact, reference), _probs_distance(coded, reference)
    assert 2 * d_exact < d_coded < 0.1
    assert (_flips(coded, reference) < 0.1).all()


# --------------------------------------------------------------------------- in model.generate


PADS = 3  # row 1 of the generate prompt is left-padded by this many tokens


@pytest.fixture(scope="module")
def prompt():
    """Two prompts of 12 columns for model.generate: row 1 left-padded (pad id 0, masked),
    and a 5-token continuation fed back as teacher forcing."""
    rng = np.random.default_rng(2)
    ids = rng.integers(1, VOCAB, (2, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    ids[1, :PADS], mask[1, :PADS] = 0, 0
    return ids, mask, rng.integers(1, VOCAB, (2, 5)).astype(np.int32)


def _forced(model, ids, mask, follow):
    """model.generate's own steps (prepare_inputs_for_generation, then each step's call and
    update_inputs_for_generation), fed ``follow`` instead of its argmax: every step's
    next-token log-probs ``[batch, steps, vocab]`` and the cache at the end."""
    out = []
    with model.mesh:
        kw = model.prepare_inputs_for_generation(jnp.asarray(ids), max_length=ids.shape[1] + follow.shape[1],
                                                 pad_token_id=0, attention_mask=jnp.asarray(mask))
        tok = jnp.asarray(ids)
        for i in range(follow.shape[1] + 1):
            o = model._call_generation_model_step(model, tok, kw)
            out.append(np.asarray(jax.nn.log_softmax(o.logits[:, -1].astype(jnp.float32), -1)))
            if i < follow.shape[1]:
                kw = model.update_inputs_for_generation(o, kw)
                tok = jnp.asarray(follow[:, i:i + 1])
    return np.stack(out, 1), kw["past_key_values"]


@pytest.fixture(scope="module")
def generate_reference(model, prompt):
    """EasyDeL's own generate path on its bfloat16 cache (attn_mechanism='vanilla': its
    ragged mechanisms need eSurge's metadata)."""
    return _forced(variant(model, attn_mechanism="vanilla"), *prompt)[0]


@pytest.fixture(scope="module")
def exact_runs(model, prompt):
    """Each preset's generate log-probs with a window over every token, computed once."""
    runs = {}

    def run(options):
        key = repr(options)
        if key not in runs:
            runs[key] = _forced(tq_easydel.use(variant(model), options, window=64, sinks=4), *prompt)
        return runs[key]

    return run


def _generate_kwargs():
    from transformers import GenerationConfig

    return dict(generation_config=GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=0))


@pytest.mark.parametrize("options", [None, "turbo-4", "turbo-3.5", "turbo-2.5",
                                     tq_jax.Options(key_bits=3, value_bits=4)],
                         ids=["4/4", "turbo-4", "turbo-3.5", "turbo-2.5", "Options-K3V4"])
def test_generate_exact_window_reproduces_easydel_bf16(exact_runs, generate_reference, prompt, options):
    """Every preset, a window over every token (and a left-padded row): attention reads the
    bf16 K/V exactly, so the log-probs are EasyDeL's up to bfloat16 rounding."""
    got, cache = exact_runs(options)
    assert all(isinstance(v, tq_easydel.SequenceCacheView) for v in cache.views)
    n = prompt[0].shape[1] + prompt[2].shape[1]
    assert np.asarray(cache.views[0].cache.lengths).tolist() == [n, n - PADS]  # the padding was dropped
    assert np.abs(got - generate_reference).max() < 0.03
    assert (_flips(got.reshape(-1, VOCAB), generate_reference.reshape(-1, VOCAB)) < 0.03).all()


def test_generate_gives_easydel_bf16_tokens(model, prompt, generate_reference):
    """model.generate itself (its traced while_loop), left padding included: the greedy
    tokens of EasyDeL's bf16 generate, up to the first near-tie of its scores."""
    ids, mask, _ = prompt
    bf16 = variant(model, attn_mechanism="vanilla")
    with bf16.mesh:
        want = np.asarray(bf16.generate(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                                        **_generate_kwargs()).sequences)
    ours = tq_easydel.use(variant(model), "turbo-4", window=64)
    with ours.mesh:
        got = np.asarray(ours.generate(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                                       **_generate_kwargs()).sequences)
    assert got.shape == want.shape == (2, 18) and (got[:, :12] == ids).all()
    for row in range(2):
        first = next((i for i in range(12, 18) if got[row, i] != want[row, i]), 18)
        if first < 18:  # a near-tie of the bf16 model's own scores there
            ref, _ = _forced(bf16, ids[row:row + 1], mask[row:row + 1], want[row:row + 1, 12:first])
            top2 = np.sort(ref[0, -1])[-2:]
            assert top2[1] - top2[0] < 0.03, (row, first, got[row], want[row])


def test_sequence_cache_survives_the_row_gather_of_beam_search():
    """EasyDeL's beam search gathers every non-scalar cache leaf along the batch axis
    between steps: the gathered view must attend as a cache written in that row order."""
    rng = np.random.default_rng(3)
    k, v = jnp.asarray(rng.standard_normal((2, 3, 6, 2, 64)), jnp.bfloat16)
    k2, v2 = jnp.asarray(rng.standard_normal((2, 3, 1, 2, 64)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.bfloat16)  # [batch * q_len, q_heads, head_dim]
    perm = np.array([2, 0, 0])

    def fresh():
        return tq_easydel.SequenceCacheView.create(kvcache.init(3, 16, 2, 64, window=0, sinks=0), [0, 0, 0], 0)

    gathered = jax.tree_util.tree_map(lambda x: x if x.ndim == 0 else x[perm], fresh().concatenate_to_cache(k, v))
    got = tq_easydel._attend_sequences(query=q, cache_view=gathered.concatenate_to_cache(k2, v2))
    want_view = fresh().concatenate_to_cache(k[perm], v[perm]).concatenate_to_cache(k2, v2)
    want = tq_easydel._attend_sequences(query=q, cache_view=want_view)
    np.testing.assert_array_equal(np.asarray(got.attention_outputs, np.float32),
                                  np.asarray(want.attention_outputs, np.float32))


def test_generate_beam_search_gives_easydel_bf16_beams(model, prompt):
    """Beam search end to end with the exact window: the beams of EasyDeL's bf16 beam
    search. (Whether the beams reorder here depends on the random model; the reorder itself
    is the test above. Without attention_mask: EasyDeL 0.3.0's beam search fails on one;
    the padded row is masked by its pad ids.)"""
    from transformers import GenerationConfig

    ids = prompt[0]
    config = GenerationConfig(max_new_tokens=5, do_sample=False, num_beams=3, length_penalty=1.0,
                              early_stopping=False, pad_token_id=0, eos_token_id=0)
    runs = []
    for m in (variant(model, attn_mechanism="vanilla"), tq_easydel.use(variant(model), "turbo-4", window=64)):
        m.generation_config = config  # EasyDeL 0.3.0's beam search reads the model's own
        with m.mesh:
            runs.append(np.asarray(m.generate(jnp.asarray(ids), generation_config=config).sequences))
    assert runs[0].shape == (2, 17) and (runs[0] == runs[1]).all(), runs


@pytest.mark.parametrize("options,key_bytes,value_bytes", [(None, 32, 32), ("turbo-4", 40, 24)], ids=["4/4", "turbo-4"])
def test_generate_codes_only_stay_close_to_easydel_bf16(model, prompt, generate_reference, exact_runs, options,
                                                        key_bytes, value_bytes):
    """No window, no sinks: every K/V read from its codes, held in tq_jax's cache (uint8
    code rows of head_dim * bits / 8 bytes); farther from EasyDeL's than exact, still close."""
    coded, cache = _forced(tq_easydel.use(variant(model), options, window=0, sinks=0), *prompt)
    for view in cache.views:
        kv = view.cache
        assert isinstance(kv, kvcache.KVCache) and kv.config.window == 0 and kv.config.sinks == 0
        assert kv.k_codes.dtype == kv.v_codes.dtype == jnp.uint8
        assert kv.k_codes.shape[::2] == (2, 2) and kv.k_codes.shape[-1] == key_bytes
        assert kv.v_codes.shape[-1] == value_bytes and kv.k_window.shape[1] == 0
    d_exact = _probs_distance(exact_runs(options)[0].reshape(-1, VOCAB), generate_reference.reshape(-1, VOCAB))
    d_coded = _probs_distance(coded.reshape(-1, VOCAB), generate_reference.reshape(-1, VOCAB))
    assert 2 * d_exact < d_coded < 0.1
    assert (_flips(coded.reshape(-1, VOCAB), generate_reference.reshape(-1, VOCAB)) < 0.1).all()


def test_generate_without_settings_and_after_uninstall_is_easydels(model, prompt):
    """use(model, False) leaves EasyDeL's generate path (its own caches, its tokens), and
    uninstall() puts back every original attribute."""
    ids, mask, _ = prompt
    tq_easydel.install()
    plain = tq_easydel.use(tq_easydel.use(variant(model), "turbo-4"), False)
    assert not hasattr(plain.config.get_text_config(), tq_easydel.CONFIG_KEY)
    with plain.mesh:
        views = plain.prepare_inputs_for_generation(jnp.asarray(ids), max_length=18, pad_token_id=0,
                                                    attention_mask=jnp.asarray(mask))["past_key_values"].views
    assert {type(v).__name__ for v in views} == {"RaggedPagesCacheView"}  # EasyDeL's, for the ragged mechanism
    bf16 = variant(model, attn_mechanism="vanilla")
    with bf16.mesh:
        patched = np.asarray(bf16.generate(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                                           **_generate_kwargs()).sequences)
    originals = dict(tq_easydel._PATCHES)
    assert len(originals) == 5
    tq_easydel.uninstall()
    try:
        assert not tq_easydel.installed()
        for (owner, name), original in originals.items():
            assert owner.__dict__[name] is original, name
        with bf16.mesh:
            unpatched = np.asarray(bf16.generate(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                                                 **_generate_kwargs()).sequences)
        assert (patched == unpatched).all()
    finally:
        tq_easydel.install()


def test_generate_refuses_what_it_cannot_serve(model):
    ours = tq_easydel.use(variant(model), "turbo-4")
    ids = np.arange(1, 9, dtype=np.int32)[None].repeat(2, 0)

    def prepare(ids, mask=None):
        with ours.mesh:
            ours.prepare_inputs_for_generation(jnp.asarray(ids), max_length=12, pad_token_id=0,
                                               attention_mask=None if mask is None else jnp.asarray(mask))

    hole = np.ones_like(ids)
    hole[1, 4] = 0
    with pytest.raises(ValueError, match=r"left-padded prompts only, but row 1's mask is 11110111"):
        prepare(ids, hole)
    right = np.ones_like(ids)
    right[0, -2:] = 0
    with pytest.raises(ValueError, match=r"row 0's mask is 11111100.*padding_side='left'"):
        prepare(ids, right)
    empty = np.ones_like(ids)
    empty[1] = 0
    with pytest.raises(ValueError, match=r"row 1's mask is 00000000"):
        prepare(ids, empty)
    inner = ids.copy()
    inner[0, 3] = 0  # a pad id inside a prompt, no attention_mask: EasyDeL would mask it
    with pytest.raises(ValueError, match=r"row 0's mask is 11101111.*Without attention_mask EasyDeL masks every"):
        prepare(inner)
    prepare(inner, np.ones_like(ids))  # with a mask, the ids themselves are not checked
    with pytest.raises(ValueError, match="call model.generate outside jax.jit"):
        jax.jit(lambda x: prepare(x))(ids)
    view = tq_easydel.SequenceCacheView.create(kvcache.init(1, 32, 2, 64, window=0, sinks=0), [0], 0)
    q = jnp.zeros((4, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="sliding window of 8 tokens, shorter than model.generate's 32"):
        tq_easydel._attend_sequences(query=q, cache_view=view, sliding_window=8)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        tq_easydel._attend_sequences(query=q, cache_view=view, logits_soft_cap=30.0)
    out = tq_easydel._attend_sequences(query=q, cache_view=view, sliding_window=(40, 0))  # wider than the cache: none
    assert out.attention_outputs.shape == q.shape


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
        ids = [f"prompt-{i}" for i in range(len(prompts))]  # outputs come in the order requests finish
        outs = engine.generate(prompts, ed.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                               request_id=ids)
        by_id = {o.request_id: list(o.outputs[0].token_ids) for o in outs}
        return [by_id[i] for i in ids], views
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
@pytest.mark.parametrize("arithmetic", ["bfloat16", "float32"])
def test_esurge_serves_on_the_pool(model, model_f32, tokenizer_dir, arithmetic):
    """eSurge end to end (scheduler, chunked prefill, decode batches) with the pool as its
    cache, every token in the exact window: the greedy tokens of EasyDeL's bf16 engine. In
    bfloat16 arithmetic up to the first near-tie of the bf16 model's scores (a top-2 margin
    under 0.03: bfloat16 rounding of either engine can flip it); in float32 arithmetic
    (the same bfloat16 K/V in both caches) every token."""
    model = model_f32 if arithmetic == "float32" else model
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
        if arithmetic == "float32":
            assert first == 12, (g, w)
        elif first < 12:
            top2 = np.sort(ref[first])[-2:]
            assert top2[1] - top2[0] < 0.03, (first, g, w)
