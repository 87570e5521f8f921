"""The one error type of :mod:`tq_jax._src.batch`."""

from __future__ import annotations

__all__ = ["BatchError"]


class BatchError(Exception):
    """A bad input or output file, or settings that do not fit it.

    The message says what was wrong, with which file or tensor, and how to fix it, in
    one line: ``tq-jax`` prints it as is and exits with status 1.
    """

