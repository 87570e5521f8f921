"""Compressing tensor files, as ``tq-jax compress/decompress`` does, from Python.

:func:`open_source` reads a safetensors, ``.npy`` or ``.npz`` file chunk by chunk;
:func:`plan_compress` / :func:`plan_decompress` decide a file's output from its tensor
list, the :class:`CompressOptions` and the chunk budget alone; :func:`run_local` runs a
plan in this process. Across the processes of a ``jax.distributed`` job,
:func:`initialize` then :func:`run_distributed` share the same plans (the output bytes
equal a one-process run's). Every refusal is a :class:`BatchError`. docs/cli.md.
"""

from tq_jax._src.batch import BatchError, CompressOptions, open_source, plan_compress, plan_decompress, run_local
from tq_jax._src.distributed import initialize, run_distributed

__all__ = ["BatchError", "CompressOptions", "open_source", "plan_compress", "plan_decompress", "run_local",
           "initialize", "run_distributed"]
