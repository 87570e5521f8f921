"""Registers the tq_jax serde, then runs LMCache's own command line in this process.

LMCache 0.5.6 looks serde types up when the ``StorageManager`` is built and has no
plugin discovery for them, so the type must be registered in the process that builds
it, before it is built. ``lmcache server`` builds it in-process (uvicorn's lifespan), so
wrapping LMCache's CLI is enough::

    python -m tq_jax.bridge.launch server --l1-size-gb 20 --eviction-policy LRU \\
        --l2-adapter '{"type": "fs", "base_path": "/cache",
                       "serde": {"type": "tq_jax", "bits": 4}}'

Every argument is LMCache's: the launcher adds none and changes none. To run another
LMCache entry module instead of the ``lmcache`` CLI, put ``-m MODULE`` first; the module
runs as ``__main__`` with the remaining arguments, as ``python -m MODULE`` would::

    python -m tq_jax.bridge.launch -m lmcache.v1.multiprocess.server --l1-size-gb 20 ...

A process that LMCache (or anything else) *spawns* does not inherit the registration;
for those, use the config-only loader in :mod:`tq_jax.bridge.plugin`.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence

from tq_jax.bridge.registry import register

__all__ = ["main"]

USAGE = (
    "usage: python -m tq_jax.bridge.launch <lmcache CLI arguments>\n"
    "       python -m tq_jax.bridge.launch -m MODULE [arguments]\n"
    "Registers the tq_jax serde (type 'tq_jax', alias 'tqai' when free), then runs\n"
    "`lmcache <arguments>` (e.g. `server --l2-adapter ...`) or `python -m MODULE` in\n"
    "this process."
)


def main(argv: Sequence[str] | None = None) -> None:
    """Registers the serde, then hands ``argv`` to LMCache's CLI (or ``-m MODULE``).

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]) and len(args) == 1:
        print(USAGE)
        return
    register()
    if args[:1] == ["-m"]:
        if len(args) < 2:
            raise SystemExit(USAGE)
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    from lmcache.cli.main import main as lmcache_main

    sys.argv = ["lmcache", *args]
    lmcache_main(args)


if __name__ == "__main__":
    main()
