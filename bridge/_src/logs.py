"""Log output of the bridge's command-line entry points (launcher, smoke test, plugin).

Standard library only, so that the launcher can use it before deciding whether to load
torch and LMCache at all.

LMCache configures every one of its loggers itself (``lmcache.logging.init_logger``: a
coloured stderr handler per module, level ``LMCACHE_LOG_LEVEL``, default INFO, fixed when
the module is imported), and importing it prints INFO lines (device probing) and
FutureWarnings (its google-* dependencies). Python, on the other hand, drops a library's
INFO records unless the application configures logging, which ``lmcache server`` does
not do for loggers outside ``lmcache``. Two helpers:

* :func:`quiet_lmcache`: LMCache imported inside it logs WARNING and above only, and its
  import-time warnings are hidden, unless the user asked for more (``-v``, or an explicit
  ``LMCACHE_LOG_LEVEL``). On exit the loggers it quietened go back to INFO, LMCache's
  default, so a server started afterwards logs as ``lmcache server`` would.
* :func:`show_bridge_logs`: the ``tq_jax`` loggers print to stderr at LMCache's level,
  so the operator sees the line the serde logs when LMCache builds it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

__all__ = ["LEVEL_ENV", "quiet_lmcache", "show_bridge_logs"]

LEVEL_ENV = "LMCACHE_LOG_LEVEL"  # LMCache's own switch; the bridge's lines follow it too
BANNER_ENV = "LMCACHE_DISABLE_BANNER"
FORMAT = "[%(asctime)s] tq_jax %(levelname)s: %(message)s"


def _lmcache_loggers() -> dict[str, logging.Logger]:
    return {
        name: lg
        for name, lg in logging.root.manager.loggerDict.items()
        if isinstance(lg, logging.Logger) and (name == "lmcache" or name.startswith("lmcache."))
    }


@contextlib.contextmanager
def quiet_lmcache(verbose: bool = False, *, restore: bool = True) -> Iterator[None]:
    """LMCache modules imported inside log WARNING and above; import warnings are hidden.

    Does nothing when ``verbose`` is true or ``LMCACHE_LOG_LEVEL`` is set (the user chose
    a level). LMCache's banner is suppressed too unless ``LMCACHE_DISABLE_BANNER`` is set.

    Args:
        verbose: leave LMCache's output alone.
        restore: on exit, set the loggers created inside back to INFO (LMCache's default)
            and undo the banner switch. ``False`` keeps them quiet for the rest of the
            process (for ``--help``, where nothing useful follows).
    """
    if verbose or LEVEL_ENV in os.environ:
        yield
        return
    before = set(_lmcache_loggers())
    set_banner = BANNER_ENV not in os.environ
    os.environ[LEVEL_ENV] = "WARNING"
    if set_banner:
        os.environ[BANNER_ENV] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # google-api-core, google-auth
            warnings.simplefilter("ignore", DeprecationWarning)  # opentelemetry
            yield
    finally:
        del os.environ[LEVEL_ENV]
        if restore:
            if set_banner:
                del os.environ[BANNER_ENV]
            for name, lg in _lmcache_loggers().items():
                if name not in before and lg.level == logging.WARNING:
                    lg.setLevel(logging.INFO)
                    for h in lg.handlers:
                        h.setLevel(logging.INFO)


def show_bridge_logs() -> None:
    """Prints the ``tq_jax`` loggers' records to stderr at ``LMCACHE_LOG_LEVEL`` (INFO).

    A no-op when logging is already configured (the root logger or ``tq_jax`` has a
    handler): then the application decides where the lines go.
    """
    lg = logging.getLogger("tq_jax")
    if logging.getLogger().handlers or lg.handlers:
        return
    name = os.environ.get(LEVEL_ENV, "INFO").upper()
    level = logging.getLevelName(name)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    lg.addHandler(handler)
    lg.setLevel(level if isinstance(level, int) else logging.INFO)
