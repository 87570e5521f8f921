"""The tq-jax metadata format: how a compressed safetensors file describes its blobs.

A *compressed file* is an ordinary safetensors file. Every tensor chosen for
compression is stored under its own name as a 1-D ``U8`` tensor holding one or more
TQ01 blobs back to back; every other tensor passes through unchanged. The file's
``__metadata__`` keeps the input's metadata and adds one key, :data:`META_KEY`
(``"tq_jax"``), whose value is a JSON document (keys sorted, no spaces; shown here
spread out)::

    {"format": "tq-jax", "version": 1, "source": "safetensors",
     "tensors": {"kv": {"codec": "TQ01", "dtype": "BF16", "shape": [2, 32, 8192, 8, 128],
                        "head_dim": 128,
                        "options": {"checksum": false, "key_bits": 4, "norm_bits": 0,
                                    "norm_correction": false, "norm_dtype": "auto",
                                    "rotation": "haar", "seed": 42,
                                    "skip_first_layers": 0, "skip_last_layers": 0,
                                    "value_bits": 4},
                        "blobs": [17301575, 17301575, ...]}}}

(that tensor, 1 GiB of bfloat16 under the default 64 MiB chunk budget, is 16 blobs of
shape ``(4, 8192, 8, 128)``; ``...`` stands for the other 14 lengths).

``source`` is the input's kind (``"safetensors"``, ``"npy"`` or ``"npz"``). Per tensor,
``dtype``/``shape`` are the original tensor's (``dtype`` one of :data:`TQ_DTYPES`),
``head_dim`` the vector length it was cut into, ``options`` every field of the
:class:`tq_jax.Options` it was written with, and ``blobs`` the byte length of each blob
in order; they sum to the stored ``U8`` tensor's length. Each blob is a self-contained
TQ01 blob of one chunk of the tensor (its own header says its shape and options);
decoding the blobs in order and concatenating them in C order gives the tensor back.
Readers rely on ``format``, ``version``, ``tensors`` and each entry's ``dtype``,
``shape`` and ``blobs``; the other keys are informative.
"""

from __future__ import annotations

import json
import math

import numpy as np

from tq_jax._src import safetensors_io as st
from tq_jax._src import wire as _wire
from tq_jax._src.batch.errors import BatchError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_KEY",
    "TQ_DTYPES",
    "document",
    "tensor_entry",
    "to_json",
    "read_tq_metadata",
    "CODEC",
    "blob_headers",
]

FORMAT = "tq-jax"
FORMAT_VERSION = 1
META_KEY = "tq_jax"
CODEC = "TQ01"  # the one codec a tensor entry may name (its blobs are TQ01, tq_jax._src.wire)

# What TQ01 can record as a tensor's original dtype, as safetensors names, in the
# order of wire.DTYPES (bfloat16, float16, float32).
TQ_DTYPES = tuple(st.dtype_name(np.dtype(name)) for name in _wire.DTYPES)


def tensor_entry(dtype: str, shape: tuple, head_dim: int, options: dict, blobs: list) -> dict:
    """One tensor's entry of the document (``options``: the Options fields as a dict)."""
    return {
        "codec": CODEC,
        "dtype": dtype,
        "shape": list(shape),
        "head_dim": head_dim,
        "options": dict(options),
        "blobs": list(blobs),
    }


def document(source: str, tensors: dict) -> dict:
    """The whole document: ``tensors`` maps names to :func:`tensor_entry` dicts."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "source": source, "tensors": tensors}


def to_json(doc: dict) -> str:
    """The document as stored under :data:`META_KEY`: the same text for the same document."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def read_tq_metadata(src) -> dict | None:
    """The parsed ``tq_jax`` metadata document of a compressed file, or None.

    Args:
        src: a :class:`~tq_jax._src.batch.sources.Source`.

    Raises:
        BatchError: the document is not JSON, not a tq-jax document, or of a version
            this tq-jax does not read.
    """
    raw = src.metadata.get(META_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BatchError(f"{src.path}: corrupt tq_jax metadata: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tensors"), dict):
        raise BatchError(f"{src.path}: corrupt tq_jax metadata: not a {FORMAT} document")
    if doc.get("version") != FORMAT_VERSION:
        raise BatchError(
            f"{src.path}: tq_jax metadata version {doc.get('version')!r} is not supported by this "
            f"tq-jax (reads {FORMAT_VERSION}); upgrade tq-jax."
        )
    return doc


def blob_headers(src, name: str, meta: dict) -> list:
    """Validate a compressed entry against its metadata; return [(offset, nbytes, Header)].

    Checks, in order: the tensor exists, the entry's fields parse, the stored tensor is
    1-D ``U8`` of exactly the blobs' total length, every blob's header parses (the whole
    blob is passed, so a version-2 checksum is verified), and the blobs hold as many
    values as ``shape`` with one last axis.

    Raises:
        BatchError: any check fails.
    """
    import tq_jax

    info = src.tensors.get(name)
    where = f"{src.path}: tensor {name!r}"
    if info is None:
        raise BatchError(f"{where} is listed in the tq_jax metadata but missing from the file")
    if not isinstance(meta, dict):
        raise BatchError(f"{where}: corrupt tq_jax metadata entry {meta!r}")
    try:
        blobs = [int(b) for b in meta["blobs"]]
        shape = tuple(int(s) for s in meta["shape"])
        dtype = meta["dtype"]
    except (KeyError, TypeError, ValueError):
        raise BatchError(f"{where}: corrupt tq_jax metadata entry {meta!r}") from None
    if dtype not in TQ_DTYPES or any(b < 0 for b in blobs) or any(s < 0 for s in shape):
        raise BatchError(f"{where}: corrupt tq_jax metadata entry {meta!r}")
    if meta.get("codec") != CODEC:
        raise BatchError(
            f"{where}: the tq_jax metadata names codec {meta.get('codec')!r}, but this tq-jax reads only "
            f"{CODEC!r} blobs: the file was written by another tool or a newer tq-jax; decode it with the "
            f"tool that wrote it, or upgrade tq-jax."
        )
    if info.dtype != "U8" or len(info.shape) != 1 or info.shape[0] != sum(blobs):
        raise BatchError(
            f"{where} should be a 1-D U8 tensor of {sum(blobs)} bytes (its blobs), but is "
            f"{info.dtype} of shape {list(info.shape)}: the file is corrupt."
        )
    out, off, n_el = [], 0, 0
    for i, nb in enumerate(blobs):
        try:
            # The whole blob, memory-mapped: a version-2 checksum covers all of it.
            h = tq_jax.peek_header(src.read(name, off, off + nb))
        except tq_jax.WireError as e:
            raise BatchError(f"{where}, blob {i}: corrupt TQ01 blob: {e}") from None
        out.append((off, nb, h))
        off += nb
        n_el += math.prod(h.shape)
    if n_el != math.prod(shape) or (shape and out and any(h.shape[-1] != out[0][2].shape[-1] for _, _, h in out)):
        raise BatchError(
            f"{where}: its blobs hold {n_el} values but the metadata says shape {list(shape)}: "
            f"the file is corrupt."
        )
    return out
