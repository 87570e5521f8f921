"""Two vLLM instances sharing one Redis through LMCache and the tq_jax serde, under load and faults.

Run in the ``vllm`` extra's environment (docs/vllm.md, "Several instances, one store")::

    .venv-vllm/bin/python -m benchmarks.vllm_soak --minutes 10 --out benchmarks/results/vllm_soak_cpu.md

What runs (all on 127.0.0.1, every child in its own process group, all stopped at exit):
one ``redis-server`` (persistence off, its own directory); two LMCache servers, each with
a ``resp_reconnect`` L2 to that Redis through the serde, which seals every value per
tenant under one shared master key file; two vLLM OpenAI servers, A and B, each
connected to its own LMCache server. A plain vLLM server (no connector) first answers
every prompt once, with log-probabilities, and is stopped: those are the references.

Load: ``--clients`` threads send greedy completions over HTTP for ``--minutes``, in a
fixed order (seeded shuffles of rounds): every prompt to both instances under every
tenant (``cache_salt``). A prompt is one of a few long shared prefixes (2 to 7 LMCache
chunks of 256 tokens) followed by one of a few copy-task suffixes, so a prefix that A
computed and stored is loaded by B from Redis. Faults, at fixed fractions of the run,
each logged with its time: Redis killed (SIGKILL) and restarted, twice; LMCache server
B killed and restarted; values in Redis damaged (a byte flipped mid-value, values cut to
half); one tenant's values copied onto another tenant's key for the same chunk; and
both servers' L1 cleared on a period, so that later hits come from Redis. A and B get
disjoint halves of the CPUs for their OpenMP threads. A vLLM server that exits (vLLM's
API server does when its engine dies) is restarted, and the restart is logged as an
operator action.

Reported (a markdown file that starts with the command and the commit): requests sent,
answered and failed (with reasons); answers whose leading greedy tokens equal plain
vLLM's; the L2 hit rate from the LMCache logs; TTFT p50/p99 by where the prefix came
from; bytes in Redis against bf16; and per fault the failed requests, the serde's
refusals in the LMCache logs, and how long until answers and L2 hits came back.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from examples.vllm_lmcache.__main__ import DEFAULT_MODEL, leading_agreement
from examples.vllm_lmcache.api import ApiError, ApiServer, Completion, cpu_sets
from examples.vllm_lmcache.convert import convert
from examples.vllm_lmcache.prompts import PASSAGES, copy_prompt
from examples.vllm_lmcache.server import LMCacheServer, free_port

CHUNK_TOKENS = 256  # LMCache's chunk
BF16_CHUNK_BYTES = 30 * CHUNK_TOKENS * 3 * 2 * 64 * 2  # SmolLM2-135M: [30 layers, 256, 3 heads * (K+V) * 64] bf16
TIE = 2.0  # nats: plain vLLM's token leads its runner-up by less: a near-tie, where agreement stops being required
TENANTS = ("tenant-red", "tenant-blue")
REDIS_DOWN_S = 5.0  # how long Redis stays dead before its restart
FAILED_BACKOFF_S = 2.0  # a client pauses after a failed request (a dead server refuses at once)
REFUSAL_REASONS = ("ChecksumError", "KeyMismatchError", "SealError", "TruncatedError", "WireError", "InvalidTag",
                   "BadMagicError", "ValueError")
LOG_TIME = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")
PREFETCH = re.compile(r"retained keys \((\d+) L1, (\d+) L2\).*external_request_id=(\S+?)[,)]")
SERDE_FAILED = re.compile(r"Serde task \d+ \((\w+)\) failed")
NO_REDIS = "redis-server is not installed: apt-get install -y redis-server (the soak runs its own, on loopback)."


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- prompts


def prefix_text(index: int, approx_tokens: int) -> str:
    """A shared prefix of about ``approx_tokens`` tokens: the passages in a seeded order
    (SmolLM2's tokenizer: ~1.3 tokens per word of them); distinct per ``index``."""
    rng = random.Random(index)
    parts, words = [f"Archive {index}."], 0
    while words * 1.3 < approx_tokens:
        p = rng.choice(PASSAGES)
        parts.append(p)
        words += len(p.split(" "))
    return "\n\n".join(parts)


def build_prompts(prefix_tokens: list[int], suffixes: int) -> dict[tuple[int, int], str]:
    """``{(prefix, suffix): prompt}``: each prefix followed by each copy-task suffix, whose
    greedy continuation is the copied passage's next words by a wide margin."""
    return {(k, j): prefix_text(k, n) + "\n\n" + copy_prompt(PASSAGES[j % len(PASSAGES)])[0]
            for k, n in enumerate(prefix_tokens) for j in range(suffixes)}


# ----------------------------------------------------------------------------- Redis


class RedisProcess:
    """``redis-server`` on 127.0.0.1:``port``, persistence off, in its own directory;
    killable (SIGKILL) and restartable on the same port, empty after each start."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit(NO_REDIS)
        self.binary, self.dir, self.port = binary, workdir / "redis", free_port()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 15.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir), "--save", "",
             "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start ({self.proc.returncode}): port {self.port} taken?")
            with contextlib.suppress(Exception):
                if self.client(timeout=0.5).ping():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on 127.0.0.1:{self.port} within {timeout:.0f} s")

    def client(self, timeout: float = 5.0):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def values_by_chunk(r) -> dict[str, dict[str, bytes]]:
    """Redis keys grouped by chunk: ``{model@rank@group@hash: {cache_salt: key}}`` (LMCache's
    RESP key is ``<model>@<kv_rank:08x>@<group:x>@<chunk_hash hex>[@<cache_salt>]``)."""
    groups: dict[str, dict[str, bytes]] = defaultdict(dict)
    for key in r.scan_iter(count=1000):
        parts = key.decode(errors="replace").split("@")
        if len(parts) == 5:
            groups["@".join(parts[:4])][parts[4]] = key
    return groups


def damage_values(r, flips: int, cuts: int, rng: random.Random) -> str:
    """Flips one byte in the middle of ``flips`` values and cuts ``cuts`` others to half."""
    keys = sorted(r.scan_iter(count=1000))
    rng.shuffle(keys)
    done = []
    for key in keys[:flips]:
        mid = r.strlen(key) // 2
        r.setrange(key, mid, bytes([r.getrange(key, mid, mid)[0] ^ 0x40]))
        done.append(f"flipped byte {mid} of {key.decode()[-30:]}")
    for key in keys[flips:flips + cuts]:
        n = r.strlen(key)
        r.set(key, r.getrange(key, 0, n // 2 - 1))
        done.append(f"cut {key.decode()[-30:]} to {n // 2} of {n} bytes")
    return "; ".join(done) or "no values in Redis to damage"


def copy_across_tenants(r, count: int) -> str:
    """Copies tenant X's value onto tenant Y's key for the same chunk hash, ``count`` times."""
    done = []
    for base, by_salt in sorted(values_by_chunk(r).items()):
        if len(done) == count:
            break
        if all(t in by_salt for t in TENANTS):
            r.set(by_salt[TENANTS[1]], r.get(by_salt[TENANTS[0]]))
            done.append(f"{TENANTS[0]}'s value of chunk {base[-12:]} onto {TENANTS[1]}'s key")
    return "; ".join(done) or "no chunk stored under both tenants yet"


def redis_bytes(r) -> dict:
    """Values in Redis (count, total STRLEN, per tenant) and ``INFO memory``'s used_memory."""
    n, total, per_tenant = 0, 0, Counter()
    for key in r.scan_iter(count=1000):
        size = r.strlen(key)
        n, total = n + 1, total + size
        per_tenant[key.decode(errors="replace").split("@")[-1]] += 1
    return {"values": n, "bytes": total, "used_memory": int(r.info("memory")["used_memory"]),
            "per_tenant": dict(per_tenant)}


# ----------------------------------------------------------------------------- the run


@dataclass
class Result:
    """One request: what was sent, when (seconds since the load began), and what came back."""

    n: int
    instance: str
    prompt: tuple[int, int]
    tenant: str
    sent: float
    done: float = 0.0
    completion: Completion | None = None
    error: str | None = None
    source: str = ""  # "L2", "L1" or "computed", from vLLM's cached_tokens and LMCache's log
    l1_keys: int = 0
    l2_keys: int = 0


@dataclass
class Event:
    at: float  # seconds since the load began
    wall: float  # time.time()
    name: str
    detail: str = ""
    fault: bool = True


@dataclass
class Soak:
    args: argparse.Namespace
    work: Path
    prompts: dict
    stack: contextlib.ExitStack
    redis: RedisProcess | None = None
    lmcache: dict = field(default_factory=dict)
    vllm: dict = field(default_factory=dict)
    events: list = field(default_factory=list)
    results: list = field(default_factory=list)
    dbsize: list = field(default_factory=list)  # (at, number of values or None while Redis is down)
    t0: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, name: str, detail: str = "", fault: bool = True) -> None:
        e = Event(self.now(), time.time(), name, detail, fault)
        self.events.append(e)
        log(f"t={e.at:6.1f}s {name}{': ' + detail if detail else ''}")


