"""Batch compression of tensor files: the engine behind ``tq-jax compress/decompress``.

One module per job, each using only the public names of the ones before it:

* :mod:`~tq_jax._src.batch.errors` — :class:`BatchError`, the one error type (a bad input
  or output, or settings that do not fit it; its message is one actionable line).
* :mod:`~tq_jax._src.batch.sources` — input files (safetensors, ``.npy``, ``.npz``) read
  chunk by chunk, memory-mapped where possible.
* :mod:`~tq_jax._src.batch.metadata` — the tq-jax metadata format: a compressed file is a
  safetensors file whose compressed tensors are 1-D ``U8`` runs of TQ01 blobs,
  described by a JSON document under the ``"tq_jax"`` metadata key.
* :mod:`~tq_jax._src.batch.writers` — sequential, atomic output writers.
* :mod:`~tq_jax._src.batch.plan` — what a file's output will be, unit by unit, decided from
  the tensor list, the options and the chunk budget alone.
* :mod:`~tq_jax._src.batch.run` — running a plan in one process, with progress.

Invariants: a tensor is read and written one chunk (at most the chunk budget of input,
default 64 MiB, rounded to whole rows) at a time; the output appears at its path only
once complete; and the chunking — hence every output byte — depends only on the shapes,
options and budget, never on the devices or processes.
"""

from __future__ import annotations

from tq_jax._src.batch.errors import BatchError
from tq_jax._src.batch.metadata import FORMAT, FORMAT_VERSION, META_KEY, TQ_DTYPES, blob_headers, read_tq_metadata
from tq_jax._src.batch.plan import (
    DEFAULT_CHUNK_BYTES,
    EVERY_LAYER_RAW,
    CompressOptions,
    Entry,
    FilePlan,
    Unit,
    chunk_rows,
    plan_compress,
    plan_decompress,
)
from tq_jax._src.batch.run import Progress, byte_view, produce, run_local
from tq_jax._src.batch.sources import Source, check_input, open_source
from tq_jax._src.batch.writers import open_writer

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_KEY",
    "TQ_DTYPES",
    "DEFAULT_CHUNK_BYTES",
    "EVERY_LAYER_RAW",
    "BatchError",
    "CompressOptions",
    "Unit",
    "Entry",
    "FilePlan",
    "Source",
    "open_source",
    "check_input",
    "chunk_rows",
    "plan_compress",
    "plan_decompress",
    "read_tq_metadata",
    "blob_headers",
    "open_writer",
    "byte_view",
    "produce",
    "run_local",
    "Progress",
]
