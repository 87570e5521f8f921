"""Registers the tq_jax serde, then runs LMCache's own command line in this process.

LMCache 0.5.6 looks serde types up when the ``StorageManager`` is built and has no
plugin discovery for them, so the type must be registered in the process that builds
it, before it is built. ``lmcache server`` builds it in-process (uvicorn's lifespan), so
wrapping LMCache's CLI is enough::

    python -m tq_jax.bridge.launch server --l1-size-gb 2 --eviction-policy LRU \\
        --l2-adapter '{"type": "fs", "base_path": "/cache",
                       "serde": {"type": "tq_jax", "head_dim": 128}}'

Every argument is LMCache's. On a host without CUDA the launcher adds
``--supported-transfer-mode auto`` when no mode is named, and warns about a K/V-aware
serde left on ``kv_layout "auto"`` (:mod:`~tq_jax.bridge._src.server_args` says why); it
changes nothing else. To run another LMCache entry
module instead of the ``lmcache`` CLI, put ``-m MODULE`` first; the module runs as
``__main__`` with the remaining arguments, as ``python -m MODULE`` would::

    python -m tq_jax.bridge.launch -m lmcache.v1.multiprocess.server --l1-size-gb 2 ...

The launcher's own options come before all of those: ``-h``/``--help`` prints its usage
without loading torch or LMCache; ``-v``/``--verbose`` keeps the INFO lines and warnings
LMCache prints while it is imported (hidden by default, see :mod:`tq_jax.bridge._src.logs`).
When LMCache builds the serde, the bridge logs one INFO line saying so.

A process that LMCache (or anything else) *spawns* does not inherit the registration;
for those, use the config-only loader in :mod:`tq_jax.bridge.plugin`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import runpy
import sys
from collections.abc import Sequence

from tq_jax.bridge._src import logs, server_args
from tq_jax.bridge._src.extra import missing_extra

__all__ = ["main"]

USAGE = """\
usage: python -m tq_jax.bridge.launch [-v] <lmcache CLI arguments>
       python -m tq_jax.bridge.launch [-v] -m MODULE [arguments]

Registers the tq_jax serde (type 'tq_jax', alias 'tqai' when free), then runs
`lmcache <arguments>` (e.g. `server --l2-adapter ...`) or `python -m MODULE` in
this process. See LMCache's arguments with `python -m tq_jax.bridge.launch server --help`.

options (before the LMCache arguments):
  -h, --help     show this message and exit
  -v, --verbose  show LMCache's import-time INFO lines, banner and warnings (hidden
                 unless LMCACHE_LOG_LEVEL is set)"""

_HELP = ("-h", "--help")
_VERBOSE = ("-v", "--verbose")


def main(argv: Sequence[str] | None = None) -> None:
    """Registers the serde, then hands ``argv`` to LMCache's CLI (or ``-m MODULE``).

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Raises:
        SystemExit: no arguments, or ``-m`` without a module (status 2, with the usage);
            the ``lmcache`` extra is not installed, or the server's port is taken (status 1,
            one line naming the install command or the flag to change).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    while args[:1] and args[0] in _VERBOSE:
        verbose, args = True, args[1:]
    if args[:1] and args[0] in _HELP:
        print(USAGE)  # before importing anything heavy: no torch, no LMCache
        return
    if not args or args == ["-m"]:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    logs.show_bridge_logs()
    wants_help = any(a in _HELP for a in args)  # LMCache's own --help: keep it quiet throughout
    with logs.quiet_lmcache(verbose, restore=not wants_help):
        try:
            from tq_jax.bridge._src.registry import register
        except ImportError as e:  # a clone installed without the extra: one line, no traceback
            if (line := missing_extra(e)) is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            raise SystemExit(1) from None
        register()
        if wants_help:
            _run(args)
            return
    with _ports_in_use() as seen:
        try:
            _run(_with_server_defaults(args))
        except SystemExit:
            if seen:
                print(f"error: {seen[0]}", file=sys.stderr)
                raise SystemExit(1) from None
            raise


def _with_server_defaults(args: list[str]) -> list[str]:
    """``server`` arguments with :mod:`~tq_jax.bridge._src.server_args`' defaults, each one said."""
    if args[:1] != ["server"]:
        return args
    import torch

    args, notes = server_args.server_defaults(args, has_cuda=torch.cuda.is_available())
    for note in notes:
        logging.getLogger("tq_jax.bridge.launch").warning("%s", note)
    return args


# The address-in-use failures of `lmcache server`, as uvicorn logs them before it exits:
# the traceback of the request server's ZMQ bind, and its own HTTP bind error.
_ZMQ_IN_USE = re.compile(r"Address already in use \(addr='tcp://([^']+)'\)")
_HTTP_IN_USE = re.compile(r"bind on address \('([^']*)', (\d+)\): address already in use")


@contextlib.contextmanager
def _ports_in_use():
    """Collects, as one line each, the ports LMCache's server could not bind, and keeps
    uvicorn's traceback of it off the terminal; the line names the flag to change."""
    seen: list[str] = []

    def _filter(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if m := _ZMQ_IN_USE.search(text):
            what, addr, flag = "request server", m.group(1), "--port"
        elif m := _HTTP_IN_USE.search(text):
            what, addr, flag = "HTTP API", f"{m.group(1)}:{m.group(2)}", "--http-port"
        else:
            return not (seen and text.startswith("Application startup failed"))
        seen.append(f"the {what} cannot listen on {addr}: the address is already in use (another LMCache server "
                    f"running?). Stop that process, or pass a free port with {flag} N.")
        return False

    lg = logging.getLogger("uvicorn.error")
    lg.addFilter(_filter)
    try:
        yield seen
    finally:
        lg.removeFilter(_filter)


def _run(args: list[str]) -> None:
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    from lmcache.cli.main import main as lmcache_main

    sys.argv = ["lmcache", *args]
    lmcache_main(args)


if __name__ == "__main__":
    main()