def serde_config(args, master_key: Path) -> dict:
    """The operator's minimal serde dict, encrypted per tenant, with ``--serde`` on top."""
    return {"type": "tq_jax", "head_dim": 64, "encrypt": {"master_key_path": str(master_key)}, "max_workers": 2,
            **json.loads(args.serde)}


def references(args, model: Path, prompts: dict) -> dict:
    """Plain vLLM's greedy answer (with margins) to every prompt, from a server without LMCache."""
    log("plain vLLM: reference answers ...")
    with ApiServer(model, Path(args.workdir) / "plain-vllm.log", max_model_len=args.max_model_len) as plain:
        return {key: plain.complete(p, max_tokens=args.max_tokens, logprobs=5, timeout=600)
                for key, p in prompts.items()}


def start_stack(soak: Soak, model: Path, serde: dict) -> None:
    args, work = soak.args, soak.work
    soak.redis = RedisProcess(work)
    soak.redis.start()
    soak.stack.callback(soak.redis.stop)
    adapter = {"type": "resp_reconnect", "host": "127.0.0.1", "port": soak.redis.port, "serde": serde}
    for name, cpus in zip(("A", "B"), cpu_sets(2)):
        server = LMCacheServer(adapter, work / f"lmcache-{name}.log", l1_size_gb=args.l1_size_gb,
                               shm=args.transfer == "shm")
        soak.stack.callback(server.stop)
        soak.lmcache[name] = server
        soak.vllm[name] = ApiServer(model, work / f"vllm-{name}.log", lmcache_port=server.port,
                                    max_model_len=args.max_model_len, omp_cpus=cpus)
        soak.stack.callback(soak.vllm[name].stop)
    log(f"Redis on port {soak.redis.port}; starting two LMCache servers and two vLLM servers ...")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda s: s.start(), soak.lmcache.values()))
        list(pool.map(lambda s: s.start(), soak.vllm.values()))


