"""One option schema: tq_jax.Options' fields generate the bridge's option table and the CLI flags.

A new field of Options (with its metadata) must appear in the LMCache serde options,
in SerdeOptions, in TQJaxSerializer's keyword arguments and as a ``tq-jax compress``
flag without any other edit; these tests build such a field and check that it does.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import tq_jax
from tq_jax._src import cli, codebook, flags, rotation, wire
from tq_jax._src import options as options_mod

FIELDS = {f.name: f for f in dataclasses.fields(tq_jax.Options)}
# compress flags that are not Options fields: files, runtime, the bits shorthand, presets.
NON_CODEC_FLAGS = {
    "help", "inputs", "output", "chunk_mb", "devices", "quiet", "coordinator", "num_processes", "process_id",
    "distributed", "parts_dir", "barrier_timeout", "bits", "preset", "head_dim", "all", "exclude",
}


def _compress_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["compress"]


def _variant():
    """Options plus a hypothetical boolean v2 option ``foo`` (a header flag, say)."""
    return dataclasses.make_dataclass(
        "OptionsWithFoo",
        [("foo", bool, dataclasses.field(default=False, metadata=options_mod.field_metadata("turn foo on", 2)))],
        bases=(tq_jax.Options,),
        frozen=True,
    )


# ----------------------------------------------------------------------------- metadata


def test_every_field_describes_itself():
    for f in FIELDS.values():
        m = f.metadata
        assert isinstance(m["help"], str) and m["help"].strip(), f.name
        assert "\n" not in m["help"], f.name  # one line
        assert m["version"] in wire.VERSIONS, f.name
        assert m["values"] is None or isinstance(m["values"], (range, tuple)), f.name
        assert options_mod.field_type(f) in (int, bool, str), f.name


def test_constants_come_from_the_lower_layers():
    assert FIELDS["key_bits"].metadata["values"] == FIELDS["value_bits"].metadata["values"] == codebook.BITS_RANGE

    assert FIELDS["rotation"].metadata["values"] is rotation.ROTATIONS
    assert FIELDS["norm_dtype"].metadata["values"] == ("auto", *wire.NORM_DTYPES)
    assert FIELDS["norm_bits"].metadata["values"] == wire.NORM_BITS
    assert FIELDS["skip_first_layers"].metadata["values"] == range(0, wire.MAX_SKIP_LAYERS + 1)


@pytest.mark.parametrize(
    "name,bad",
    [("key_bits", 0), ("key_bits", 9), ("value_bits", 9), ("skip_first_layers", -1),
     ("skip_last_layers", wire.MAX_SKIP_LAYERS + 1), ("norm_bits", 1), ("norm_bits", 9),
     ("rotation", "dct"), ("norm_dtype", "bfloat16")],
)
def test_errors_name_the_field_the_value_and_the_allowed_values(name, bad):
    kwargs = {"key_bits": 4, "value_bits": 4, name: bad}
    with pytest.raises(ValueError) as e:
        tq_jax.Options(**kwargs)
    msg = str(e.value)
    assert msg.startswith(f"`{name}` must be ")
    assert f"got {bad!r}" in msg
    assert options_mod.describe_values(FIELDS[name].metadata["values"]) in msg


@pytest.mark.parametrize("name", ["key_bits", "seed", "norm_correction", "checksum", "norm_bits"])
def test_wrong_types_are_refused(name):
    bad = "4" if name != "norm_correction" and name != "checksum" else 1
    with pytest.raises(ValueError, match=f"^`{name}` must be an? "):
        tq_jax.Options(**{"key_bits": 4, "value_bits": 4, name: bad})


def test_validation_canonicalises_numpy_scalars():
    np = pytest.importorskip("numpy")
    o = tq_jax.Options(np.int64(4), np.int32(3), seed=np.int64(7), checksum=np.bool_(True))
    assert (type(o.key_bits), type(o.value_bits), type(o.seed), type(o.checksum)) == (int, int, int, bool)
    assert o == tq_jax.Options(4, 3, seed=7, checksum=True)


def test_describe_values():
    assert options_mod.describe_values(range(1, 9)) == "1..8"
    assert options_mod.describe_values(("haar", "hadamard")) == "('haar', 'hadamard')"


# ----------------------------------------------------------------------------- CLI


def test_every_field_has_a_cli_flag_and_vice_versa():
    p = _compress_parser(cli.build_parser())
    dests = {a.dest for a in p._actions}
    assert dests - NON_CODEC_FLAGS == set(FIELDS)
    given = {s for a in p._actions for s in a.option_strings}
    for name in FIELDS:
        assert "--" + name.replace("_", "-") in given, name
    assert set(flags.option_flags()) == set(FIELDS)


def test_cli_flags_follow_the_metadata():
    p = _compress_parser(cli.build_parser())
    by_dest = {a.dest: a for a in p._actions}
    for name, f in FIELDS.items():
        a = by_dest[name]
        assert a.default is None, name  # not given: the preset's or the field's default
        assert f.metadata["help"] in a.help, name
        if options_mod.field_type(f) is bool:
            assert isinstance(a, argparse._StoreTrueAction), name
    assert list(by_dest["rotation"].choices) == list(rotation.ROTATIONS)
    assert list(by_dest["norm_bits"].choices) == [0, *wire.NORM_BITS]
    assert list(by_dest["key_bits"].choices) == list(codebook.BITS_RANGE)


def test_cli_options_from_flags():
    parser = cli.build_parser()
    args = parser.parse_args(["compress", "a", "b", "--bits", "3", "--checksum", "--norm-bits", "6",
                              "--rotation", "hadamard", "--seed", "7"])
    assert cli.options_from_args(args) == tq_jax.Options(3, 3, seed=7, rotation="hadamard", checksum=True,
                                                          norm_bits=6)
    args = parser.parse_args(["compress", "a", "b", "--preset", "turbo-3.5", "--value-bits", "2"])
    assert cli.options_from_args(args) == tq_jax.Options(**{**tq_jax.PRESETS["turbo-3.5"], "value_bits": 2})
    assert cli.options_from_args(parser.parse_args(["compress", "a", "b"])) == tq_jax.Options(4, 4)
    args = parser.parse_args(["compress", "a", "b", "--norm-bits", "4", "--norm-dtype", "float32"])
    with pytest.raises(cli.CliError, match="invalid codec options: `norm_bits` and norm_dtype='float32'"):
        cli.options_from_args(args)


def test_a_new_boolean_option_reaches_the_cli_with_no_other_edit():
    variant = _variant()
    parser = cli.build_parser(variant)
    args = parser.parse_args(["compress", "a", "b", "--foo", "--bits", "3"])
    assert args.foo is True
    o = cli.options_from_args(args, variant)
    assert isinstance(o, variant) and o.foo is True and o.key_bits == 3
    assert cli.options_from_args(parser.parse_args(["compress", "a", "b"]), variant).foo is False
    p = _compress_parser(parser)
    (foo,) = [a for a in p._actions if a.dest == "foo"]
    assert foo.option_strings == ["--foo"] and foo.help == "turn foo on"
    assert "foo" in flags.option_flags(variant)
    with pytest.raises(ValueError, match=r"^`foo` must be a bool, got 1\."):  # validated like the others
        variant(4, 4, foo=1)


# ----------------------------------------------------------------------------- bridge


@pytest.fixture(scope="module")
def registry():
    pytest.importorskip("torch")
    pytest.importorskip("lmcache")
    from tq_jax.bridge._src import registry

    return registry


def test_bridge_table_is_the_fields_plus_the_bridge_only_rows(registry):
    names = [o.name for o in registry.OPTIONS]
    assert set(names) == set(FIELDS) | set(registry.BRIDGE_ONLY)
    assert not set(FIELDS) & set(registry.BRIDGE_ONLY)
    assert set(registry.BRIDGE_ONLY) == {"head_dim", "bits", "max_workers", "device", "use_qjl", "qjl_sketch_size", "kv_layout", "block_size",
                                         "preset", "format", "encrypt", "warmup"}
    assert [f.name for f in dataclasses.fields(registry.SerdeOptions)] == names
    rows = {o.name: o for o in registry.OPTIONS}
    for name, f in FIELDS.items():
        assert rows[name].version == f.metadata["version"], name
        if name == "norm_dtype":  # the bridge's sizes follow from the layout: no "auto"
            assert rows[name].default == "float16"
        elif name == "checksum":  # on unless format v1 (parse_options resolves it)
            assert rows[name].default is None and registry.parse_options({}).checksum
        elif f.default is dataclasses.MISSING:
            assert rows[name].default is None  # filled from `bits`
        else:
            assert rows[name].default == f.default, name
    assert set(registry.SerdeOptions._CODEC_NAMES) == set(FIELDS) - {"seed"}


def test_bridge_errors_follow_the_field_metadata(registry):
    with pytest.raises(ValueError, match=r"serde option `key_bits` must be in 1\.\.8, got 9: it sets the codebook"):
        registry.parse_options({"key_bits": 9})
    with pytest.raises(ValueError, match=r"serde option `norm_bits` must be in 2\.\.8, got 1: 0 keeps float norms"):
        registry.parse_options({"norm_bits": 1})
    with pytest.raises(TypeError, match=r"serde option `checksum` must be a bool, got int 1"):
        registry.parse_options({"checksum": 1})
    assert registry.parse_options({"norm_bits": 0}).norm_bits == 0


def test_serializer_keywords_follow_the_table(registry):
    from tq_jax.bridge._src import serde

    ser = serde.TQJaxSerializer(bits=3, norm_bits=6, rotation="hadamard", checksum=True)
    assert ser.options == tq_jax.Options(3, 3, rotation="hadamard", norm_dtype="float16", checksum=True, norm_bits=6)
    assert serde.TQJaxSerializer().options == tq_jax.Options(4, 4, norm_dtype="float16")
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) 'bitz'.*norm_bits"):
        serde.TQJaxSerializer(bitz=3)
    with pytest.raises(TypeError, match=r"serde option `checksum` must be a bool"):
        serde.TQJaxSerializer(checksum="yes")


def test_a_new_boolean_option_reaches_the_bridge_with_no_other_edit(registry):
    variant = _variant()
    table = registry.option_table(variant)
    rows = {o.name: o for o in table}
    assert rows["foo"] == rows["foo"]._replace(default=False, help="turn foo on", version=2)
    assert rows["foo"].check("foo", True) is True
    with pytest.raises(TypeError, match="serde option `foo` must be a bool"):
        rows["foo"].check("foo", 1)
    cls = registry.serde_options_class(table, variant)
    o = cls(**registry.check_values({"foo": True, "bits": 3}, table))
    assert o.foo is True and o.codec_options()["foo"] is True
    assert variant(o.bits, o.bits, seed=o.seed, **o.codec_options()).foo is True
    with pytest.raises(ValueError, match="TQ01 version 2 options: .*foo"):  # listed with the v2 options
        registry.check_values({"fooo": True}, table)


def test_codec_config_is_derived_from_the_options():
    """One schema: a group's CodecConfig carries that group's bits and the shared codec fields."""
    o = tq_jax.Options(4, 3, seed=9, rotation="hadamard", norm_correction=True)
    assert o.codec_config(64, 0) == tq_jax.CodecConfig(64, 4, 9, "hadamard", True)
    assert o.codec_config(64, 1) == tq_jax.CodecConfig(64, 3, 9, "hadamard", True)
    assert tq_jax.Options(2, 2).codec_config(16) == tq_jax.CodecConfig(16, 2)
    with pytest.raises(ValueError, match="`group` must be 0 .* got 2"):
        o.codec_config(64, 2)
    with pytest.raises(ValueError, match="`dim` must be an int >= 2"):
        o.codec_config(1, 0)
