"""LMCache v1 serde classes that store KV chunks as TQ01 blobs.

:class:`TQJaxSerializer` and :class:`TQJaxDeserializer` implement LMCache 0.5.6's sync
``Serializer`` / ``Deserializer`` (``serialize(src, dst, key) -> int``,
``deserialize(src, dst, key)``, ``estimate_serialized_size(layout)``). LMCache wraps them
in an ``AsyncSerdeProcessor``; :mod:`tq_jax.bridge.registry` does that wiring.

Layout mapping (what is stored for a KV object)
    Each group of the object's ``MemoryLayoutDesc`` is one TQ01 blob (version 1 with the
    default options, version 2 when an option needs it) whose last axis is split into
    heads: ``[..., X]`` is stored as ``[..., X // head_dim, head_dim]``.

    * vLLM's ``[2, L, T, H*D]`` becomes ``[2, L, T, H, D]``, exactly what the reference
      plugin's ``TqaiSerializer`` writes, so its deserializer reads our blobs and ours
      reads its.
    * The fused / MLA layout ``[1, L, T, D]`` (configure ``head_dim = D``, e.g. 576 for
      DeepSeek's latent + rope width) becomes ``[1, L, T, 1, D]``. The reference
      deserializer merges the last two axes back, so it reads these too.

    A multi-group object (``len(layout.shapes) > 1``, one entry per kernel group in
    LMCache's multiprocess mode) is stored as one blob per group, back to back in group
    order. A blob's length, its optional CRC32 trailer (version 2, ``checksum``)
    included, follows from its header alone, so the reader walks the blobs with
    ``peek_header`` + ``wire.blob_nbytes``. A single-group
    object, vLLM's usual case, is exactly one blob.

Sizes
    ``estimate_serialized_size`` is exact: the sum of ``tq_jax.serialized_size`` over the
    groups, computed from shapes and dtypes alone. ``serialize`` writes and returns
    exactly that many bytes, which LMCache 0.5.6's ``fs`` adapter requires (it rejects a
    file shorter than the estimate).

Buffers longer than the blob
    ``deserialize`` takes each blob's length from its header, never from the buffer.
    Bytes after the last blob are ignored: LMCache hands the deserializer a buffer sized
    by the *reader's* estimate, and an adapter may round buffers up. Ignoring them is
    safe because the header fixes every section's length and whether a CRC32 trailer
    follows (so the blob's end is known without the buffer's), and the decoded shape is
    checked against the destination. A buffer *shorter* than the blob
    its header declares is an error (``tq_jax.WireError``).

Where the computation runs
    ``device="cpu"`` (default) runs the codec on JAX's CPU device even when JAX's default
    backend is an accelerator. ``"gpu"``, ``"tpu"`` or ``"auto"`` (JAX's default backend),
    optionally with an index (``"gpu:1"``), select another device; a platform that does
    not exist is a ``ValueError`` when the serde is built, not at the first store.
    CPU tensors are read and written through numpy views of LMCache's memory (no copy);
    CUDA tensors go through DLPack (:mod:`tq_jax.bridge.dlpack`) to JAX arrays.

    On a host with an accelerator, importing this module sets
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless already set: JAX would otherwise take
    75 % of the GPU's memory when its backend starts, next to the inference engine that
    shares the GPU. Set ``JAX_PLATFORMS=cpu`` to keep JAX off the accelerator entirely.
"""

from __future__ import annotations

import math
import os
import re
from typing import NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # see module docstring

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.serde.base import Deserializer, Serializer  # noqa: E402
from lmcache.v1.memory_management import MemoryObj  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax import wire as _wire  # noqa: E402
from tq_jax.bridge import dlpack  # noqa: E402

__all__ = [
    "DEVICE_CHOICES",
    "GroupPlan",
    "TQJaxDeserializer",
    "TQJaxSerializer",
    "plan_layout",
    "resolve_device",
    "stored_shape",
]

DEVICE_CHOICES = ("cpu", "gpu", "tpu", "auto")
"""Values of the ``device`` option; all but ``auto`` may carry an index (``gpu:1``)."""