def schedule(prompts: dict):
    """The requests, in a fixed order: rounds of every (prompt, tenant, instance), each
    round shuffled with its own seed."""
    combos = [(key, tenant, inst) for key in sorted(prompts) for tenant in TENANTS for inst in ("A", "B")]
    for r in itertools.count():
        order = list(combos)
        random.Random(r).shuffle(order)
        yield from order


def client_loop(soak: Soak, jobs, end: float) -> None:
    while soak.now() < end:
        with soak.lock:
            key, tenant, inst = next(jobs)
            res = Result(len(soak.results), inst, key, tenant, soak.now())
            soak.results.append(res)
        try:
            res.completion = soak.vllm[inst].complete(soak.prompts[key], max_tokens=soak.args.max_tokens,
                                                      cache_salt=tenant, timeout=soak.args.request_timeout)
        except ApiError as e:
            res.error = str(e)
            time.sleep(FAILED_BACKOFF_S)
        res.done = soak.now()


def clear_both(soak: Soak) -> str:
    out = []
    for name, server in soak.lmcache.items():
        try:
            server.clear_l1()
            out.append(f"{name} cleared")
        except OSError as e:
            out.append(f"{name} not cleared ({type(e).__name__}: {e})")
    return ", ".join(out)


def fault_plan(soak: Soak, seconds: float) -> list[tuple[float, str, callable]]:
    """``(at, name, action)`` at fixed fractions of the run; ``action()`` returns a detail line."""
    rng = random.Random(0)
    r = lambda: soak.redis.client()  # noqa: E731

    def redis_kill_restart() -> str:
        soak.redis.kill()
        soak.note("Redis killed (SIGKILL)", f"restarted after {REDIS_DOWN_S:.0f} s")
        time.sleep(REDIS_DOWN_S)
        soak.redis.start()
        return f"restarted empty on port {soak.redis.port}"

    def lmcache_kill_restart() -> str:
        server = soak.lmcache["B"]
        server.kill()
        soak.note("LMCache server B killed (SIGKILL)")
        t = time.monotonic()
        server.start()
        return f"healthy again after {time.monotonic() - t:.1f} s (same ports; L1 empty)"

    plan = [  # the LMCache server's crash last: it can end vLLM B's engine (docs/vllm.md says when)
        (0.15, "values damaged in Redis", lambda: damage_values(r(), 3, 2, rng) + "; " + clear_both(soak)),
        (0.25, "Redis restarted", redis_kill_restart),
        (0.38, "tenant values copied across", lambda: copy_across_tenants(r(), 3) + "; " + clear_both(soak)),
        (0.50, "Redis restarted", redis_kill_restart),
        (0.62, "values damaged in Redis", lambda: damage_values(r(), 2, 1, rng) + "; " + clear_both(soak)),
        (0.75, "LMCache server B restarted", lmcache_kill_restart),
    ]
    period = max(20.0, seconds / 10)
    clears = [(t, "L1 cleared (periodic)", lambda: clear_both(soak)) for t in
              [period * i for i in range(1, int(seconds / period))]]
    return sorted([(f * seconds, name, fn) for f, name, fn in plan] + clears, key=lambda x: x[0])


