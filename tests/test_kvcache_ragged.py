"""tq_jax._src.kvcache.ragged: ragged paged attention over packed codes, driven as a serving
engine drives it (its own page tables, slots and flat query batches).

References, independent of the pool: ``tq_jax._src.kvcache.reference.ragged_attend``, dense
float64 attention over K/V whose positions in each sequence's window (the last
``window``) and sinks (the first ``sinks``) are the tokens as given and the rest
``tq_jax.loads(tq_jax.dumps(...))`` of them, read through the engine's page table; jax's own
reference of the RPA argument form (``ref_ragged_paged_attention``); and
``tq_jax.kvcache.attend`` over a per-sequence cache holding the same tokens.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
from kvcache_helpers import D, H, decoded_kv
from tq_jax import kvcache
from tq_jax._src.kvcache import ragged, reference


class Engine:
    """A toy serving engine: hands out pages from a shuffled free list, keeps each
    sequence's page table and tokens, writes new K/V through ``ragged.write`` and builds
    the RPA arguments. ``step`` takes ``{seq: new_tokens}`` in batch-row order (rows can
    change from step to step, as an engine's batch does); the queries are the new tokens."""

    def __init__(self, pool, max_seqs, pages_per_seq, rng, scale=1.0, positions=True):
        self.pool, self.rng, self.scale, self.positions = pool, rng, scale, positions
        cfg = pool.config
        self.ps, self.pps, self.max_seqs = cfg.page_size, pages_per_seq, max_seqs
        self.free = [int(p) for p in rng.permutation(cfg.num_pages)]
        self.pages = {}  # seq -> list of pages
        self.k, self.v = {}, {}

    def free_seq(self, seq):
        self.free = self.pages.pop(seq) + self.free  # reused first
        del self.k[seq], self.v[seq]

    def step(self, new, q_heads, bucket=32, dtype=np.float32):
        """Write ``new`` and return the queries and RPA arguments; the flat batch is padded
        to ``bucket`` tokens (slot -1), as engines pad to a few compiled sizes."""
        ks, vs, slots, pos = [], [], [], []
        for seq, n in new.items():
            have = len(self.k.get(seq, ()))
            self.pages.setdefault(seq, [])
            while len(self.pages[seq]) * self.ps < have + n:
                self.pages[seq].append(self.free.pop(0))
            k = (self.rng.standard_normal((n, H, D)) * self.scale).astype(dtype)
            v = self.rng.standard_normal((n, H, D)).astype(dtype)
            self.k[seq] = np.concatenate([self.k.get(seq, np.zeros((0, H, D), dtype)), k])
            self.v[seq] = np.concatenate([self.v.get(seq, np.zeros((0, H, D), dtype)), v])
            p = np.arange(have, have + n)
            slots.append(np.asarray(self.pages[seq])[p // self.ps] * self.ps + p % self.ps)
            pos.append(p)
            ks.append(k)
            vs.append(v)
        pad_tokens = bucket - sum(new.values())
        ks.append(np.full((pad_tokens, H, D), 7.0, dtype))
        vs.append(np.full((pad_tokens, H, D), 7.0, dtype))
        slots.append(np.full(pad_tokens, -1))
        pos.append(np.zeros(pad_tokens, int))
        slot = np.concatenate(slots).astype(np.int32)
        kw = dict(positions=np.concatenate(pos).astype(np.int32)) if self.positions else {}
        self.pool = ragged.write(self.pool, np.concatenate(ks), np.concatenate(vs), slot, **kw)
        n_tok = slot.shape[0]
        q = self.rng.standard_normal((n_tok, q_heads, D)).astype(dtype)
        kv_lens = np.zeros(self.max_seqs, np.int32)
        table = np.zeros((self.max_seqs, self.pps), np.int32)
        cu = np.zeros(self.max_seqs + 1, np.int32)
        for row, (seq, n) in enumerate(new.items()):
            kv_lens[row] = len(self.k[seq])
            table[row, : len(self.pages[seq])] = self.pages[seq]
            cu[row + 1] = cu[row] + n
        cu[len(new) + 1 :] = cu[len(new)]
        return q, (kv_lens, table, cu, np.array([len(new)], np.int32))


def pages(eng):
    """The engine's pages as float64 ``[2, num_pages, page_size, H, D]`` arrays: each live
    sequence's K/V as written, and as their codes decode (``tq_jax.loads`` of ``dumps``)."""
    cfg = eng.pool.config
    written = np.zeros((2, cfg.num_pages, cfg.page_size, H, D))
    decoded = np.zeros_like(written)
    for seq, ks in eng.k.items():
        if not len(ks):
            continue  # nothing written yet
        p = np.arange(len(ks))
        page, offset = np.asarray(eng.pages[seq])[p // eng.ps], p % eng.ps
        written[:, page, offset] = np.stack([ks, eng.v[seq]])
        decoded[:, page, offset] = decoded_kv(ks, eng.v[seq], cfg)
    return written, decoded


def expected(eng, q, args, window, sinks, sliding_window=None, sm_scale=None):
    """``tq_jax._src.kvcache.reference.ragged_attend`` over the engine's pages for the RPA arguments ``args``."""
    return reference.ragged_attend(q, *pages(eng), *args, window=window, sinks=sinks, sm_scale=sm_scale,
                                   sliding_window=sliding_window)


@contextlib.contextmanager
def tpu_semantics(impl):
    """``impl="pallas_tpu"`` on this CPU runs the TPU kernel in jax's TPU interpreter
    (``pltpu.InterpretParams()``: TPU memory spaces, DMA and semaphore semantics) instead
    of the generic Pallas interpreter that ``ragged.forms`` gives a CPU program; the
    program is then for the CPU alone (the TPU interpreter's effects do not stage out
    beside the compiled kernel). Other impls: unchanged."""
    if impl != "pallas_tpu":
        yield
        return
    from jax.experimental.pallas import tpu as pltpu

    forms = ragged.forms
    ragged.forms = lambda config, impl: (("cpu", ("pallas_tpu", pltpu.InterpretParams())),)
    try:
        yield
    finally:
        ragged.forms = forms


def run_steps(steps, *, impl="xla", window=8, sinks=2, page_size=8, group=2, num_pages=48, max_seqs=4,
              pps=6, options=None, rng_seed=0, sliding_window=None, sm_scale=None, bucket=32, **pool_kw):
    rng = np.random.default_rng(rng_seed)
    pool = ragged.init_pool(num_pages, page_size, H, D, options, jnp.float32, window=window, sinks=sinks,
                            max_seqs=max_seqs, **pool_kw)
    eng = Engine(pool, max_seqs, pps, rng)
    for new in steps:
        q, args = eng.step(new, H * group, bucket)
        with tpu_semantics(impl):
            out = np.asarray(ragged.attend(eng.pool, q, *args, impl=impl, sliding_window=sliding_window,
                                           sm_scale=sm_scale))
        want = expected(eng, q, args, window, sinks, sliding_window, sm_scale)
        scale = max(np.abs(want).max(), 1.0)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5 * scale)
        assert not out[args[2][len(new)] :].any()  # padding rows: zeros
    return eng


# A mixed schedule: prefill chunks crossing pages, decode steps, a sequence with no new
# token (q_len 0), an empty sequence (kv_len 0, q_len 0), rows reordered between steps.
MIXED = [
    {0: 11, 1: 1, 2: 0},  # 2: empty (kv_len 0, q_len 0)
    {1: 9, 0: 1, 3: 17},  # 3: a prefill over three pages; rows reordered
    {3: 1, 2: 5, 0: 1, 1: 0},  # 1: q_len 0 with kv_len 10
    {0: 1, 1: 1, 2: 1, 3: 1},  # decode only
]


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas_tpu", marks=pytest.mark.slow),
                                  pytest.param("pallas_gpu", marks=pytest.mark.slow)])
def test_mixed_batches_match_dense_attention_over_decoded_kv_with_exact_window_and_sinks(impl):
    run_steps(MIXED, impl=impl)


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu"])
def test_codes_only_pool_matches_dense_attention_over_decoded_kv(impl):
    run_steps(MIXED[:2], impl=impl, window=0, sinks=0, group=1)


def test_trellis_codes_only_pool_matches_dense_attention_over_decoded_kv():
    # without norm correction the pool's float16 norms are dumps' (with it they differ by a float16 rounding)
    run_steps(MIXED, window=0, sinks=0, options=tq_jax.encode_options("turbo-4t", norm_correction=False))


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_a_trellis_pool_refuses_the_pallas_kernels_with_what_to_do(impl):
    pool = ragged.init_pool(8, 8, H, D, "turbo-4t", jnp.float32, window=0, sinks=0, max_seqs=1)
    args = (np.array([1], np.int32), np.zeros((1, 1), np.int32), np.array([0, 1], np.int32), np.array([1], np.int32))
    with pytest.raises(ValueError, match="only the XLA loop reads"):
        ragged.attend(pool, np.zeros((1, H, D), np.float32), *args, impl=impl)


@pytest.mark.slow
def test_many_sequences_small_pages_gqa4():
    steps = [{s: 3 + 2 * s for s in range(12)}, {s: 1 for s in range(12)}]
    run_steps(steps, page_size=4, group=4, num_pages=96, max_seqs=12, pps=10, window=6, sinks=3, bucket=176)


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas_tpu", marks=pytest.mark.slow),
                                  pytest.param("pallas_gpu", marks=pytest.mark.slow)])
