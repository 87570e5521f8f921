"""Compiles the serde's programs when it is built, so that no L2 hit waits for a compiler.

The codec runs each block of vectors through a jit-compiled program, one per bit width,
block size and dtype (:mod:`tq_jax._src.blocks`). A server that has just started has none of
them: its first L2 hit would compile the decoders while vLLM waits (and its first store
the encoders). :func:`warm_up` runs one synthetic chunk through the serde's own
``encode_into`` and ``decode_from``, the very calls LMCache's workers make, when the
serde is built: LMCache builds its L2 adapters before the server answers, so a server
that answers is warm.

Which programs: every chunk is cut into blocks of ``blocks.block_vectors_for(head_dim)``
vectors per key or value segment, and a short last block is padded up to a *bucket*
size. The synthetic chunk holds exactly one full block per segment, under the serde's own
layout (``kv_layout``, resolved as the registry resolves ``auto``), so it compiles the
programs of every full block of every chunk shape. A chunk whose last block is shorter
than a full block has a program of its own for that block's bucket: the serde remembers
the chunk shapes it has planned (:class:`ChunkShapes`, a small JSON file per serde
setting under :func:`cache_dir`) and warms those exactly at the next start. Only a
server that has never seen its model's chunks compiles that one program at first use
(:data:`WHY_TAIL`). A failure here is logged and never stops the serde: the programs
then compile at first use, as they would without a warm-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

from tq_jax._src import blocks as _blocks

__all__ = ["MAX_SHAPES", "WHY_TAIL", "ChunkShapes", "cache_dir", "chunk_shape", "warm_up"]

logger = logging.getLogger(__name__)

WHY_TAIL = (
    "a new chunk shape whose vectors per key (or value) segment are not a multiple of a full block compiles its last "
    "block's program at first use"
)
MAX_SHAPES = 16  # chunk shapes remembered per serde setting: a model, parallelism and chunk size each
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cache_dir() -> Path:
    """Where the serde remembers chunk shapes: ``$TQ_JAX_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/tq_jax``, else ``~/.cache/tq_jax``."""
    if os.environ.get("TQ_JAX_CACHE_DIR"):
        return Path(os.environ["TQ_JAX_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tq_jax"


class ChunkShapes:
    """The chunk shapes one serde setting has planned, remembered across restarts.

    One JSON file per setting (named by a digest of ``setting``, the serde's options
    and layout), a list of ``[shape, dtype]`` pairs, at most :data:`MAX_SHAPES`, newest
    last. :meth:`add` is called for every layout the serde plans and writes only when a
    shape is new, replacing the file atomically; an unwritable directory is logged once
    and the shapes are then kept in memory only.
    """

    def __init__(self, setting: str, directory: Path | None = None) -> None:
        digest = hashlib.blake2b(setting.encode(), digest_size=8).hexdigest()
        self.path = (directory or cache_dir()) / f"lmcache-chunks-{digest}.json"
        self.lock = threading.Lock()
        self.shapes: list[tuple[tuple[int, ...], str]] = self._read()
        self.failed = False

    def _read(self) -> list[tuple[tuple[int, ...], str]]:
        try:
            entries = json.loads(self.path.read_text())
            shapes = [(tuple(int(n) for n in shape), str(dtype)) for shape, dtype in entries if dtype in _DTYPES]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as e:
            logger.warning("tq_jax serde: ignoring the remembered chunk shapes in %s (%s)", self.path, e)
            return []
        return shapes[-MAX_SHAPES:]

    def discard(self, entry: tuple[tuple[int, ...], str]) -> None:
        """Forgets a shape this setting cannot plan any more (written for another layout)."""
        with self.lock:
            if entry in self.shapes:
                self.shapes = [e for e in self.shapes if e != entry]
                if not self.failed:
                    self._write()

    def add(self, shapes, dtypes) -> None:
        """Remembers a single-group layout's shape (multi-group layouts are not warmed)."""
        if len(shapes) != 1:
            return
        entry = (tuple(int(n) for n in shapes[0]), str(dtypes[0]).removeprefix("torch."))
        if entry in self.shapes or entry[1] not in _DTYPES:
            return
        with self.lock:
            if entry in self.shapes:
                return
            self.shapes = [*self.shapes, entry][-MAX_SHAPES:]
            if not self.failed:
                self._write()

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump([[list(shape), dtype] for shape, dtype in self.shapes], f)
            os.replace(tmp, self.path)
        except OSError as e:
            self.failed = True
            logger.warning("tq_jax serde: cannot remember chunk shapes in %s (%s); after a restart their last blocks "
                           "compile at first use. Set TQ_JAX_CACHE_DIR to a writable directory.", self.path, e)