def fault_loop(soak: Soak, plan, stop: threading.Event) -> None:
    """Runs the plan in order; a periodic L1 clear that a slow fault delayed past its time is skipped."""
    for at, name, action in plan:
        if stop.wait(max(0.0, at - soak.now())):
            return
        if "periodic" in name and soak.now() - at > 5.0:
            continue
        try:
            detail = action()
        except Exception as e:  # noqa: BLE001 - a failed fault action is reported, the run goes on
            detail = f"the action failed: {type(e).__name__}: {e}"
        soak.note(name, detail, fault="periodic" not in name)


def monitor_loop(soak: Soak, stop: threading.Event) -> None:
    """Samples the number of values in Redis every 2 s (None while it is down)."""
    while not stop.wait(2.0):
        try:
            soak.dbsize.append((soak.now(), int(soak.redis.client(timeout=1).dbsize())))
        except Exception:  # noqa: BLE001 - Redis down: recorded as None
            soak.dbsize.append((soak.now(), None))


def watchdog_loop(soak: Soak, stop: threading.Event) -> None:
    """Restarts a vLLM server whose process exited (vLLM's API server exits when its
    engine dies), so the rest of the run still measures two instances. Each restart is an
    operator action and is logged as such, with the engine's last error."""
    while not stop.wait(5.0):
        for name, server in soak.vllm.items():
            if server.proc is not None and server.proc.poll() is not None:
                why = next((l for l in reversed(server.lines()) if "Error" in l and "Traceback" not in l), "")
                soak.note(f"vLLM {name} exited ({server.proc.returncode}); restarted by the soak (operator action)",
                          re.sub(r"\x1b\[[0-9;]*m", "", why)[-200:])
                try:
                    server.start()
                except RuntimeError as e:
                    soak.note(f"vLLM {name} did not restart", str(e)[:200])