# The bridge pins the norm dtype (default float16: TQ01 version 1, which the reference
# reads) so that every blob's size is known from the layout alone: the core's
# norm_dtype="auto" would switch a blob with a norm above float16's range to float32 norms,
# 2 bytes per vector longer than the estimate LMCache allocated.
NORM_DTYPES = tuple(_wire.NORM_DTYPES)
AUTO_NORMS = (
    "norm_dtype='auto' is not available in the LMCache serde: it lengthens a blob when a norm "
    "overflows float16, and LMCache needs every blob to be exactly its estimated size. Use "
    "'float16' (TQ01 v1, the reference reads it; an overflowing norm fails the store, which "
    "LMCache treats as a miss) or 'float32' (TQ01 v2, never overflows)."
)

_TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}

# ----------------------------------------------------------------------------- messages

NOT_DIVISIBLE = (
    "KV group {group} has shape {shape}: its last axis ({hidden}) is not a multiple of "
    "head_dim={head_dim}. The serde splits the last axis into (hidden // head_dim, "
    "head_dim) vectors. Set the serde's head_dim to the model's head size (e.g. 128 for "
    "Llama-3; for MLA / fused layouts [1, L, T, D] set head_dim to D, e.g. 576)."
)
UNSUPPORTED_DTYPE = (
    "KV group {group} has dtype {dtype}, which TQ01 cannot record: it encodes "
    "bfloat16, float16 and float32 tensors. Run the model with one of those KV-cache "
    "dtypes, or use another serde (e.g. LMCache's fp8) for this adapter."
)
BAD_LAYOUT = (
    "the KV layout has {shapes} shapes and {dtypes} dtypes: MemoryLayoutDesc.shapes and "
    ".dtypes must be parallel, non-empty lists (one entry per group)."
)
DST_NOT_UINT8 = (
    "serialize destination has dtype {dtype}; it must be LMCache's uint8 byte buffer (the "
    "temp MemoryObj sized by estimate_serialized_size). Pass a uint8 MemoryObj as dst."
)
DST_TOO_SMALL = (
    "serialize destination holds {have} bytes but the TQ01 blob(s) for layout {layout} "
    "need exactly {need}: allocate dst with estimate_serialized_size(layout) bytes (this "
    "serde's estimate is exact)."
)
SRC_LAYOUT_CHANGED = (
    "serialize source group {group} has shape {shape} and dtype {dtype}, but the object's "
    "layout says {want_shape} / {want_dtype}: the MemoryObj's tensors and its layout "
    "disagree."
)
SRC_NOT_UINT8 = (
    "deserialize source has dtype {dtype}; it must be the uint8 byte buffer the L2 adapter "
    "loaded. Pass a uint8 MemoryObj as src."
)
SHAPE_MISMATCH = (
    "the TQ01 blob for group {group} holds a tensor of shape {blob_shape} ({blob_dtype}, "
    "{bits} bits) but the destination has shape {dst_shape}: the L2 entry was written for "
    "a different KV layout (model, chunk size, head count or parallelism changed?). Clear "
    "the L2 store or give each layout its own base_path."
)
DST_NOT_FLOAT = (
    "deserialize destination group {group} has dtype {dtype}; decoding writes floats. The "
    "destination must be a bfloat16, float16 or float32 KV MemoryObj."
)
NO_SUCH_DEVICE = (
    "device={spec!r} asks for JAX platform {platform!r}, but this JAX has no such backend "
    "({why}). Available: {available}. Install the matching jax plugin (e.g. "
    "jax[cuda12]) or set the serde's device to 'cpu'."
)
BAD_DEVICE_INDEX = (
    "device={spec!r}: JAX platform {platform!r} has {count} device(s), so the index must "
    "be in 0..{last}."
)
BAD_DEVICE_SPEC = (
    "device must be one of {choices} (optionally with an index, e.g. 'gpu:1'), got "
    "{spec!r}."
)


# ----------------------------------------------------------------------------- devices

_DEVICE_RE = re.compile(r"^(cpu|gpu|tpu|auto)(?::(\d+))?$")