def test_sliding_window_and_sm_scale(impl):
    run_steps(MIXED[:3], impl=impl, sliding_window=5, sm_scale=0.3)


@pytest.mark.slow  # jax's reference runs op by op (the same semantics: test_sliding_window_... quick)
def test_agrees_with_jax_reference_of_the_rpa_argument_form():
    """jax's ``ref_ragged_paged_attention`` over dense pages of the decoded K/V: the same
    reading of kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale and sliding_window."""
    ref_mod = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel")
    rng = np.random.default_rng(5)
    pool = ragged.init_pool(24, 8, H, D, dtype=jnp.float32, window=0, sinks=0)
    eng = Engine(pool, 3, 4, rng)
    eng.step({0: 13, 1: 6}, 2 * H, bucket=24)
    new = {1: 3, 2: 9, 0: 1}
    q, (kv_lens, table, cu, ns) = eng.step(new, 2 * H, bucket=24)
    _, decoded = pages(eng)
    dense = np.zeros((24, 8, 2 * H, D), np.float32)  # [pages, page_size, K/V interleaved by head, D]
    dense[:, :, 0::2], dense[:, :, 1::2] = decoded
    for sw, scale in ((4, 0.2),):
        want = ref_mod.ref_ragged_paged_attention(jnp.asarray(q), jnp.asarray(dense), kv_lens, table, cu, ns,
                                                  sm_scale=scale, sliding_window=sw)
        got = ragged.attend(eng.pool, q, kv_lens, table, cu, ns, sm_scale=scale, sliding_window=sw)
        n = int(cu[3])
        np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- same state as kvcache