def run(args) -> dict:
    work = Path(args.workdir)
    model = convert(args.model)
    prompts = build_prompts([int(x) for x in args.prefix_tokens.split(",")], args.suffixes)
    master = work / "master.key"
    master.write_bytes(os.urandom(32))
    serde = serde_config(args, master)
    refs = references(args, model, prompts)
    with contextlib.ExitStack() as stack:
        soak = Soak(args, work, prompts, stack)
        start_stack(soak, model, serde)
        seconds = args.minutes * 60
        marks = {name: s.log_path.stat().st_size for name, s in soak.lmcache.items()}
        soak.t0 = time.monotonic()
        soak.note("load started", f"{args.clients} clients for {seconds:.0f} s", fault=False)
        stop = threading.Event()
        jobs = schedule(prompts)
        threads = [threading.Thread(target=fault_loop, args=(soak, fault_plan(soak, seconds), stop), daemon=True),
                   threading.Thread(target=monitor_loop, args=(soak, stop), daemon=True),
                   threading.Thread(target=watchdog_loop, args=(soak, stop), daemon=True)]
        threads += [threading.Thread(target=client_loop, args=(soak, jobs, seconds), daemon=True)
                    for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads[3:]:
            t.join(seconds + args.request_timeout + 30)
        stop.set()
        threads[0].join(60)
        soak.note("load ended", fault=False)
        time.sleep(3)  # let the last stores reach Redis
        stored = redis_bytes(soak.redis.client())
        logs = {name: read_from(s.log_path, marks[name]) for name, s in soak.lmcache.items()}
    return {"serde": serde, "refs": refs, "results": soak.results, "events": soak.events, "dbsize": soak.dbsize,
            "stored": stored, "logs": logs, "seconds": seconds}


def read_from(path: Path, offset: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(offset)
        return [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in f.read().decode(errors="replace").splitlines()]


# ----------------------------------------------------------------------------- analysis


def log_time(line: str) -> float | None:
    m = LOG_TIME.search(line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def refusals(lines: list[str]) -> list[tuple[float | None, str]]:
    """``(time, reason)`` per value the serde refused: a ``Serde task ... (DESERIALIZE)
    failed`` line, its reason the first known error name in the traceback after it."""
    out = []
    for i, line in enumerate(lines):
        m = SERDE_FAILED.search(line)
        if m and m.group(1) == "DESERIALIZE":
            reason = next((r for later in lines[i + 1:i + 60] for r in REFUSAL_REASONS if r + ":" in later), "unknown")
            out.append((log_time(line), reason))
    return out


def classify(r: dict) -> None:
    """Marks each answered request L2 / L1 / computed: vLLM's ``cached_tokens`` says
    whether a prefix was loaded at all; the LMCache log's prefetch line for the same
    request id (``external_request_id=<completion id>-...``) says from where."""
    prefetch = {}
    for lines in r["logs"].values():
        for line in lines:
            m = PREFETCH.search(line)
            if m:
                prefetch[m.group(3)] = (int(m.group(1)), int(m.group(2)))
    for res in r["results"]:
        c = res.completion
        if c is None:
            continue
        hit = next((v for k, v in prefetch.items() if k.startswith(c.id + "-")), (0, 0))
        res.l1_keys, res.l2_keys = hit
        res.source = "computed" if not c.cached_tokens else ("L2" if hit[1] else "L1")


def must_agree(ref: Completion, lead: int) -> int:
    """Leading tokens that must equal plain vLLM's: ``lead``, cut at plain vLLM's first
    near-tie (its token ahead of the runner-up by under ``TIE`` nats), where a quantized
    prefix or another batch composition may flip the choice."""
    ties = [i for i, m in enumerate(ref.margins) if m < TIE]
    return min([lead, len(ref.token_ids)] + ties)


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))] if xs else float("nan")


