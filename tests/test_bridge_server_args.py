"""What the launcher adds to an ``lmcache server`` command line on a host without CUDA."""

from __future__ import annotations

import json

from tq_jax.bridge._src import server_args as S


def _adapter(**serde) -> list[str]:
    return ["--l2-adapter", json.dumps({"type": "fs", "base_path": "/x", "serde": {"type": "tq_jax", **serde}})]


def test_transfer_mode_added_only_without_cuda_and_when_not_named():
    args, notes = S.server_defaults(["server", "--port", "6000"], has_cuda=False)
    assert args == ["server", "--port", "6000", "--supported-transfer-mode", "auto"]
    assert len(notes) == 1 and "engine-driven" in notes[0]
    assert S.server_defaults(["server", "--port", "6000"], has_cuda=True) == (["server", "--port", "6000"], [])
    for named in (["--supported-transfer-mode", "lmcache_driven"], ["--supported-transfer-mode=engine_driven"]):
        assert S.server_defaults(["server", *named], has_cuda=False) == (["server", *named], [])
    # not a server command, or a help request: untouched
    assert S.server_defaults(["bench"], has_cuda=False) == (["bench"], [])
    assert S.server_defaults(["server", "--help"], has_cuda=False) == (["server", "--help"], [])


def test_a_kv_aware_serde_set_to_fused_is_warned_about_on_a_cpu_host():
    """auto reads a CPU host's chunks as vllm-cpu by itself (the registry); an explicit
    fused is taken at its word there, and warned about when it reads keys apart."""
    for serde in ({"kv_layout": "fused"}, {"preset": "turbo-4", "kv_layout": "fused"},
                  {"key_bits": 4, "value_bits": 2, "kv_layout": "fused"}, {"bits": 4, "skip_first_layers": 2, "kv_layout": "fused"}):
        args = ["server", "--supported-transfer-mode", "auto", *_adapter(**serde)]
        _, notes = S.server_defaults(args, has_cuda=False)
        assert len(notes) == 1 and "vllm-cpu" in notes[0], serde
    for serde in ({}, {"preset": "turbo-4"}, {"bits": 4, "kv_layout": "fused"}, {"preset": "turbo-4", "kv_layout": "vllm-cpu"},
                  {"preset": "turbo-4", "key_bits": 4, "value_bits": 4, "kv_layout": "fused"}):
        args = ["server", "--supported-transfer-mode", "auto", *_adapter(**serde)]
        assert S.server_defaults(args, has_cuda=False)[1] == [], serde
    assert S.server_defaults(["server", *_adapter(preset="turbo-4", kv_layout="fused")], has_cuda=True)[1] == []


def test_unparsable_or_foreign_adapters_are_left_to_lmcache():
    args = ["server", "--supported-transfer-mode", "auto", "--l2-adapter", "{not json",
            "--l2-adapter", json.dumps({"type": "fs", "serde": {"type": "aesgcm"}})]
    assert S.server_defaults(args, has_cuda=False) == (args, [])
