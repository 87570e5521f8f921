"""Ragged paged attention over codes (``tq_jax._src.kvcache.ragged``) vs dense bf16 attention.

One mixed step as a serving engine runs it: ``S`` sequences of ``T`` tokens of context
each, of which one is prefilling a chunk of ``Q`` tokens (its last ``Q`` positions) and
the rest decode one token; 8 KV heads, GQA 4 (32 query heads), head_dim 128, pages of
16 tokens handed out in a shuffled order. Timed in one process, interleaved in each
round after warm-up (compiles excluded), median over rounds:

* ``ragged.attend`` (``impl="xla"``) over the default pool (4/4 bits, Haar; the exact
  window of the last 128 tokens and the first 4 kept per page), the flat batch of
  ``Q + S - 1`` queries;
* ``jax.nn.dot_product_attention`` over the same logical K/V in bfloat16 laid out densely
  (``[S, T, H, D]``, no pages): the decode queries as one batch with
  ``key_value_seq_lengths``, the prefill chunk with its causal mask; one jitted program;
* ``ragged.write`` of the step's new K/V (quantize and scatter to their slots), jitted with
  the pool donated, as an engine's step runs it.

Tokens/s counts query tokens of the step. Bytes per token per KV head: the pool's code
rows and norms (``head_dim * (key_bits + value_bits) / 8 + 4``), and the pool's whole
leaves (exact pools and maps included) over its capacity, against bf16's ``4 * head_dim``.
The cosine compares ``attend`` with dense float32 attention over the raw K/V.

    python benchmarks/bench_ragged.py             # writes benchmarks/results/ragged_cpu.md
    python benchmarks/bench_ragged.py --quick     # 1k context only, 3 rounds, no file
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src.kvcache import ragged

H, G, D, PAGE = 8, 4, 128, 16


def dense_step(q_dec, q_pf, k, v, lens, pf_len):
    """Dense bf16 attention of the step: decode queries ``[S-1, 1, HG, D]`` over sequences
    1.. of ``k``/``v`` ``[S, T, H, D]`` (their lengths ``lens``), and the prefill chunk
    ``[1, Q, HG, D]`` of sequence 0 (the last ``Q`` of its ``pf_len`` positions, causal)."""
    dec = jax.nn.dot_product_attention(q_dec, k[1:], v[1:], key_value_seq_lengths=lens[1:])
    n_q, t = q_pf.shape[1], k.shape[1]
    qpos = pf_len - n_q + jnp.arange(n_q)
    mask = (jnp.arange(t)[None, :] <= qpos[:, None])[None, None]  # [1, 1, Q, T]
    pf = jax.nn.dot_product_attention(q_pf, k[:1], v[:1], mask=mask)
    return dec, pf


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def bench(seqs: int, tokens: int, chunk: int, rounds: int, rng) -> dict:
    pps = -(-tokens // PAGE)
    num_pages = seqs * pps
    k = rng.standard_normal((seqs, tokens, H, D), dtype=np.float32)
    v = rng.standard_normal((seqs, tokens, H, D), dtype=np.float32)
    pages = rng.permutation(num_pages).astype(np.int32).reshape(seqs, pps)
    pos = np.arange(tokens)
    slots = (pages[:, pos // PAGE] * PAGE + pos % PAGE).astype(np.int32)  # [S, T]
    pool = ragged.init_pool(num_pages, PAGE, H, D, max_seqs=seqs)
    write = jax.jit(lambda p, k, v, s, ps: ragged.write(p, k, v, s, positions=ps), donate_argnums=0)
    step_new = chunk + seqs - 1  # this step's tokens: sequence 0's chunk, one for each other
    for s in range(seqs):  # the context before this step, a page-aligned prefill each
        n = tokens - (chunk if s == 0 else 1)
        for c in range(0, n, 1024):
            e = min(c + 1024, n)
            pool = write(pool, jnp.asarray(k[s, c:e], jnp.bfloat16), jnp.asarray(v[s, c:e], jnp.bfloat16),
                         jnp.asarray(slots[s, c:e]), jnp.asarray(pos[c:e], jnp.int32))
    new_k = np.concatenate([k[0, tokens - chunk :]] + [k[s, -1:] for s in range(1, seqs)])
    new_v = np.concatenate([v[0, tokens - chunk :]] + [v[s, -1:] for s in range(1, seqs)])
    new_slots = np.concatenate([slots[0, tokens - chunk :]] + [slots[s, -1:] for s in range(1, seqs)])
    new_pos = np.concatenate([pos[tokens - chunk :]] + [pos[-1:]] * (seqs - 1)).astype(np.int32)
    nk, nv = jnp.asarray(new_k, jnp.bfloat16), jnp.asarray(new_v, jnp.bfloat16)
    ns, npos = jnp.asarray(new_slots), jnp.asarray(new_pos)
    step_pool = write(jax.tree.map(jnp.copy, pool), nk, nv, ns, npos)

    q = rng.standard_normal((step_new, H * G, D), dtype=np.float32)
    kv_lens = np.full(seqs, tokens, np.int32)
    cu = np.concatenate([[0], chunk + np.arange(seqs)]).astype(np.int32)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv_lens), jnp.asarray(pages), jnp.asarray(cu),
            jnp.array([seqs], jnp.int32))
    attend = jax.jit(lambda p, *a: ragged.attend(p, *a, impl="xla"))
    kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    q_dec = jnp.asarray(q[chunk:, None], jnp.bfloat16)
    q_pf = jnp.asarray(q[None, :chunk], jnp.bfloat16)
    dense = jax.jit(dense_step)
    lens = jnp.asarray(kv_lens)
    chain = {"pool": pool}  # the write rewrites the step's slots of a pool it donates, as an engine's step does

    def rewrite():
        chain["pool"] = write(chain["pool"], nk, nv, ns, npos)
        return chain["pool"]

    runs = {
        "ragged.attend": (attend, step_pool, *args),
        "dense bf16": (dense, q_dec, q_pf, kb, vb, lens, tokens),
        "ragged.write": (rewrite,),
    }
    for fn, *a in runs.values():  # warm-up: compile
        timed(fn, *a)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (fn, *a) in runs.items():
            times[name].append(timed(fn, *a))
    ours = np.asarray(attend(step_pool, *args), np.float32)
    d32 = jax.jit(dense_step)(jnp.asarray(q[chunk:, None]), jnp.asarray(q[None, :chunk]), jnp.asarray(k),
                              jnp.asarray(v), lens, tokens)
    ref = np.concatenate([np.asarray(d32[1])[0], np.asarray(d32[0])[:, 0]])
    a, b = ours.reshape(-1, D), ref.reshape(-1, D)
    cos = float(np.mean(np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))))
    cfg = step_pool.config
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {
        "seqs": seqs, "tokens": tokens, "chunk": chunk, "queries": step_new, "ms": ms,
        "ratio": statistics.median(x / y for x, y in zip(times["ragged.attend"], times["dense bf16"])),
        "codes_per_token": cfg.key_codec.row_nbytes + cfg.value_codec.row_nbytes + 4,
        "pool_per_token": ragged.nbytes(step_pool) / (num_pages * PAGE * H),
        "cosine": cos,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ragged_cpu.md"))
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    cases = [(8, 1024, 128)] if args.quick else [(8, 1024, 128), (8, 4096, 256), (16, 4096, 64), (4, 16384, 256)]
    rounds = args.rounds or (3 if args.quick else 9)
    load = os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    rng = np.random.default_rng(0)
    rows = [bench(s, t, c, rounds, rng) for s, t, c in cases]
    lines = [
        "# Ragged paged attention over codes vs dense bf16 attention (CPU)",
        "",
        f"Commit {commit}; command: `python benchmarks/bench_ragged.py{' ' + ' '.join(argv) if argv else ''}`.",
        "",
        f"One mixed step: S sequences of T tokens of context; sequence 0 prefills its last Q tokens as one chunk, "
        f"the others decode one token each (Q + S - 1 queries). {H} KV heads, GQA {G}, head_dim {D}, pages of "
        f"{PAGE} tokens in a shuffled order; jax {jax.__version__} on {jax.devices()[0].platform}; median of "
        f"{rounds} interleaved rounds after warm-up; the ratio is the median of per-round ratios. `ragged.attend` "
        f"runs `impl=\"xla\"` over the default pool (4/4 bits, exact window 128 and 4 sinks kept per page); "
        f"`dense bf16` is `jax.nn.dot_product_attention` over the same K/V in bf16, laid out densely (no pages). "
        f"`ragged.write` quantizes and stores the step's new K/V. Bytes are per token per KV head: the codes and "
        f"norms alone, and every leaf of the pool (exact pools and their maps included) over its capacity; a bf16 "
        f"cache holds {4 * D}.",
        "",
        "| S | T | Q | queries | ragged.attend ms | dense bf16 ms | attend / dense | attend tokens/s "
        "| dense tokens/s | ragged.write ms | bytes/token/head: codes, pool (bf16 512) | cosine vs dense f32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['seqs']} | {r['tokens']} | {r['chunk']} | {r['queries']} | {ms['ragged.attend']:.1f} | "
            f"{ms['dense bf16']:.1f} | {r['ratio']:.2f}x | {r['queries'] / ms['ragged.attend'] * 1e3:,.0f} | "
            f"{r['queries'] / ms['dense bf16'] * 1e3:,.0f} | {ms['ragged.write']:.1f} | "
            f"{r['codes_per_token']}, {r['pool_per_token']:.1f} | {r['cosine']:.4f} |"
        )
    lines += ["", f"Load average at start: {load:.1f} (2 CPUs shared with other jobs)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