def report(r: dict, command: str, commit: str) -> str:
    classify(r)
    refs, results, seconds = r["refs"], r["results"], r["seconds"]
    answered = [x for x in results if x.completion is not None]
    failed = [x for x in results if x.completion is None]
    agree = {x.n: leading_agreement(x.completion.token_ids, refs[x.prompt].token_ids) >= must_agree(refs[x.prompt],
             r["lead"]) for x in answered}
    lines = [
        "# Two vLLM instances, one Redis store, under load and faults (SmolLM2-135M, CPU)",
        "",
        f"Command: `{command}`",
        f"Commit: `{commit}`; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"{seconds / 60:.1f} minutes of load.",
        f"Serde: `{json.dumps(r['serde'])}` (master key: a random file written by the run).",
        f"Prompts: {len(refs)} ({', '.join(str(c.prompt_tokens) for c in refs.values())} tokens), "
        f"each to both instances under {len(TENANTS)} tenants (`cache_salt`); "
        f"{r['max_tokens']} greedy tokens; {r['clients']} client threads.",
        "",
        "## Requests",
        "",
        "| sent | answered | failed | leading tokens equal to plain vLLM's | not equal |",
        "|---:|---:|---:|---:|---:|",
        f"| {len(results)} | {len(answered)} | {len(failed)} | {sum(agree.values())} | "
        f"{len(agree) - sum(agree.values())} |",
        "",
        f"An answer counts as equal when its first N greedy tokens are plain vLLM's, N = {r['lead']} or the",
        f"position of plain vLLM's first near-tie (its token ahead of the runner-up by under {TIE} nats),",
        "whichever comes first: there a quantized prefix, or another batch composition, may flip",
        "the choice. Plain vLLM: the same server flags without the connector, one request at a time.",
    ]
    if failed:
        lines += ["", "| failed at (s) | instance | reason |", "|---:|---|---|"]
        lines += [f"| {x.sent:.1f} | {x.instance} | {x.error[:160]} |" for x in failed]
    bad = [x for x in answered if not agree[x.n]]
    if bad:
        lines += ["", "| not equal: at (s) | instance | tenant | prompt | source | leading tokens equal / required |",
                  "|---:|---|---|---|---|---:|"]
        lines += [f"| {x.sent:.1f} | {x.instance} | {x.tenant} | {x.prompt} | {x.source} | "
                  f"{leading_agreement(x.completion.token_ids, refs[x.prompt].token_ids)}/"
                  f"{must_agree(refs[x.prompt], r['lead'])} |" for x in bad]
    lines += ttft_section(answered) + l2_section(r, answered) + bytes_section(r) + fault_section(r, results, agree)
    return "\n".join(lines) + "\n"


