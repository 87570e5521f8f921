"""The ``tq-jax`` command (``compress``, ``decompress``, ``inspect``, ``bench``): docs/cli.md."""

from tq_jax._src.cli import main

__all__ = ["main"]
