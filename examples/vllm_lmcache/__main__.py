"""vLLM with LMCache's multi-process server and the tq_jax serde, end to end.

Run from the repository root, in an environment with the ``vllm`` extra
(docs/vllm.md)::

    python -m examples.vllm_lmcache --out benchmarks/results/vllm_lmcache_cpu.md

1. Plain vLLM (no LMCache): greedy continuations of copy prompts, and the time to first
   token (TTFT) of long prompts whose whole prefix is computed.
2. The LMCache server (through ``python -m tq_jax.bridge.launch``) with an ``fs`` L2
   through the tq_jax serde; vLLM with ``LMCacheMPConnector``: **run 1** computes and
   stores every prompt.
3. **The server restarts** (L1 empties; L2 on disk stays) and a fresh vLLM connects.
4. **Run 2** asks the same prompts: the prefixes load from L2 through the serde. It
   reports TTFT against the recompute, the first L2 hit after the restart against the
   warm ones (the server's prefetch times), the bytes on L2 against raw bf16, and how
   many leading greedy tokens equal plain vLLM's.

vLLM's own prefix cache is off throughout, so every reused prefix comes from LMCache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .convert import convert
from .engine import Engine
from .prompts import PASSAGES, copy_prompt, long_prompt
from .server import LMCacheServer, fs_adapter

DEFAULT_MODEL = Path.home() / ".cache" / "tq-jax" / "smollm2-135m"


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many leading token ids two greedy continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def l2_files(base: Path) -> list[Path]:
    return sorted(p for p in base.rglob("*") if p.is_file())


def wait_for_l2(base: Path, count: int, timeout: float = 120.0) -> list[Path]:
    """Waits until the fs L2 holds ``count`` values (stores finish after vLLM returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = l2_files(base)
        if len(files) >= count:
            time.sleep(0.5)  # a value is renamed into place when complete; let the last one land
            return l2_files(base)
        time.sleep(0.2)
    return l2_files(base)


def run(args) -> dict:
    model = convert(args.model)
    serde = {"head_dim": 64, "max_workers": 2, **({"preset": args.preset} if args.preset else {}), **json.loads(args.serde)}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tq-jax-vllm-"))
    l2 = work / "l2"
    shutil.rmtree(l2, ignore_errors=True)
    copies = [copy_prompt(PASSAGES[i] + "\n\n" + PASSAGES[(i + 1) % len(PASSAGES)]) for i in range(len(PASSAGES))]
    greedy_prompts = [p for p, _ in copies]
    stored = {n: [long_prompt(n, seed=1000 * n + i) for i in range(args.repeats)] for n in args.lengths}
    fresh = {n: [long_prompt(n, seed=1000 * n + 500 + i) for i in range(args.repeats)] for n in args.lengths}
    engine_kw = dict(eager=args.eager, max_model_len=max(args.lengths) + 256)
    result = {"model": str(model), "serde": serde, "lengths": args.lengths, "eager": args.eager, "repeats": args.repeats}

    def first_token(engine: Engine, prompt: str) -> dict:
        return engine.generate([prompt], 1)[0]

    print("plain vLLM ...", flush=True)
    with Engine(model, work / "plain.log", **engine_kw) as e:
        first_token(e, "warm-up")
        result["plain"] = e.generate(greedy_prompts, args.max_tokens)
        result["plain_ttft"] = {n: [first_token(e, p) for p in stored[n]] for n in args.lengths}

    server = LMCacheServer(fs_adapter(l2, serde), work / "server.log")
    try:
        print("LMCache server + vLLM, run 1 (stores) ...", flush=True)
        server.start()
        with Engine(model, work / "run1.log", lmcache_port=server.port, **engine_kw) as e:
            first_token(e, "warm-up")
            result["run1"] = e.generate(greedy_prompts, args.max_tokens)
            for n in args.lengths:
                for p in stored[n]:
                    first_token(e, p)
        chunks = sum(o["prompt_tokens"] // 256 for o in result["plain"]) + sum(
            t["prompt_tokens"] // 256 for ts in result["plain_ttft"].values() for t in ts)
        files = wait_for_l2(l2, chunks)
        print(f"  L2 holds {len(files)} values; restarting the server ...", flush=True)
        server.restart()
        mark = len(server.lines())
        with Engine(model, work / "run2.log", lmcache_port=server.port, **engine_kw) as e:
            first_token(e, "warm-up")
            # Side by side: a stored prompt (loaded from L2: the first is the restarted
            # server's first L2 hit) and one never seen (computed), in turn.
            result["miss_ttft"], result["hit_ttft"] = {}, {}
            for n in args.lengths:
                result["miss_ttft"][n], result["hit_ttft"][n] = [], []
                for p_new, p_old in zip(fresh[n], stored[n]):
                    result["hit_ttft"][n].append(first_token(e, p_old))
                    result["miss_ttft"][n].append(first_token(e, p_new))
            result["run2"] = e.generate(greedy_prompts, args.max_tokens)
        result["l2_bytes"] = [f.stat().st_size for f in files]
        result["server_hits"] = server_lines_after(server, mark, "retained keys", "Retrieved ")
        result["server_errors"] = server_lines_after(server, 0, "ERROR", "Traceback")
    finally:
        server.stop()
    return result


def server_lines_after(server: LMCacheServer, mark: int, *needles: str) -> list[str]:
    return [line for line in server.lines()[mark:] if any(n in line for n in needles)]


def first_and_warm(hits: list[str]) -> tuple[tuple[int, float] | None, list[float]]:
    """From the server's prefetch lines in order: ``(chunks, ms)`` of the first that read
    from L2, and the times of the later ones that read as many chunks from L2."""
    import re

    seen = [(int(m.group(1)), float(m.group(2))) for line in hits
            if (m := re.search(r"\(\d+ L1, (\d+) L2\) in ([\d.]+) ms", line)) and int(m.group(1)) > 0]
    if not seen:
        return None, []
    return seen[0], [ms for n, ms in seen[1:] if n == seen[0][0]]


def clean(line: str) -> str:
    """A server log line without colour codes and source location."""
    import re

    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    return re.sub(r"\s*\([a-z_]+\.py:\d+:[\w.]+\)$", "", line).strip()


def report(r: dict, commit: str, command: str) -> str:
    layers, chunk, kv_heads, head_dim = 30, 256, 3, 64  # SmolLM2-135M, LMCache's chunk
    raw = 2 * layers * chunk * kv_heads * head_dim * 2
    sizes = sorted(set(r["l2_bytes"]))
    lines = [
        "# vLLM + LMCache multi-process server + tq_jax serde (SmolLM2-135M, CPU)",
        "",
        f"Commit `{commit}`; `{command}`; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; vLLM's prefix cache off; "
        f"{'enforce_eager' if r['eager'] else 'torch.compile (vLLM default)'}.",
        f"Serde: `{json.dumps(r['serde'])}`.",
        "",
        "## Time to first token: the prefix computed vs loaded from L2",
        "",
        "Run 2's engine, after the server restart, asks in turn a prompt it has never seen",
        "(its prefix is computed; LMCache stores it) and a prompt run 1 stored (its full",
        f"256-token chunks load from L2 through the serde; the tail is computed): {r['repeats']} pairs",
        "per length, medians. Plain vLLM (no LMCache) asked the stored prompts in its own run.",
        "",
        "| prompt tokens | chunks from L2 | plain vLLM | computed (miss) | loaded from L2 (hit) | hit / computed | hit / plain |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in r["lengths"]:
        med = lambda ts: statistics.median(t["seconds"] for t in ts)  # noqa: E731
        toks = r["hit_ttft"][n][0]["prompt_tokens"]
        p, m, h = med(r["plain_ttft"][n]), med(r["miss_ttft"][n]), med(r["hit_ttft"][n])
        lines.append(f"| {toks:,} | {toks // 256} | {p:.2f} s | {m:.2f} s | {h:.2f} s | {h / m:.2f}x | {h / p:.2f}x |")
    lines += [
        "",
        "## Bytes on L2",
        "",
        "| value | bytes | of raw bf16 |",
        "|---|---:|---:|",
        f"| raw bf16 chunk [30, 256, 384] | {raw:,} | 100 % |",
    ]
    for s in sizes:
        lines.append(f"| tq_jax value | {s:,} | {100 * s / raw:.1f} % |")
    lines += [
        f"| all {len(r['l2_bytes'])} values | {sum(r['l2_bytes']):,} | {100 * sum(r['l2_bytes']) / (raw * len(r['l2_bytes'])):.1f} % |",
        "",
        "## Greedy continuations (copy prompts): leading tokens equal to plain vLLM's",
        "",
        "| prompt | tokens | run 1 (computed) | run 2 (from L2) |",
        "|---:|---:|---:|---:|",
    ]
    for i, (p, a, b) in enumerate(zip(r["plain"], r["run1"], r["run2"])):
        lines.append(f"| {i} | {p['prompt_tokens']} | {leading_agreement(a['token_ids'], p['token_ids'])}/{len(p['token_ids'])} "
                     f"| {leading_agreement(b['token_ids'], p['token_ids'])}/{len(p['token_ids'])} |")
    lines += ["", "## The restarted server's first L2 hit against the warm ones", "",
              "The server's own prefetch times (`retained keys ... in N ms`: read from L2 and decoded), in the order "
              "they came after the restart; the first against the median of the later ones that loaded as many chunks "
              "from L2:", "", "| chunks from L2 | first prefetch | warm prefetches (median, n) | first / warm |",
              "|---:|---:|---:|---:|"]
    first, warm = first_and_warm(r["server_hits"])
    if first is not None:
        count, ms = first
        lines.append(f"| {count} | {ms:.0f} ms | {statistics.median(warm):.0f} ms ({len(warm)}) | "
                     f"{ms / statistics.median(warm):.2f}x |" if warm else f"| {count} | {ms:.0f} ms | none | - |")
    lines += ["", "## Server log after the restart: L2 loads and transfers to vLLM", "", "```"]
    lines += [clean(line) for line in r["server_hits"]] + ["```", ""]
    if r["server_errors"]:
        lines += ["## Server log: errors", "", "```"] + [l[:200] for l in r["server_errors"][:20]] + ["```", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.vllm_lmcache", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help=f"HF model directory, converted from the GGUF when missing (default {DEFAULT_MODEL})")
    p.add_argument("--preset", default="", help="tq_jax preset for the serde (default: none, the serde's own default)")
    p.add_argument("--serde", default="{}", help="more serde options as JSON (override the preset)")
    p.add_argument("--lengths", default="1024,4096", help="long-prompt lengths for the TTFT table (tokens, comma-separated)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per copy prompt")
    p.add_argument("--repeats", type=int, default=3, help="miss/hit pairs per length")
    p.add_argument("--eager", action="store_true", help="vLLM enforce_eager (faster start, slower compute)")
    p.add_argument("--workdir", help="where the L2 store and logs go (default: a new temporary directory)")
    p.add_argument("--out", help="write the markdown report here (else print it)")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    r = run(args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    text = report(r, commit, "python -m examples.vllm_lmcache " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(r, indent=1))
    print(text)


if __name__ == "__main__":
    main()