def ttft_section(answered) -> list[str]:
    out = ["", "## Time to first token by where the prefix came from", "",
           "Per request: vLLM's `cached_tokens` (prefix cache off: tokens loaded through the connector)",
           "says whether a prefix was loaded; the LMCache server's `Prefetch request completed ... (n L1, m L2)`",
           "line for that request id says from where (any key from Redis: L2).", "",
           "| source | requests | TTFT p50 | TTFT p99 | prompt tokens (median) |", "|---|---:|---:|---:|---:|"]
    for src in ("L2", "L1", "computed"):
        xs = [x for x in answered if x.source == src]
        if xs:
            toks = sorted(x.completion.prompt_tokens for x in xs)[len(xs) // 2]
            out.append(f"| {src} | {len(xs)} | {pct([x.completion.ttft for x in xs], 50):.2f} s | "
                       f"{pct([x.completion.ttft for x in xs], 99):.2f} s | {toks} |")
    return out


def l2_section(r, answered) -> list[str]:
    requested = sum((x.completion.prompt_tokens - 1) // CHUNK_TOKENS for x in answered)
    l1 = sum(x.l1_keys for x in answered)
    l2 = sum(x.l2_keys for x in answered)
    return ["", "## L2 hits", "",
            f"Keys (256-token chunks) requested by answered prompts: {requested}; found in L1: {l1}; loaded from",
            f"Redis (L2): {l2}; L2 hit rate (of the keys not in L1): {l2 / max(1, requested - l1):.1%}. A key's first",
            "request, and its first after each Redis restart, is a miss by design, as is a chunk of a prompt's",
            "own suffix that no earlier request (of that tenant) stored."]


def bytes_section(r) -> list[str]:
    s = r["stored"]
    raw = s["values"] * BF16_CHUNK_BYTES
    return ["", "## Bytes in Redis at the end", "",
            "| values | sum of STRLEN | INFO used_memory | bf16 bytes of the same chunks | stored / bf16 |",
            "|---:|---:|---:|---:|---:|",
            f"| {s['values']} | {s['bytes']:,} | {s['used_memory']:,} | {raw:,} | {s['bytes'] / max(1, raw):.1%} |",
            "", f"Values per tenant: {json.dumps(s['per_tenant'])} (Redis restarts empty: only values stored "
            "after its last restart are here)."]


def fault_section(r, results, agree) -> list[str]:
    events = r["events"]
    faults = [e for e in events if e.fault]
    refused = [(t, reason) for lines in r["logs"].values() for t, reason in refusals(lines)]
    out = ["", "## Faults", "",
           "Per fault, until the next one: requests sent that failed; values the serde refused (LMCache log:",
           "`Serde task ... (DESERIALIZE) failed`, by the error in its traceback). Seconds from the fault",
           "to the end of the first request sent after it that was answered equal to plain vLLM, and of",
           "the first answer with a prefix from Redis; for Redis, to the first value in the new Redis",
           "(sampled every 2 s). No operator action in between unless the event log says so.", "",
           "| at (s) | fault | failed | refused by the serde | normal answer after | L2 hit after | store after |",
           "|---:|---|---:|---|---:|---:|---:|"]
    for i, e in enumerate(faults):
        end = faults[i + 1].at if i + 1 < len(faults) else float("inf")
        window = [x for x in results if e.at <= x.sent < end]
        wall_end = faults[i + 1].wall if i + 1 < len(faults) else float("inf")
        why = Counter(reason for t, reason in refused if t is not None and e.wall <= t < wall_end)
        ok = [x.done - e.at for x in results if x.sent >= e.at and x.completion is not None and agree[x.n]]
        hit = [x.done - e.at for x in results if x.sent >= e.at and x.source == "L2"]
        store = [at - e.at for at, n in r["dbsize"] if at >= e.at and n]
        store_after = f"{min(store):.0f} s" if "Redis" in e.name and store else ""
        out.append(f"| {e.at:.0f} | {e.name} | {sum(x.completion is None for x in window)} | "
                   f"{', '.join(f'{k} {v}' for k, v in why.items()) or '0'} | "
                   f"{f'{min(ok):.0f} s' if ok else 'none'} | {f'{min(hit):.0f} s' if hit else 'none'} | "
                   f"{store_after} |")
    out += ["", "## Event log", "", "| at (s) | event | detail |", "|---:|---|---|"]
    out += [f"| {e.at:.1f} | {e.name} | {e.detail.replace('|', '/')[:300]} |" for e in events]
    other = Counter(reason for _, reason in refused)
    out += ["", f"Refusals over the whole run: {sum(other.values())} ({json.dumps(dict(other))})."]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of load (default 10)")
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads (default 4)")
    p.add_argument("--out", default="tq-jax-results/vllm_soak_cpu.md",
                   help="the markdown report (default under the current directory: committed results change only "
                        "when --out names them)")
    p.add_argument("--serde", default="{}", help="serde options as JSON, over the operator's minimal dict "
                   '{"type": "tq_jax", "head_dim": 64, "encrypt": {...}, "max_workers": 2}')
    p.add_argument("--workdir", help="logs, Redis's directory, the master key (default: a new temporary directory)")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF model directory, converted when missing")
    p.add_argument("--prefix-tokens", default="600,1100,1800", help="approximate tokens of each shared prefix")
    p.add_argument("--suffixes", type=int, default=3, help="copy-task suffixes per prefix")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per request")
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's context limit")
    p.add_argument("--l1-size-gb", type=float, default=1.0, help="each LMCache server's L1")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds a client waits for any read")
    p.add_argument("--transfer", choices=("shm", "pickle"), default="shm",
                   help="how KV moves between vLLM and LMCache: shared memory (docs/vllm.md) or pickled over ZMQ")
    args = p.parse_args(argv)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="tq-jax-vllm-soak-")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the ExitStack's stops on SIGTERM too
    log(f"work directory {args.workdir}")
    r = run(args)
    r.update(lead=args.max_tokens, max_tokens=args.max_tokens, clients=args.clients)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    command = "python -m benchmarks.vllm_soak " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(r, command, (commit or "?") + (" (working tree modified)" if dirty else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    log(f"report written to {args.out}; logs in {args.workdir}")


if __name__ == "__main__":
    main()
