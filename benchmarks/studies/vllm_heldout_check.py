"""Does a real vLLM load from L2 through the serde on settings the tests never use?

Question: tests/test_vllm_lmcache.py checks its own prompts, an fs L2, vLLM's default
block of 128 and eager mode. Does the same hold for other prompts, another block size
(``kv_layout "vllm-cpu"`` with ``block_size`` 64), torch.compile, a Redis L2 and
``turbo-4`` under another seed?

Answer: yes. After L1 is cleared, each prompt's prefix loads from Redis through the
serde and vLLM continues exactly as plain vLLM for 24/24, 24/24 and 23/24 greedy tokens;
the third prompt's 24th token differs in the connector's computed run as well (a
near-tie of plain vLLM's own). Written in benchmarks/results/vllm_lmcache_heldout_cpu.md.

    python -m benchmarks.studies.vllm_heldout_check MODEL_DIR     # the vllm extra's environment, redis-server on PATH
"""
import subprocess
import sys
import time

from examples.vllm_lmcache.server import LMCacheServer, resp_adapter, free_port
from examples.vllm_lmcache.engine import Engine
from examples.vllm_lmcache.prompts import PASSAGES, copy_prompt
from examples.vllm_lmcache.__main__ import leading_agreement


def main() -> None:
    MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    # held-out prompts: passages 5, 4 in reverse pairing, a longer repeat fraction, and a plain question
    prompts = [copy_prompt(PASSAGES[5] + "\n\n" + PASSAGES[3], 0.3)[0], copy_prompt(PASSAGES[4] + "\n\n" + PASSAGES[0], 0.6)[0],
               "Here are three recipes.\n\n" + PASSAGES[1] + "\n\n" + PASSAGES[1].replace("bread", "rolls") + "\n\nThe first step of the first recipe is to"]
    rport = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    time.sleep(1)
    serde = {"head_dim": 64, "kv_layout": "vllm-cpu", "block_size": 64, "preset": "turbo-4", "seed": 7, "max_workers": 2}
    kw = dict(block_size=64, eager=False, max_model_len=2048)
    try:
        with Engine(MODEL, "heldout-plain.log", **kw) as e:
            plain = e.generate(prompts, 24, margins=True)
        with LMCacheServer(resp_adapter("127.0.0.1", rport, serde), "heldout-server.log") as s:
            with Engine(MODEL, "heldout-vllm.log", lmcache_port=s.port, **kw) as e:
                run1 = e.generate(prompts, 24)
                time.sleep(5)
                s.clear_l1(); time.sleep(1)
                run2 = e.generate(prompts, 24)
            hits = [l for l in s.lines() if "retained keys" in l]
    finally:
        redis.terminate()
    for p, a, b in zip(plain, run1, run2):
        ties = [i for i, m in enumerate(p["margins"]) if m < 2.0]
        print(f"prompt {p['prompt_tokens']} tokens: run1 {leading_agreement(a['token_ids'], p['token_ids'])}/24, "
              f"L2 run {leading_agreement(b['token_ids'], p['token_ids'])}/24, first plain near-tie at {ties[:1]}")
        print("   plain:", repr(p["text"][:90]), "\n   L2   :", repr(b["text"][:90]))
    for l in hits: print("  ", l.split("INFO:")[-1][:130])


if __name__ == "__main__":
    main()