_KEY = ObjectKey(chunk_hash=b"tq_jax-warmup".ljust(32, b"\0"), model_name="tq_jax-warmup", kv_rank=0)


def chunk_shape(head_dim: int, layout: str, block_size: int, block_vectors: int) -> tuple[int, ...]:
    """A chunk of ``layout`` with ``block_vectors`` vectors per key or value segment (one
    full block; for ``vllm-cpu`` rounded up to whole vLLM blocks of ``block_size`` tokens).

    Examples:
        >>> chunk_shape(64, "vllm-cpu", 128, 8192)
        (1, 8192, 128)
        >>> chunk_shape(128, "split", 128, 4096)
        (2, 1, 4096, 128)
        >>> chunk_shape(576, "latent", 128, 910)
        (1, 910, 576)
    """
    d, n = int(head_dim), int(block_vectors)
    if layout == "split":
        return (2, 1, n, d)
    if layout == "latent":
        return (1, n, d)
    if layout == "vllm-cpu":
        n = -(-n // block_size) * block_size
    return (1, n, 2 * d)  # fused, vllm-cpu: one layer, one head, K and V per token


def _obj(shape: tuple[int, ...], dtype: torch.dtype) -> TensorMemoryObj:
    """A standalone LMCache ``MemoryObj`` over a fresh, 64-byte aligned tensor (as L1's)."""
    size = torch.Size(shape)
    n = size.numel() * dtype.itemsize
    raw = torch.empty(n + _blocks.ALIGN, dtype=torch.uint8)
    off = -raw.data_ptr() % _blocks.ALIGN
    meta = MemoryObjMetadata(size, dtype, 0, n, 1, shapes=[size], dtypes=[dtype])
    return TensorMemoryObj(raw[off : off + n], meta, None)


def warm_up(serializer, deserializer, layout: str, remembered=(), *, forget=None) -> list[tuple[tuple[int, ...], str]]:
    """Encodes and decodes synthetic chunks through the serde's own path: one full block
    per segment of ``layout`` (bfloat16, vLLM's usual KV dtype), then each remembered
    ``(shape, dtype)``.

    Args:
        serializer, deserializer: a :class:`~tq_jax.bridge._src.serde.TQJaxSerializer` and
            its deserializer (not the sealing wrappers: AES compiles nothing).
        layout: the layout the serde reads the engine's chunks as (``auto`` resolved).
        remembered: chunk shapes and dtype names seen before (:class:`ChunkShapes`).
        forget: called with a remembered ``(shape, dtype)`` the serde refuses to plan
            (a ``ValueError``: it no longer fits the layout); it is skipped.

    Returns:
        The ``(shape, dtype)`` chunks warmed, in order.

    Raises:
        Whatever the serde raises for the full-block chunk (the registry logs it and
        carries on).
    """
    block = _blocks.block_vectors_for(serializer.head_dim, None, [serializer.device])
    warmed = []
    for i, (shape, name) in enumerate([(chunk_shape(serializer.head_dim, layout, serializer.block_size, block),
                                        "bfloat16"), *remembered]):
        dtype = _DTYPES[name]
        try:
            nbytes = serializer.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[dtype]))
        except ValueError:
            if i == 0:
                raise
            if forget is not None:
                forget((shape, name))
            continue
        src = _obj(shape, dtype)
        src.tensor.copy_(torch.from_numpy(np.random.default_rng(0).standard_normal(shape, np.float32)).to(dtype))
        value = np.empty(nbytes, np.uint8)
        serializer.encode_into(src, value, _KEY)
        deserializer.decode_from(value, _obj(shape, dtype), _KEY)
        warmed.append((shape, name))
    return warmed