@pytest.mark.parametrize("options", [None, "turbo-4t", pytest.param("turbo-3.5", marks=pytest.mark.slow)])
def test_same_tokens_as_a_kvcache_give_the_same_codes_and_the_same_attention(options):
    """A prefill then decode steps through both forms, with the default window and sinks:
    the pool's code rows and norms equal the cache's byte for byte, and attention agrees."""
    rng = np.random.default_rng(7)
    pool = ragged.init_pool(64, 16, H, D, options, max_seqs=3)  # bfloat16, window 128 (or 256), 4 sinks
    cache = kvcache.init(3, 48, H, D, options=options, page_size=16)
    eng = Engine(pool, 3, 3, rng)
    q, args = eng.step({0: 40, 1: 40, 2: 0}, 3 * H, bucket=80)  # seq 2: empty
    k = np.stack([eng.k[0], eng.k[1], np.zeros((40, H, D), np.float32)])
    v = np.stack([eng.v[0], eng.v[1], np.zeros((40, H, D), np.float32)])
    cache = kvcache.append(cache, k, v, new_lengths=np.array([40, 40, 0]))
    out = np.asarray(ragged.attend(eng.pool, q, *args))
    want = np.asarray(kvcache.attend(cache, jnp.asarray(q.reshape(2, 40, 3 * H, D)[[0, 1, 1]])))
    np.testing.assert_allclose(out[:80].reshape(2, 40, 3 * H, D), want[:2], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for _ in range(2):  # decode steps, rows reordered
        q, args = eng.step({2: 1, 0: 1, 1: 1}, 3 * H, bucket=80)
        cache = kvcache.append(cache, np.stack([eng.k[s][-1:] for s in range(3)]),
                               np.stack([eng.v[s][-1:] for s in range(3)]))
        out = np.asarray(ragged.attend(eng.pool, q, *args))
        want = np.asarray(kvcache.attend(cache, jnp.asarray(q[[1, 2, 0]][:, None])))[:, 0]
        np.testing.assert_allclose(out[:3], want[[2, 0, 1]], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for seq in range(3):
        t = len(eng.k[seq])
        p = np.arange(t)
        slots = np.asarray(eng.pages[seq])[p // 16] * 16 + p % 16
        cpages = np.asarray(cache.page_table[seq])[p // 16]
        for name in ("k_codes", "k_norms", "v_codes", "v_norms"):
            leaf = np.asarray(getattr(eng.pool, name))
            a = leaf.reshape(64 * 16, *leaf.shape[2:])[slots]
            np.testing.assert_array_equal(a, np.asarray(getattr(cache, name))[cpages, p % 16], err_msg=name)


# --------------------------------------------------------------------------- jit


def test_jit_donated_write_and_attend_compile_once_across_steps(compiles):
    traces = {"write": 0, "attend": 0}

    def step(pool, k, v, slots, pos):
        traces["write"] += 1
        return ragged.write(pool, k, v, slots, positions=pos)

    def read(pool, q, *args):
        traces["attend"] += 1
        return ragged.attend(pool, q, *args)

    write_jit = jax.jit(step, donate_argnums=0)
    attend_jit = jax.jit(read)
    rng = np.random.default_rng(3)
    pool = ragged.init_pool(16, 8, H, D, dtype=jnp.float32, window=8, sinks=2, max_seqs=2)
    pages = np.array([[3, 9, 4, 0], [12, 1, 0, 0]], np.int32)
    k = rng.standard_normal((20, 2, H, D)).astype(np.float32)
    q = rng.standard_normal((2, H, D)).astype(np.float32)
    cu, ns = np.array([0, 1, 2], np.int32), np.array([2], np.int32)
    before = None
    for t in range(20):  # decode: one token per sequence, crossing pages and the window's edge
        pos = np.array([t, t], np.int32)
        slots = pages[[0, 1], pos // 8] * 8 + pos % 8
        pool = write_jit(pool, k[t], k[t] * 0.5, slots.astype(np.int32), pos)
        out = attend_jit(pool, q, pos + 1, pages, cu, ns)
        if t == 1:
            before = compiles.count
    assert traces == {"write": 1, "attend": 1}
    assert compiles.count == before
    assert np.isfinite(np.asarray(out)).all()


# --------------------------------------------------------------------------- the exact pools


def test_undersized_window_pool_reads_codes_where_its_copies_were_taken_back():
    """One window page for two sequences: each write lends it to the page just written,
    so only the sequence that wrote last reads its latest page exactly; the rest of its
    window, and the other sequence, read codes: still attention over the right values."""
    rng = np.random.default_rng(11)
    pool = ragged.init_pool(16, 4, H, D, None, jnp.float32, window=8, sinks=0, exact_pages=1)
    eng = Engine(pool, 2, 4, rng)
    eng.step({0: 6, 1: 3}, H, bucket=16)  # seq 1 wrote last: its page (positions 0..2) holds the window page
    q, (kv_lens, table, cu, ns) = eng.step({0: 1}, H, bucket=16)  # seq 0 writes position 6 (its page 1): lent to it
    out = np.asarray(ragged.attend(eng.pool, q, kv_lens, table, cu, ns))
    ks, vs = eng.k[0], eng.v[0]
    dec = decoded_kv(ks, vs, pool.config)
    exact = np.arange(7) >= 6  # the page was lent at position 6: earlier offsets are not current
    k = np.where(exact[:, None, None], ks, dec[0])
    v = np.where(exact[:, None, None], vs, dec[1])
    np.testing.assert_allclose(out[:1], reference.dense_attention(q[:1], k, v), rtol=2e-5, atol=2e-5)


def test_reused_pages_never_read_stale_exact_copies():
    """A finished sequence's pages go to a new one: its sink rows and window copies are
    overwritten or invalidated, never read as the new sequence's tokens."""
    rng = np.random.default_rng(12)
    pool = ragged.init_pool(8, 4, H, D, None, jnp.float32, window=6, sinks=3, max_seqs=2)
    eng = Engine(pool, 2, 4, rng)
    eng.step({0: 10}, H, bucket=16)
    eng.free_seq(0)
    # the new sequence's first page was the old one's first page (sink rows overwritten by sinks)
    q, args = eng.step({1: 2}, H, bucket=16)
    np.testing.assert_allclose(np.asarray(ragged.attend(eng.pool, q, *args)), expected(eng, q, args, 6, 3),
                               rtol=2e-5, atol=2e-5)
    # without positions: no sink is kept, and the reused rows are invalidated
    eng.positions = False
    eng.free_seq(1)
    q, args = eng.step({2: 5}, H, bucket=16)
    out = np.asarray(ragged.attend(eng.pool, q, *args))
    np.testing.assert_allclose(out, expected(eng, q, args, 6, 0), rtol=2e-5, atol=2e-5)
    assert not np.asarray(eng.pool.sink_valid).any()


def test_long_prefill_with_positions_borrows_only_its_window_pages():
    pool = ragged.init_pool(64, 4, H, D, None, jnp.float32, window=8, sinks=0, max_seqs=2)
    eng = Engine(pool, 1, 16, np.random.default_rng(13))
    eng.step({0: 38}, H, bucket=40)  # 10 pages; the last 8 positions (30..37) span 3 of them
    assert sorted(np.asarray(eng.pool.exact_owner)[:3]) == sorted(eng.pages[0][7:])
    eng.positions = False
    eng.step({1: 40}, H, bucket=40)  # without positions every page written borrows one (the ring keeps the last)
    assert int((np.asarray(eng.pool.exact_owner) >= 0).sum()) == pool.config.exact_pages


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def small():
    return ragged.init_pool(8, 4, H, D, dtype=jnp.float32, window=4, sinks=2, max_seqs=1)


def test_init_pool_rejects_bad_sizes():
    with pytest.raises(ValueError, match="page_size.*power of two"):
        ragged.init_pool(8, 12, H, D)
    with pytest.raises(ValueError, match="sinks.*0..max_len=4"):
        ragged.init_pool(8, 4, H, D, sinks=5)
    with pytest.raises(ValueError, match="names no preset"):
        ragged.init_pool(8, 4, H, D, "turbo-9")
    with pytest.raises(ValueError, match="multiple of 8 at 3 bits"):
        ragged.init_pool(8, 4, H, 100, tq_jax.Options(key_bits=3, value_bits=4))
    with pytest.raises(ValueError, match="max_seqs"):
        ragged.init_pool(8, 4, H, D, max_seqs=0)


def test_write_and_attend_reject_bad_shapes(small):
    x = np.zeros((3, H, D), np.float32)
    with pytest.raises(ValueError, match=r"`k` must be \[T, kv_heads=2, head_dim=64\]"):
        ragged.write(small, np.zeros((3, 3, D), np.float32), x, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"`slot_mapping` must be an int array of shape \(3,\)"):
        ragged.write(small, x, x, np.zeros(4, np.int32))
    args = (np.array([3], np.int32), np.zeros((1, 2), np.int32), np.array([0, 1], np.int32), np.array([1], np.int32))
    with pytest.raises(ValueError, match="q_heads a multiple of kv_heads=2"):
        ragged.attend(small, np.zeros((1, 3, D), np.float32), *args)
    with pytest.raises(ValueError, match="RPA arguments"):
        ragged.attend(small, np.zeros((1, 2, D), np.float32), args[0], args[1], np.array([0, 1, 1], np.int32), args[3])
    with pytest.raises(ValueError, match="`sliding_window` must be None or an int >= 1"):
        ragged.attend(small, np.zeros((1, 2, D), np.float32), *args, sliding_window=0)
    with pytest.raises(ValueError, match="`impl` must be one of"):
        ragged.attend(small, np.zeros((1, 2, D), np.float32), *args, impl="cuda")


def test_norm_overflow_raises_eagerly(small):
    k = np.ones((2, H, D), np.float32)
    k[1, 0] = 1e4
    with pytest.raises(tq_jax.NormOverflowError, match="1 written vector"):
        ragged.write(small, k, k, np.array([0, 1], np.int32))
    ragged.write(small, k, k, np.array([0, -1], np.int32))  # a padding token is not stored: no error


# --------------------------------------------------------------------------- docs


@pytest.mark.slow  # a bfloat16 pool of its own: compiles write and attend again
def test_the_docs_snippet_runs_and_the_docstring_examples_hold(capsys):
    import doctest
    import os
    import re

    from tq_jax._src.kvcache import pool as pool_module

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "kvcache.md"), encoding="utf-8") as f:
        page = f.read()
    section = page[page.index("## Ragged paged attention (engine-facing form)"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/kvcache.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "(25, 6, 64) float32"
    assert doctest.testmod(pool_module).failed == 0


@pytest.mark.slow  # a fresh process with 4 forced host devices (seconds)
def test_shard_map_over_kv_heads_on_four_devices_matches_one_device():
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        from tq_jax._src.kvcache import ragged
        assert len(jax.devices()) == 4
        rng = np.random.default_rng(6)
        pool = ragged.init_pool(16, 8, 8, 64, dtype=jnp.float32, window=8, sinks=2, max_seqs=2)
        k = rng.standard_normal((20, 8, 64)).astype(np.float32)
        v = rng.standard_normal((20, 8, 64)).astype(np.float32)
        pos = np.r_[np.arange(13), np.arange(7)].astype(np.int32)
        pages = np.array([[3, 9, 0], [12, 0, 0]], np.int32)
        slots = np.r_[pages[0, pos[:13] // 8] * 8 + pos[:13] % 8, pages[1, pos[13:] // 8] * 8 + pos[13:] % 8].astype(np.int32)
        q = rng.standard_normal((20, 16, 64)).astype(np.float32)
        args = (np.array([13, 7], np.int32), pages, np.array([0, 13, 20], np.int32), np.array([2], np.int32))
        mesh = Mesh(np.array(jax.devices()), ("h",))
        heads = P(None, None, "h")
        spec = ragged.Pool(config=pool.config, k_codes=heads, k_norms=heads, v_codes=heads, v_norms=heads,
                           exact_k=heads, exact_v=heads, exact_valid=P(), exact_of=P(), exact_owner=P(),
                           exact_next=P(), sink_k=heads, sink_v=heads, sink_valid=P(), sink_of=P(), sink_owner=P())
        kv = P(None, "h")
        wr = jax.jit(jax.shard_map(lambda p, k, v, s, ps: ragged.write(p, k, v, s, positions=ps), mesh=mesh,
                                   in_specs=(spec, kv, kv, P(), P()), out_specs=spec))
        at = jax.jit(jax.shard_map(ragged.attend, mesh=mesh, in_specs=(spec, kv, P(), P(), P(), P()), out_specs=kv))
        sharded = wr(pool, k, v, slots, pos)
        one = ragged.write(pool, k, v, slots, positions=pos)
        np.testing.assert_array_equal(np.asarray(sharded.k_codes), np.asarray(one.k_codes))
        np.testing.assert_allclose(np.asarray(at(sharded, q, *args)), np.asarray(ragged.attend(one, q, *args)),
                                   rtol=1e-6, atol=1e-6)
        print("ok")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
