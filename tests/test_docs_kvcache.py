"""docs/kvcache.md states the code's defaults and sizes: each number is read from the
page and compared with what ``tq_jax.kvcache`` gives, so the page cannot fall behind
the code unnoticed."""

from __future__ import annotations

import inspect
import os
import re

import pytest

from tq_jax import kvcache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def page() -> str:
    with open(os.path.join(ROOT, "docs", "kvcache.md"), encoding="utf-8") as f:
        return f.read()


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def test_usage_block_states_the_defaults(page):
    window, low_bits_window = map(int, re.search(
        r"window= \(default kvcache\.default_window: (\d+), or (\d+) when key or value bits <= 2\)", page).groups())
    assert (window, low_bits_window) == (kvcache.DEFAULT_WINDOW, kvcache.LOW_BITS_WINDOW)
    assert [kvcache.default_window(4, 4), kvcache.default_window(3, 2)] == [window, low_bits_window]
    assert int(re.search(r"sinks= \(default (\d+)\)", page).group(1)) == kvcache.DEFAULT_SINKS
    impl = re.search(r'impl= "(\w+)" \(default', page).group(1)
    assert impl == inspect.signature(kvcache.attend).parameters["impl"].default
    cache = kvcache.init(2, 4096, 8, 128, options="turbo-2.5")  # the block's preset example: "K3V2, window 256"
    assert "K3V2, window 256" in page and (cache.config.key_bits, cache.config.value_bits, cache.config.window) == (3, 2, 256)


def test_bytes_stated_are_the_leaves(page):
    bare = _int(re.search(r"\| 4 / 4 \| 0\.2578 \(([\d,]+) B\)", page).group(1))
    assert bare == kvcache.nbytes(kvcache.init(2, 4096, 8, 128, window=0, sinks=0))
    with_exact = _int(re.search(r"the batch-2 4/4 cache above is ([\d,]+) B", page).group(1))
    assert with_exact == kvcache.nbytes(kvcache.init(2, 4096, 8, 128))
    r8k, r32k = re.search(r"cache is (0\.\d+)x a bf16 cache's bytes at 8k tokens\s+of capacity and (0\.\d+)x at 32k",
                          page).groups()
    for ratio, tokens in ((r8k, 8192), (r32k, 32768)):
        got = kvcache.nbytes(kvcache.init(1, tokens, 8, 128)) / (2 * tokens * 8 * 128 * 2)
        assert float(ratio) == pytest.approx(got, abs=5e-5), (tokens, got)


def test_page_no_longer_says_what_the_code_stopped_doing(page):
    assert "`append` does not apply it" not in page  # append stores |x| / |c| with norm correction
    assert "sinks= (default 0)" not in page
    assert 'default "xla"' not in page and "stays the default everywhere" not in page


@pytest.mark.slow
def test_api_block_runs_as_written(page):
    import numpy as np

    # the page's first block is the API's; the engine-facing block runs in test_kvcache_ragged
    block = re.findall(r"```python\n(.*?)```", page, re.S)[0]
    ns: dict = {}
    exec(compile(block, "docs/kvcache.md", "exec"), ns)  # noqa: S102 - the page's own code
    assert ns["out"].shape == ns["q"].shape and np.isfinite(np.asarray(ns["out"])).all()
    assert np.asarray(ns["paged"].lengths).tolist() == [16, 16]
