"""One front door for the codec settings: every API turns the same preset into the same bytes.

``tq_jax.dumps``/``dump_into``/``serialized_size`` (through ``tq_jax.encode_options``),
``kvcache.init(options=...)``, ``tq-jax compress --preset`` and the LMCache serde's
``"preset"`` key each take a preset name. The reference for each door is the blob that
``dumps`` writes with the preset's fields spelled out (``**tq_jax.PRESETS[name]``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tq_jax
from conftest import sweep
from tq_jax._src import cli
from tq_jax import kvcache
from tq_jax._src import safetensors_io as st

D = 64
SHAPE = (2, 5, 16, 2, D)  # [K/V, layers, tokens, kv_heads, head_dim]


def _kv(shape=SHAPE, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, np.float32)


def _reference(x, name):
    return tq_jax.dumps(x, **tq_jax.PRESETS[name])


@pytest.mark.parametrize("name", sorted(tq_jax.PRESETS))
def test_every_form_of_a_preset_is_the_same_options(name):
    want = tq_jax.Options(**tq_jax.PRESETS[name])
    assert tq_jax.encode_options(name) == want
    assert tq_jax.encode_options(want) == want
    assert tq_jax.serialized_size(SHAPE, "float32", options=name) == want.serialized_size(SHAPE, "float32")


def test_dumps_forms_write_the_same_bytes():
    x = _kv()
    want = _reference(x, "turbo-4")
    assert tq_jax.dumps(x, options="turbo-4") == want
    assert tq_jax.dumps(x, options=tq_jax.Options(**tq_jax.PRESETS["turbo-4"])) == want
    buf = bytearray(tq_jax.serialized_size(x.shape, "float32", options="turbo-4"))
    assert tq_jax.dump_into(x, buf, options="turbo-4") == len(want) and bytes(buf) == want
    # Keywords override the preset, as the CLI's flags and the bridge's explicit keys do.
    assert tq_jax.dumps(x, options="turbo-4", seed=7) == tq_jax.dumps(x, **{**tq_jax.PRESETS["turbo-4"], "seed": 7})
    assert tq_jax.dumps(x, 3, options="turbo-4") == tq_jax.dumps(x, **{**tq_jax.PRESETS["turbo-4"],
                                                                       "key_bits": 3, "value_bits": 3})


@pytest.mark.parametrize("kwargs,match", [
    (dict(bitz=4), r"unknown option `bitz`\. Did you mean `bits`\?.*presets \(options='\.\.\.'\): compat-4bit,.*turbo-4"),
    (dict(keybits=4, value_bits=4), r"unknown option `keybits`\. Did you mean `key_bits`\?"),
    (dict(options="turbo4"), r"`options` names no preset: 'turbo4'\. Did you mean 'turbo-4'\? Presets: compat-4bit"),
    (dict(options={"bits": 4}), r"`options` must be None, a preset name or a tq_jax\.Options, got dict"),
    (dict(), r"give `bits` .* or a preset \(options='turbo-4'; presets: compat-4bit"),
])
def test_a_wrong_setting_is_named_with_the_closest_valid_name_and_the_presets(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tq_jax.dumps(_kv(), **kwargs)
    with pytest.raises(ValueError, match=match):
        tq_jax.serialized_size(SHAPE, "float32", **kwargs)


@pytest.mark.parametrize("call,match", [
    (lambda x: tq_jax.dumps(x, preset="turbo-4"), r"`preset=` is not a Python keyword: write options='turbo-4'"),
    (lambda x: tq_jax.encode_options(preset="turbo-3.5", seed=1), r"write options='turbo-3\.5'"),
    (lambda x: tq_jax.dumps(x, "turbo-4"), r"`bits` is a width .* tq_jax\.dumps\(x, options='turbo-4'\)"),
    (lambda x: tq_jax.serialized_size(x.shape, "float32", tq_jax.Options(4, 4)), r"options=tq_jax\.Options\(\.\.\.\)"),
    (lambda x: tq_jax.Options.make(4), r"Options\.make was removed.*tq_jax\.encode_options\(bits=4"),
])
def test_a_removed_spelling_raises_showing_the_one_way(call, match):
    with pytest.raises((ValueError, AttributeError), match=match):
        call(_kv())


@pytest.mark.parametrize("name", sweep(["turbo-4", "compat-4bit"]))
def test_cli_preset_writes_the_same_blob(tmp_path, name):
    x = _kv()
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    st.save_file({"kv": x}, src)
    assert cli.main(["compress", str(src), str(out), "--preset", name, "--head-dim", str(D), "-q"]) == 0
    assert bytes(st.load_file(out)[0]["kv"]) == _reference(x, name)


@pytest.mark.parametrize("name", sweep(["turbo-4", "turbo-2.5"]))
def test_kvcache_preset_is_the_same_settings_and_codes(name):
    """The cache takes the preset's codec settings, and the codes it writes at append are
    the index bytes ``dumps`` writes for the same K/V (loading that blob copies them in)."""
    x = _kv((2, 1, 16, 2, D), seed=1)
    cache = kvcache.init(1, 32, 2, D, options=name, dtype=np.float32, window=0, sinks=0)
    opts = tq_jax.encode_options(name)
    cfg = cache.config
    assert (cfg.key_bits, cfg.value_bits, cfg.rotation, cfg.seed, cfg.norm_correction) == (
        opts.key_bits, opts.value_bits, opts.rotation, opts.seed, opts.norm_correction)
    appended = kvcache.append(cache, x[0], x[1])
    loaded = kvcache.load(cache, _reference(x, name), seq=0)
    for leaf in ("k_codes", "v_codes"):
        np.testing.assert_array_equal(np.asarray(getattr(appended, leaf))[0, :16],
                                      np.asarray(getattr(loaded, leaf))[0, :16], err_msg=leaf)


@pytest.mark.parametrize("name", sweep(["turbo-4", "compat-4bit"]))
def test_bridge_preset_writes_the_same_blob(name):
    torch = pytest.importorskip("torch")
    pytest.importorskip("lmcache")
    from bridge_util import byte_obj, key, layout, make_obj

    from tq_jax.bridge._src import registry
    from tq_jax.bridge._src import serde as S

    shape = (2, SHAPE[1], SHAPE[2], SHAPE[3] * D)  # LMCache's [2, L, T, H*D] chunk
    x = _kv()
    src = make_obj([shape], [torch.float32])
    src.tensor.copy_(torch.from_numpy(x.reshape(shape)))
    ser, _ = registry.build_serde(registry.parse_options({"preset": name, "head_dim": D}))
    dst = byte_obj(ser.estimate_serialized_size(layout([shape], [torch.float32])))
    n = ser.serialize(src, dst, key(0))
    value = bytes(dst.tensor.numpy()[:n])
    want = _reference(x, name)
    assert value[:len(want)] == want
    assert len(value) - len(want) == (S.KEY_TRAILER_BYTES if tq_jax.encode_options(name).checksum else 0)
    assert dataclasses.asdict(ser.options) | {"norm_dtype": None} == (
        dataclasses.asdict(tq_jax.encode_options(name)) | {"norm_dtype": None})  # the serde pins float16 norms
