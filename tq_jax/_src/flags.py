"""``argparse`` flags generated from an options dataclass (default :class:`tq_jax.Options`).

One flag per field (``key_bits`` is ``--key-bits``), built from
:func:`tq_jax._src.options.field_specs` — the same field descriptions any other front end
reads — so a new option is a new field, with no edit here. ``tq-jax compress`` uses
:func:`add_option_flags` and :func:`options_from_args`.
"""

from __future__ import annotations

from tq_jax._src import options as _options

__all__ = ["DEFAULT_BITS", "flag_kwargs", "add_option_flags", "option_flags", "options_from_args"]

DEFAULT_BITS = 4  # --bits when neither it nor a preset nor --key-bits/--value-bits says


def flag_kwargs(spec: _options.FieldSpec) -> dict:
    """argparse keywords of the flag of one field, from its :class:`~tq_jax._src.options.FieldSpec`.

    Every flag defaults to None (not given: the preset's or the field's default
    applies); a bool is ``store_true``; an int or str with a short list of allowed values
    gets them as ``choices`` (a field's ``off`` value included); the help is the
    field's help plus its default.
    """
    help_ = spec.help
    if not spec.required and spec.kind is not bool:
        help_ += f" (default: {spec.default})"
    if spec.kind is bool:
        return dict(action="store_true", default=None, help=help_)
    kw = dict(type=spec.kind, default=None, help=help_)
    choices = spec.choices()
    if choices is not None:
        kw["choices"] = choices
        if spec.kind is int:
            parts = (str(spec.off) if spec.off is not None else "", _options.describe_values(spec.values))
            kw["metavar"] = "{" + ",".join(filter(None, parts)) + "}"
    elif spec.kind is int:
        kw["metavar"] = "N"
    return kw


def add_option_flags(parser, v2_group, options_cls=None) -> None:
    """One flag per field of ``options_cls`` (default :class:`tq_jax.Options`): version-1
    fields on ``parser``, version-2 fields in ``v2_group``."""
    for spec in _options.field_specs(options_cls):
        where = parser if spec.version == 1 else v2_group
        where.add_argument("--" + spec.name.replace("_", "-"), dest=spec.name, **flag_kwargs(spec))


def option_flags(options_cls=None) -> tuple[str, ...]:
    """The option flags' ``args`` names: one per field of ``options_cls``."""
    return tuple(spec.name for spec in _options.field_specs(options_cls))


def options_from_args(args, options_cls=None, error=ValueError):
    """The options the flags in ``args`` ask for (validated).

    A ``args.preset`` (a name in :data:`tq_jax.PRESETS`) gives the starting values;
    ``args.bits`` sets every field without a default (both groups' bits;
    :data:`DEFAULT_BITS` when nothing sets them); any other flag given overrides.

    Raises:
        error: the options are invalid (the message names the field and the value).
    """
    cls = _options.Options if options_cls is None else options_cls
    specs = _options.field_specs(cls)
    opts = dict(_options.PRESETS[args.preset]) if args.preset else {}
    required = [s.name for s in specs if s.required]
    if args.bits is not None:
        opts.update(dict.fromkeys(required, args.bits))
    for s in specs:
        value = getattr(args, s.name)
        if value is not None:  # not given (booleans: store_true with default None)
            opts[s.name] = value
    for name in required:
        opts.setdefault(name, DEFAULT_BITS)
    try:
        return cls(**opts)
    except (TypeError, ValueError) as e:
        raise error(f"invalid codec options: {e}") from None

