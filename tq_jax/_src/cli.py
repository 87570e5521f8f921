"""The ``tq-jax`` command: compress, decompress, inspect and bench.

Usage::

    tq-jax bench [--quick] [--bits 2,3,4,8] [--presets turbo-4,...] [--out-dir DIR] [-v]
    tq-jax compress IN [IN ...] OUT [--bits 4] [--seed 42] [--head-dim 128] [--all] ...
    tq-jax decompress IN [IN ...] OUT
    tq-jax inspect FILE [--json] [-v]

Errors a person can fix (missing or corrupt file, wrong dtype, head_dim that does not
divide, ...) end with one line on stderr and exit status 1; usage errors exit 2.
Ctrl-C (SIGINT) or SIGTERM ends a command at once with one line on stderr and exit
status 130 or 143, leaving no partial output (:class:`tq_jax._src.interrupts.Interrupts`).
This module parses arguments, dispatches and prints; ``inspect``'s engine is
:mod:`tq_jax._src.batch.inspect`, the codec flags come from :mod:`tq_jax._src.flags`.
See docs/cli.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import shutil
import sys
import time

from tq_jax._src.interrupts import Interrupts



class _OnFirstUse:
    """A module imported when an attribute is first read from it.

    The command's own modules pull in numpy, ml_dtypes and jax (seconds), so they load
    only once :func:`main` has installed its signal handlers.
    """

    def __init__(self, name: str):
        self._module_name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._module_name), attr)


_batch = _OnFirstUse("tq_jax._src.batch")
_bench = _OnFirstUse("tq_jax._src.bench")
_inspect = _OnFirstUse("tq_jax._src.batch.inspect")
_flags = _OnFirstUse("tq_jax._src.flags")
_st = _OnFirstUse("tq_jax._src.safetensors_io")
_codebook = _OnFirstUse("tq_jax._src.codebook")
_options = _OnFirstUse("tq_jax._src.options")
_wire = _OnFirstUse("tq_jax._src.wire")
__all__ = ["main", "build_parser", "CliError", "options_from_args"]

PROG = "tq-jax"


class CliError(Exception):
    """A flag or usage error a person can fix: :func:`main` prints it on one line and exits 1."""


def _error(msg: str) -> int:
    print(f"{PROG}: error: {' '.join(str(msg).split())}", file=sys.stderr)
    return 1


# --------------------------------------------------------------------------- logging


@contextlib.contextmanager
def quiet_third_party_logs(verbose: bool = False):
    """Hide INFO and DEBUG log records (LMCache, JAX, absl, ...) inside the block, unless ``verbose``.

    Warnings and errors still show. :func:`logging.disable` holds whatever handlers and
    levels a package sets on its own loggers — LMCache gives each logger its own
    coloured stderr handler at INFO, stops propagation, and creates more loggers as
    its modules import — so no logger has to be found first. tq-jax itself prints; it
    does not log. The previous setting is restored on leaving.
    """
    if verbose:
        yield
        return
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(previous)


# --------------------------------------------------------------------------- helpers


def _devices(spec: str):
    import jax

    devs = jax.local_devices()
    if spec == "all":
        return devs
    try:
        n = int(spec)
    except ValueError:
        raise CliError(f"--devices must be 'all' or a count, got {spec!r}") from None
    if not 1 <= n <= len(devs):
        raise CliError(f"--devices {n}: this process has {len(devs)} local device(s)")
    return devs[:n]


def _outputs(inputs: list[str], out: str, mode: str) -> list[str]:
    """OUT for one input, or OUT/<name> for each of several inputs (OUT a directory)."""
    if len(inputs) == 1 and not os.path.isdir(out) and not out.endswith(os.sep):
        outs = [out]
    else:
        if os.path.exists(out) and not os.path.isdir(out):
            raise CliError(f"{out}: with several inputs, OUT must be a directory")
        os.makedirs(out, exist_ok=True)
        outs = []
        for p in inputs:
            base = os.path.basename(p)
            if mode == "compress":
                base = os.path.splitext(base)[0] + ".safetensors"
            outs.append(os.path.join(out, base))
        dup = {o for o in outs if outs.count(o) > 1}
        if dup:
            raise CliError(f"several inputs would write the same output {sorted(dup)[0]}")
    for i, o in zip(inputs, outs):
        if os.path.exists(o) and os.path.exists(i) and os.path.samefile(i, o):
            raise CliError(f"{o}: output would overwrite its input; choose another OUT")
        parent = os.path.dirname(os.path.abspath(o))
        if not os.path.isdir(parent):
            raise CliError(f"{o}: directory {parent} does not exist")
    return outs


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _grouped(pairs) -> list[tuple[str, list[str]]]:
    """(name, why) pairs as (why, [names]) in first-seen order."""
    out: dict[str, list[str]] = {}
    for name, why in pairs:
        out.setdefault(why, []).append(name)
    return list(out.items())


def _names(names: list[str], most: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _run(args, plan_fn, verb: str) -> int:
    """Shared driver of compress/decompress: plan every file, run locally or distributed."""
    from tq_jax._src import distributed as _dist

    cluster = _dist.initialize(args.coordinator, args.num_processes, args.process_id, args.distributed,
                               args.barrier_timeout)
    devices = _devices(args.devices)
    sources: list = []

    def open_plans():
        outs = _outputs(args.inputs, args.output, verb)
        plans = []
        for inp, out in zip(args.inputs, outs):
            src = _batch.open_source(inp)
            sources.append(src)
            plans.append(plan_fn(src, out))
        return plans, sources

    try:
        t0 = time.perf_counter()
        if cluster is None:
            plans, _ = open_plans()
            for src, plan in zip(sources, plans):
                prog = _batch.Progress(plan.in_nbytes, f"{verb} {os.path.basename(src.path)}", args.quiet)
                try:
                    _batch.run_local(plan, src, devices, prog.update)
                finally:
                    prog.close()
        else:
            out0 = os.path.abspath(args.output.rstrip(os.sep) or args.output)
            parts = args.parts_dir or os.path.join(os.path.dirname(out0), f".{os.path.basename(out0)}.tq-parts")
            if cluster.index == 0:  # what its `finally` would do, had a signal not ended the process
                Interrupts.at_exit(lambda: shutil.rmtree(parts, ignore_errors=True))
            tag = f"[{cluster.index}/{cluster.count}] {verb}"
            plans, _ = _dist.run_distributed(
                cluster, open_plans, devices, parts,
                lambda total: _batch.Progress(total, tag, args.quiet),
                plain_errors=(CliError,),
            )
        dt = time.perf_counter() - t0
    finally:
        for s in sources:
            s.close()
    if not args.quiet and (cluster is None or cluster.index == 0):
        for plan in plans:
            n_tq = len(plan.tq["tensors"])
            n_raw = len(plan.entries) - n_tq
            a, b = os.path.getsize(plan.src), os.path.getsize(plan.out)
            ratio = f" ({a / b:.2f}x)" if verb == "compress" and b else ""
            print(f"{verb}ed {plan.src} -> {plan.out}: {n_tq} TQ01 tensor(s), {n_raw} passed through; "
                  f"{_mb(a)} -> {_mb(b)}{ratio}")
            for why, names in _grouped(plan.passed):
                print(f"  passed through unchanged ({why}): {_names(names)}")
            if verb == "compress" and n_tq == 0:
                print(f"{PROG}: note: no tensor of {plan.src} was compressed: only floating tensors whose last "
                      f"axis is --head-dim ({args.head_dim}) are, unless --all is given.", file=sys.stderr)
        total = sum(p.in_nbytes for p in plans)
        print(f"{len(plans)} file(s) in {dt:.2f} s ({total / 1e6 / max(dt, 1e-9):,.1f} MB/s)"
              + (f" on {cluster.count} processes" if cluster else f" on {len(devices)} device(s)"))
    return 0


# --------------------------------------------------------------------------- commands


def options_from_args(args, options_cls=None):
    """The :class:`tq_jax.Options` the compress flags ask for (:func:`tq_jax._src.flags.options_from_args`).

    Raises:
        CliError: the options are invalid (the message names the field and the value).
    """
    return _flags.options_from_args(args, options_cls, CliError)


def cmd_compress(args) -> int:
    if args.head_dim < 2:
        raise CliError(f"--head-dim must be at least 2, got {args.head_dim}")
    opts = _batch.CompressOptions(
        options=options_from_args(args), head_dim=args.head_dim, all=args.all,
        exclude=tuple(args.exclude), chunk_bytes=_chunk_bytes(args.chunk_mb),
    )
    # Named in the error when the preset's raw layers would cover a whole tensor.
    preset = args.preset if args.skip_first_layers is None and args.skip_last_layers is None else None
    return _run(args, lambda src, out: _batch.plan_compress(src, out, opts, preset=preset), "compress")


def cmd_decompress(args) -> int:
    cb = _chunk_bytes(args.chunk_mb)
    return _run(args, lambda src, out: _batch.plan_decompress(src, out, cb), "decompress")


def _chunk_bytes(mb: float) -> int:
    if not mb > 0:
        raise CliError(f"--chunk-mb must be positive, got {mb}")
    return max(1, int(mb * 2**20))


def cmd_inspect(args) -> int:
    doc = _inspect.describe(args.file)
    print(json.dumps(doc, indent=2, default=list) if args.json else _inspect.render(doc, args.verbose))
    return 0


def cmd_bench(args) -> int:
    bits = []
    for b in args.bits.split(","):
        try:
            b = int(b)
        except ValueError:
            b = None
        if b not in _codebook.BITS_RANGE:
            raise CliError(f"--bits takes a comma-separated list of {tuple(_codebook.BITS_RANGE)}, got {args.bits!r}")
        bits.append(b)
    presets = tuple(p for p in args.presets.split(",") if p)
    for p in presets:
        if p not in _options.PRESETS:
            raise CliError(f"--presets takes a comma-separated list of {', '.join(_options.PRESETS)} (or ''), "
                           f"got {args.presets!r}")
    if args.repeats < 1:
        raise CliError(f"--repeats must be at least 1, got {args.repeats}")
    with quiet_third_party_logs(args.verbose):  # LMCache (under the reference) logs INFO lines
        _bench.run_bench(quick=args.quick, bits=tuple(bits), presets=presets, repeats=args.repeats, seed=args.seed,
                         reference=not args.no_reference, plots=not args.no_plots, out_dir=args.out_dir,
                         devices=_devices(args.devices))
    return 0


# --------------------------------------------------------------------------- parser


_CHUNK_HELP = {
    "compress": "largest piece of a tensor encoded at once, in MiB (default: 64); bounds memory; "
                "compress writes one blob per piece",
    "decompress": "largest piece of an uncompressed tensor copied at once, in MiB (default: 64); "
                  "compressed tensors are decoded blob by blob, in the pieces compress chose",
}


def _add_run_options(p, verb: str):
    p.add_argument("inputs", nargs="+", metavar="IN", help="input file(s)")
    p.add_argument("output", metavar="OUT", help="output file, or a directory when there are several inputs")
    p.add_argument("--chunk-mb", type=float, default=_batch.DEFAULT_CHUNK_BYTES / 2**20, help=_CHUNK_HELP[verb])
    p.add_argument("--devices", default="all", help="local JAX devices to use: 'all' (default) or a count")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    g = p.add_argument_group("several hosts (jax.distributed; see docs/cli.md)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordination service")
    g.add_argument("--num-processes", type=int, help="number of processes in the job")
    g.add_argument("--process-id", type=int, help="this process's index, 0..N-1")
    g.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() with cluster auto-detection (TPU pods, SLURM, ...)")
    g.add_argument("--parts-dir", help="shared directory for the processes' parts (default: next to OUT)")
    g.add_argument("--barrier-timeout", type=float, default=6 * 3600.0, metavar="SECONDS",
                   help="how long a process waits for the others at each step (default: 6 h)")


def _version() -> str:
    """The installed distribution's version (the package's own when not installed)."""
    from importlib import metadata

    try:
        return metadata.version("tq-jax")
    except metadata.PackageNotFoundError:
        import tq_jax

        return tq_jax.__version__


def build_parser(options_cls=None) -> argparse.ArgumentParser:
    """The ``tq-jax`` argument parser; ``compress``'s codec flags come from ``options_cls``
    (default :class:`tq_jax.Options`), one per field."""
    import tq_jax

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="TurboQuant KV-cache compression (TQ01) in JAX: compress tensor files, inspect them, benchmark.",
        epilog="Start with `tq-jax bench`. Documentation: docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compress", help="compress the KV tensors of .safetensors/.npy/.npz files into TQ01",
                       description="Every floating tensor whose last axis is --head-dim becomes TQ01 blob(s) "
                                   "stored as a U8 tensor under the same name; other tensors pass through.")
    _add_run_options(p, "compress")
    p.add_argument("--bits", type=int, choices=_codebook.BITS_RANGE,
                   metavar="{" + _options.describe_values(_codebook.BITS_RANGE) + "}",
                   help=f"bits per coordinate of every group (default: {_flags.DEFAULT_BITS}); "
                        f"{', '.join(map(str, _wire.READ_BITS_V1[:-1]))} and {_wire.READ_BITS_V1[-1]} "
                        "keep TQ01 version 1, the reference's format, unless another option needs version 2")
    g = p.add_argument_group("TQ01 version 2 options (blobs the reference cannot read)")
    g.add_argument("--preset", choices=sorted(tq_jax.PRESETS), help="a named set of options (later flags override)")
    _flags.add_option_flags(p, g, options_cls)
    p.add_argument("--head-dim", type=int, default=128, help="vector length (default: 128)")
    p.add_argument("--all", action="store_true",
                   help="compress every floating tensor, splitting a last axis of n*head_dim into (n, head_dim); "
                        "those TQ01 cannot encode (other dtypes, other last axes) pass through, listed in the summary")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="keep tensors whose name matches this glob uncompressed (repeatable)")
    p.set_defaults(func=cmd_compress)

    p = sub.add_parser("decompress", help="restore the tensors of files written by compress",
                       description="Inverse of compress: same names, shapes and dtypes. OUT ending in .npy/.npz "
                                   "writes that format; anything else writes safetensors.")
    _add_run_options(p, "decompress")
    p.set_defaults(func=cmd_decompress)

    p = sub.add_parser("inspect", help="list a file's tensors, TQ01 header fields, sizes and ratios (no decoding)")
    p.add_argument("file", metavar="FILE", help=".safetensors (compressed or not), .npy, .npz, or a bare TQ01 blob")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per blob")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("bench", help="tq-jax vs the reference vs fp8 vs memcpy on a built-in KV workload",
                       description="Side-by-side table and PNG charts on a W1-shaped synthetic KV cache "
                                   "[2, 32, 256, 8, 128] bf16 (no download).")
    p.add_argument("--quick", action="store_true", help="a small workload [2, 4, 64, 8, 128] (seconds)")
    p.add_argument("--bits", default="2,3,4,8", help="tq-jax bit widths, comma-separated (default: 2,3,4,8)")
    p.add_argument("--presets", default=",".join(_bench.PRESET_ROWS),
                   help=f"tq-jax presets, comma-separated, '' for none (default: {','.join(_bench.PRESET_ROWS)})")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each encode and decode after a warm-up (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--out-dir", default="tq-jax-bench", help="where to write bench.md/json and PNGs")
    p.add_argument("--no-reference", action="store_true", help="skip the reference plugin even if installed")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    p.add_argument("--devices", default="all", help="local JAX devices to use: 'all' (default) or a count")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show other packages' INFO log lines (LMCache, JAX, ...)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``tq-jax`` console script; returns the exit status."""
    with Interrupts(PROG):  # first: a signal from here on ends the process cleanly
        return _main(argv)


def _main(argv) -> int:
    import tq_jax  # (numpy, jax: seconds)

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, _batch.BatchError) as e:
        return _error(str(e))
    except (_st.SafetensorsError, tq_jax.WireError, tq_jax.NormOverflowError) as e:
        return _error(str(e))
    except MemoryError:
        return _error("out of memory: lower --chunk-mb")
    except BrokenPipeError:  # e.g. `tq-jax inspect F | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return _error(f"{where}{e.strerror or e}")
    except KeyboardInterrupt:  # only where signals could not be handled (not the main thread)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
