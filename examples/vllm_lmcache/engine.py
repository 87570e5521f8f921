"""vLLM in a child process, driven one ``generate`` at a time.

vLLM's engine takes tens of seconds to start and holds its LMCache connection for its
life, so a run that stores, changes something on the server (clears L1, restarts it,
damages a stored value) and loads again keeps one engine and talks to it over a pipe:
:class:`Engine` sends a request line, the child (``python -m examples.vllm_lmcache.engine``)
answers with one result line; everything else vLLM prints goes to a log file.

Each request is greedy (temperature 0) and reports the generated text and token ids,
the prompt's token count and the wall time of the ``generate`` call; with
``max_tokens=1`` that time is the time to first token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MARK = "@@tq-jax-engine@@ "


class EngineError(RuntimeError):
    """The vLLM child failed (the message ends with its last log lines)."""


class Engine:
    """A vLLM ``LLM`` in a child process.

    Args:
        model: a Hugging Face model directory (:mod:`.convert`).
        log_path: where vLLM's own output goes.
        lmcache_port: the LMCache server's ``--port`` to connect to with vLLM's
            ``LMCacheMPConnector``; None runs plain vLLM.
        eager: ``enforce_eager`` (no torch.compile warm-up: starts ~60 s sooner on 2
            cores, decodes slower).
        max_model_len: vLLM's context limit.
        kv_cache_gib: host memory vLLM keeps for its own KV cache.
        python: the interpreter with vLLM installed (default: this one).
        **llm_kwargs: more ``vllm.LLM`` arguments (JSON values), e.g. ``block_size=64``.
    """

    def __init__(self, model: str | Path, log_path: str | Path, *, lmcache_port: int | None = None, eager: bool = True,
                 max_model_len: int = 8192, kv_cache_gib: float = 1.0, python: str | None = None, timeout: float = 600.0,
                 **llm_kwargs) -> None:
        self.config = dict(model=str(model), lmcache_port=lmcache_port, eager=eager, max_model_len=max_model_len,
                           kv_cache_gib=kv_cache_gib, llm_kwargs=llm_kwargs)
        self.log_path = Path(log_path)
        self.python = python or sys.executable
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.startup_s = None

    def start(self) -> "Engine":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        cwd = Path(__file__).resolve().parents[2]  # the repository root: `examples` importable
        self.proc = subprocess.Popen([self.python, "-m", "examples.vllm_lmcache.engine"], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     start_new_session=True)
        t = time.monotonic()
        self._call(self.config)
        self.startup_s = time.monotonic() - t
        return self

    def _call(self, request: dict) -> dict:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARK):
                answer = json.loads(line[len(MARK):])
                if "error" in answer:
                    raise EngineError(f"vLLM failed: {answer['error']}\n{self.tail()}")
                return answer
            self._log.write(line.encode())
            self._log.flush()
        raise EngineError(f"vLLM exited with status {self.proc.wait()}:\n{self.tail()}")

    def generate(self, prompts: list[str], max_tokens: int = 16, *, margins: bool = False) -> list[dict]:
        """Greedy generation: per prompt ``{"text", "token_ids", "prompt_tokens", "seconds"}``
        (``seconds``: the wall time of the whole ``generate`` call), and with ``margins``
        ``"margins"``: per generated token, its log-probability lead over the runner-up."""
        return self._call({"prompts": list(prompts), "max_tokens": int(max_tokens), "margins": bool(margins)})["outputs"]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()
        self.proc = None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------- the child


def _answer(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _output(o, seconds: float, margins: bool) -> dict:
    c = o.outputs[0]
    out = {"text": c.text, "token_ids": list(c.token_ids), "prompt_tokens": len(o.prompt_token_ids), "seconds": seconds}
    if margins:  # chosen token's logprob minus the best other one's
        out["margins"] = []
        for tok, lps in zip(c.token_ids, c.logprobs):
            others = [lp.logprob for t, lp in lps.items() if t != tok]
            out["margins"].append(lps[tok].logprob - max(others) if others else float("inf"))
    return out


def _build(cfg: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {}
    if cfg["lmcache_port"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": int(cfg["lmcache_port"]),
                                       "lmcache.mp.mq_timeout": 120},
        )
    return LLM(model=cfg["model"], dtype="bfloat16", max_model_len=cfg["max_model_len"], seed=0,
               enable_prefix_caching=False,  # every prefix comes from LMCache or is computed
               kv_cache_memory_bytes=int(cfg["kv_cache_gib"] * (1 << 30)), enforce_eager=cfg["eager"],
               **kwargs, **cfg.get("llm_kwargs", {}))


def _child() -> None:
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints go to the log; only answers go to the pipe
    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout = real_stdout
        try:
            if llm is None:
                sys.stdout = sys.stderr
                llm = _build(request)
                sys.stdout = real_stdout
                _answer({"ready": True})
                continue
            from vllm import SamplingParams

            sp = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], logprobs=2 if request["margins"] else None)
            sys.stdout = sys.stderr
            t = time.perf_counter()
            outs = llm.generate(request["prompts"], sp, use_tqdm=False)
            seconds = time.perf_counter() - t
            sys.stdout = real_stdout
            _answer({"outputs": [_output(o, seconds, request["margins"]) for o in outs]})
        except Exception as e:  # noqa: BLE001 (reported to the parent, which raises)
            sys.stdout = real_stdout
            _answer({"error": f"{type(e).__name__}: {e}"})
        sys.stdout = sys.stderr


if __name__ == "__main__":
    _child()