def resolve_device(spec: str = "cpu") -> jax.Device:
    """Maps the serde's ``device`` option to a JAX device, failing early and clearly.

    Args:
        spec: ``"cpu"``, ``"gpu"``, ``"tpu"`` or ``"auto"`` (JAX's default backend),
            optionally followed by ``":index"`` (``"gpu:1"``); case-insensitive.

    Returns:
        The selected ``jax.Device``.

    Raises:
        ValueError: the spec is malformed, the platform does not exist in this JAX
            installation, or the index is out of range.

    Examples:
        >>> resolve_device("cpu").platform
        'cpu'
    """
    m = _DEVICE_RE.match(spec.strip().lower()) if isinstance(spec, str) else None
    if m is None or (m.group(1) == "auto" and m.group(2) is not None):
        raise ValueError(BAD_DEVICE_SPEC.format(choices=DEVICE_CHOICES, spec=spec))
    platform, index = m.group(1), int(m.group(2) or 0)
    try:
        devices = jax.devices() if platform == "auto" else jax.devices(platform)
    except RuntimeError as e:
        available = sorted({d.platform for d in jax.devices()})
        raise ValueError(
            NO_SUCH_DEVICE.format(spec=spec, platform=platform, why=str(e).split("\n")[0], available=available)
        ) from None
    if index >= len(devices):
        raise ValueError(
            BAD_DEVICE_INDEX.format(spec=spec, platform=platform, count=len(devices), last=len(devices) - 1)
        )
    return devices[index]


# ----------------------------------------------------------------------------- layout


class GroupPlan(NamedTuple):
    """How one group of a KV object is stored."""

    shape: tuple[int, ...]  # the group's own shape, e.g. (2, L, T, H*D)
    stored: tuple[int, ...]  # the shape recorded in the blob, e.g. (2, L, T, H, D)
    dtype: str  # "bfloat16" | "float16" | "float32"
    nbytes: int  # exact blob length


