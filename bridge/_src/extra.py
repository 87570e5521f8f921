"""What the bridge says when the ``lmcache`` extra (torch and lmcache) is missing. Standard
library only: ``tq_jax.bridge`` and its commands import it before torch."""

__all__ = ["INSTALL", "missing_extra"]

INSTALL = 'pip install -e ".[lmcache]"'  # from the tq-jax clone: torch 2.13.0 (CPU) and lmcache 0.5.6
_EXTRA_MODULES = ("torch", "lmcache")


def missing_extra(error: ImportError) -> str | None:
    """One line saying that the ``lmcache`` extra is missing and how to install it, when
    ``error`` is the failed import of torch or lmcache; None for any other import error."""
    name = getattr(error, "name", None) or ""
    if name.partition(".")[0] not in _EXTRA_MODULES:
        return None
    return (f"tq_jax.bridge needs the `lmcache` extra (torch and lmcache), but {name!r} is not installed: "
            f"install it with {INSTALL} (in the tq-jax clone).")