def stored_shape(shape, head_dim: int, *, group: int = 0) -> tuple[int, ...]:
    """``[..., X]`` → ``[..., X // head_dim, head_dim]``, the per-head shape TQ01 records.

    Raises:
        ValueError: ``X`` is not a multiple of ``head_dim``, or the shape is empty.

    Examples:
        >>> stored_shape((2, 32, 256, 1024), 128)
        (2, 32, 256, 8, 128)
        >>> stored_shape((1, 61, 256, 576), 576)
        (1, 61, 256, 1, 576)
    """
    shape = tuple(int(s) for s in shape)
    if not shape or shape[-1] % head_dim or shape[-1] == 0:
        raise ValueError(
            NOT_DIVISIBLE.format(group=group, shape=list(shape), hidden=shape[-1] if shape else None, head_dim=head_dim)
        )
    return shape[:-1] + (shape[-1] // head_dim, head_dim)


def _dtype_name(dtype: torch.dtype, group: int) -> str:
    name = _TORCH_DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(UNSUPPORTED_DTYPE.format(group=group, dtype=dtype))
    return name


def plan_layout(layout: MemoryLayoutDesc, head_dim: int, options) -> list[GroupPlan]:
    """The stored shape, dtype and exact blob size of every group of ``layout``.

    ``options`` is a :class:`tq_jax.Options` (or an int: v1 bits).

    Raises:
        ValueError: a group's dtype is unsupported, its last axis is not a multiple of
            ``head_dim``, the stored shape exceeds TQ01's limits, or the layout's shape and
            dtype lists are empty or of different lengths.
    """
    shapes, dtypes = list(layout.shapes), list(layout.dtypes)
    if not shapes or len(shapes) != len(dtypes):
        raise ValueError(BAD_LAYOUT.format(shapes=len(shapes), dtypes=len(dtypes)))
    plans = []
    for g, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        name = _dtype_name(dtype, g)
        stored = stored_shape(shape, head_dim, group=g)
        if len(stored) > _wire.MAX_NDIM:
            raise ValueError(
                f"KV group {g} has shape {list(shape)}: stored per head it has {len(stored)} "
                f"axes, more than TQ01's MAX_NDIM={_wire.MAX_NDIM}. Flatten leading axes."
            )
        nbytes = _options_of(options).serialized_size(stored, name)
        plans.append(GroupPlan(tuple(int(s) for s in shape), stored, name, nbytes))
    return plans


def _options_of(options) -> tq_jax.Options:
    if isinstance(options, tq_jax.Options):
        return options
    return tq_jax.Options.make(options, norm_dtype="float16")


def _group_tensors(obj: MemoryObj) -> list[torch.Tensor]:
    """One tensor per layout group of a MemoryObj (``get_tensor(i)``; ``.tensor`` if single)."""
    shapes = obj.get_shapes()
    if len(shapes) == 1:
        return [obj.tensor]
    return [obj.get_tensor(i) for i in range(len(shapes))]


def _layout_of(obj: MemoryObj) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=list(obj.get_shapes()), dtypes=list(obj.get_dtypes()))


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A 1-D uint8 numpy view of a byte tensor (a host copy when it is not on the CPU)."""
    t = t.reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    return dlpack.numpy_view(t.contiguous())


# ----------------------------------------------------------------------------- serde


class TQJaxSerializer(Serializer):
    """Encodes KV ``MemoryObj``s into TQ01 blobs (see the module docstring).

    With the defaults every blob is TQ01 version 1, which the reference plugin reads;
    a non-default value of any version-2 option (per-K/V bits, raw edge layers, the
    fast rotation, float32 norms, log-coded norms, norm correction, checksum) writes
    version 2.

    The keyword arguments are the codec rows of the bridge's option table
    (:data:`tq_jax.bridge.registry.OPTIONS`): ``head_dim``, ``bits``, ``seed`` and every
    :class:`tq_jax.Options` field, each checked by its row (same defaults, same errors
    as the LMCache serde dict).

    Args:
        head_dim: vector length; the last axis of every group is split into
            ``(X // head_dim, head_dim)``.
        bits: bits per coordinate, 1..8 (2, 3, 4, 6, 8 stay version 1).
        seed: rotation seed (int32 range); readers take it from the blob.
        device: ``"cpu"`` (default), ``"gpu"``, ``"tpu"``, ``"auto"``, optionally
            ``":index"``, or a ``jax.Device``.
        **options: :class:`tq_jax.Options` fields: ``key_bits``, ``value_bits`` (slot 0
            / 1 of ``[2, L, T, ...]``; default ``bits``), ``skip_first_layers``,
            ``skip_last_layers``, ``rotation``, ``norm_dtype`` ("float16", the default,
            or "float32"; not "auto": blob sizes must follow from the layout),
            ``norm_correction``, ``checksum``, ``norm_bits``, ...

    Raises:
        ValueError: a value out of range, a combination :class:`tq_jax.Options`
            refuses, or a device that does not exist.
        TypeError: a value of the wrong type, or an unknown keyword.
    """

    def __init__(self, head_dim: int = 128, bits: int = 4, seed: int = 42, device="cpu", **options) -> None:
        from tq_jax.bridge import registry  # the option table (registry imports this module)

        self.options = registry.codec_options_for(head_dim=head_dim, bits=bits, seed=seed, **options)
        self.head_dim = head_dim
        self.bits = bits
        self.seed = seed
        self.device = device if isinstance(device, jax.Device) else resolve_device(device)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """Exact byte length of :meth:`serialize`'s output for ``layout_desc``.

        Raises:
            ValueError: the layout cannot be stored (see :func:`plan_layout`).
        """
        return sum(p.nbytes for p in plan_layout(layout_desc, self.head_dim, self.options))

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Writes the TQ01 blob(s) of ``src`` into ``dst.tensor``; returns their length.

        Args:
            src: the KV object (any number of groups; bfloat16/float16/float32).
            dst: a uint8 byte buffer of at least ``estimate_serialized_size`` bytes.
            key: ignored (the encoding does not depend on the key).

        Returns:
            Exactly ``estimate_serialized_size(layout of src)``.

        Raises:
            ValueError: unsupported layout, ``dst`` not uint8 or too small, or a vector
                norm beyond float16's range (``tq_jax.NormOverflowError``).
        """
        del key
        plans = plan_layout(_layout_of(src), self.head_dim, self.options)
        need = sum(p.nbytes for p in plans)
        out_t = dst.tensor
        if out_t.dtype != torch.uint8:
            raise ValueError(DST_NOT_UINT8.format(dtype=out_t.dtype))
        if out_t.numel() < need:
            raise ValueError(DST_TOO_SMALL.format(have=out_t.numel(), layout=[list(p.shape) for p in plans], need=need))
        on_host = out_t.device.type == "cpu"
        out = dlpack.numpy_view(out_t.reshape(-1)) if on_host else np.empty(need, np.uint8)
        off = 0
        for g, (t, p) in enumerate(zip(_group_tensors(src), plans)):
            if tuple(t.shape) != p.shape or _TORCH_DTYPE_NAMES.get(t.dtype) != p.dtype:
                raise ValueError(
                    SRC_LAYOUT_CHANGED.format(group=g, shape=list(t.shape), dtype=t.dtype, want_shape=list(p.shape), want_dtype=p.dtype)
                )
            if t.device.type == "cpu":
                x = dlpack.numpy_view(t.contiguous()).reshape(p.stored)  # a view of L1 memory
            else:
                x = dlpack.to_jax(t).reshape(p.stored)  # stays on its accelerator
            n = tq_jax.dump_into(x, out[off : off + p.nbytes], self.options, device=self.device)
            if n != p.nbytes:  # the core promises serialized_size; keep LMCache's fs contract safe
                raise RuntimeError(f"tq_jax.dump_into wrote {n} bytes for group {g}, expected {p.nbytes}")
            off += n
        if not on_host:
            out_t.reshape(-1)[:need].copy_(torch.from_numpy(out))
        return need


class TQJaxDeserializer(Deserializer):
    """Decodes TQ01 blobs (ours or the reference's, QJL included) into KV ``MemoryObj``s.

    All codec parameters come from the blob headers; only where to compute is configured.

    Args:
        device: as for :class:`TQJaxSerializer`.
    """

    def __init__(self, device="cpu") -> None:
        self.device = device if isinstance(device, jax.Device) else resolve_device(device)

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Decodes ``src``'s blob(s) into ``dst``'s tensors in place, whatever their float dtype.

        Raises:
            tq_jax.WireError: a blob is malformed or shorter than its header declares.
            ValueError: ``src`` is not uint8, or a blob's shape does not match ``dst``.
        """
        del key
        src_t = src.tensor
        if src_t.dtype != torch.uint8:
            raise ValueError(SRC_NOT_UINT8.format(dtype=src_t.dtype))
        buf = _host_bytes(src_t)
        off = 0
        for g, t in enumerate(_group_tensors(dst)):
            if t.dtype not in _TORCH_DTYPE_NAMES:
                raise ValueError(DST_NOT_FLOAT.format(group=g, dtype=t.dtype))
            h = tq_jax.peek_header(buf[off:])
            n = _blob_nbytes(h)
            _check_shape(h, tuple(t.shape), g)
            blob = buf[off : off + n]  # the parser raises TruncatedError if buf is short
            if t.device.type == "cpu" and t.is_contiguous():
                tq_jax.load_into(blob, dlpack.numpy_view(t), device=self.device)
            else:
                arr = tq_jax.loads(blob, dtype=dlpack._NUMPY_DTYPES[t.dtype], device=self.device)
                dlpack.copy_into(t, arr)
            off += n


def _blob_nbytes(h: tq_jax.Header) -> int:
    """A blob's full length (trailer included), from its header alone."""
    return _wire.blob_nbytes(h)


def _check_shape(h: tq_jax.Header, dst_shape: tuple[int, ...], group: int) -> None:
    blob = tuple(h.shape)
    per_head = len(blob) >= 2 and len(dst_shape) >= 1 and blob[:-2] == dst_shape[:-1] and blob[-2] * blob[-1] == dst_shape[-1]
    if blob != dst_shape and not per_head:
        raise ValueError(
            SHAPE_MISMATCH.format(group=group, blob_shape=list(blob), blob_dtype=h.dtype, bits=h.bits, dst_shape=list(dst_shape))
        )
    assert math.prod(blob) == math.prod(dst_shape)
