"""LMCache v1 serde classes that store KV chunks as TQ01 blobs.

:class:`TQJaxSerializer` and :class:`TQJaxDeserializer` implement LMCache 0.5.6's sync
``Serializer`` / ``Deserializer`` (``serialize(src, dst, key) -> int``,
``deserialize(src, dst, key)``, ``estimate_serialized_size(layout)``). LMCache wraps them
in an ``AsyncSerdeProcessor``; :mod:`tq_jax.bridge._src.registry` does that wiring.

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
    CUDA tensors go through DLPack (:mod:`tq_jax.bridge._src.dlpack`) to JAX arrays.

    On a host with an accelerator, importing this module sets
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless already set: JAX would otherwise take
    75 % of the GPU's memory when its backend starts, next to the inference engine that
    shares the GPU. Set ``JAX_PLATFORMS=cpu`` to keep JAX off the accelerator entirely.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
from typing import NamedTuple

from tq_jax.bridge._src.device import DEVICE_CHOICES, resolve_device  # sets XLA_PYTHON_CLIENT_PREALLOCATE first

import jax  # noqa: E402  (after device: see the module docstring)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.serde.base import Deserializer, Serializer  # noqa: E402
from lmcache.v1.memory_management import MemoryObj  # noqa: E402

import tq_jax  # noqa: E402
from tq_jax._src import blocks as _blocks  # noqa: E402
from tq_jax._src import frames as _frames  # noqa: E402
from tq_jax._src import wire as _wire  # noqa: E402
from tq_jax.bridge._src import dlpack  # noqa: E402
from tq_jax.bridge._src import layouts  # noqa: E402
from tq_jax.bridge._src.layouts import KV_LAYOUTS  # noqa: E402, F401 (re-exported)
from tq_jax.bridge._src.schema import AUTO_NORMS, NORM_DTYPES, check_values, codec_options_for  # noqa: E402, F401 (re-exported)

__all__ = [
    "DEVICE_CHOICES",
    "GroupPlan",
    "KV_LAYOUTS",
    "KEY_TRAILER_BYTES",
    "KeyMismatchError",
    "TQJaxDeserializer",
    "TQJaxSerializer",
    "check_key_trailer",
    "describe_key",
    "key_digest",
    "object_key_bytes",
    "plan_layout",
    "read_bytes",
    "write_bytes",
    "resolve_device",
    "stored_shape",
]

_TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}

# ----------------------------------------------------------------------------- messages

NOT_DIVISIBLE = layouts.NOT_DIVISIBLE
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
    "serialize destination holds {have} bytes but the stored bytes for layout {layout} "
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
    "a different KV layout (model, chunk size, head count, parallelism or the serde's "
    "kv_layout changed?). Clear the L2 store or give each layout its own base_path."
)
DST_NOT_FLOAT = (
    "deserialize destination group {group} has dtype {dtype}; decoding writes floats. The "
    "destination must be a bfloat16, float16 or float32 KV MemoryObj."
)
# ----------------------------------------------------------------------------- layout


class GroupPlan(NamedTuple):
    """How one group of a KV object is stored."""

    shape: tuple[int, ...]  # the group's own shape, e.g. (2, L, T, H*D)
    stored: tuple[int, ...]  # the shape recorded in the blob, e.g. (2, L, T, H, D)
    dtype: str  # "bfloat16" | "float16" | "float32"
    nbytes: int  # exact blob length
    form: layouts.Form | None = None  # the group's kv_layout, resolved
    kv_order: bool = False  # stored in K/V order (layouts.to_stored), not the chunk's own


def stored_shape(shape, head_dim: int, *, group: int = 0) -> tuple[int, ...]:
    """``[..., X]`` → ``[..., X // head_dim, head_dim]``, the per-head shape TQ01 records
    for the chunk's own order (version-1 blobs; :mod:`~tq_jax.bridge._src.layouts`).

    Raises:
        ValueError: ``X`` is not a multiple of ``head_dim``, or the shape is empty.

    Examples:
        >>> stored_shape((2, 32, 256, 1024), 128)
        (2, 32, 256, 8, 128)
        >>> stored_shape((1, 61, 256, 576), 576)
        (1, 61, 256, 1, 576)
    """
    return layouts.form(shape, head_dim, group=group).engine


def _dtype_name(dtype: torch.dtype, group: int) -> str:
    name = _TORCH_DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(UNSUPPORTED_DTYPE.format(group=group, dtype=dtype))
    return name


def plan_layout(layout: MemoryLayoutDesc, head_dim: int, options, kv_layout: str = "auto", block_size: int = 128,
                paired: str = "fused") -> list[GroupPlan]:
    """The stored shape, dtype and exact blob size of every group of ``layout``.

    ``options`` is a :class:`tq_jax.Options` (or an int: v1 bits); ``paired`` is what
    ``kv_layout="auto"`` reads an ``[L, T, H·2·D]`` chunk as. A group is stored in
    K/V order (:mod:`~tq_jax.bridge._src.layouts`) when its blob is TQ01 version 2 and
    ``kv_layout`` gives it one, and always under ``vllm-cpu``; other version-1 blobs keep
    the chunk's own order (the reference plugin's bytes).

    Raises:
        ValueError: a group's dtype is unsupported, its shape does not fit ``kv_layout``
            (or its last axis is not a multiple of ``head_dim``), the options need keys
            and values that the layout cannot tell apart, the stored shape exceeds
            TQ01's limits, or the layout's shape and dtype lists are empty or of
            different lengths.
    """
    shapes, dtypes = list(layout.shapes), list(layout.dtypes)
    if not shapes or len(shapes) != len(dtypes):
        raise ValueError(BAD_LAYOUT.format(shapes=len(shapes), dtypes=len(dtypes)))
    opts = _options_of(options)
    plans = []
    for g, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        name = _dtype_name(dtype, g)
        f = layouts.form(shape, head_dim, kv_layout, block_size, group=g, paired=paired)
        if opts.kv_layout and f.kv is None:
            raise ValueError(layouts.NO_KV_ORDER.format(group=g, shape=list(shape), layout=f.layout))
        # K/V order for version 2, and always for vllm-cpu (its chunk rows are not per-token vectors)
        kv_order = f.kv is not None and (not opts.v1_expressible or f.layout == "vllm-cpu")
        stored = f.stored(kv_order)
        if len(stored) > _wire.MAX_NDIM:
            raise ValueError(
                f"KV group {g} has shape {list(shape)}: stored per head it has {len(stored)} "
                f"axes, more than TQ01's MAX_NDIM={_wire.MAX_NDIM}. Flatten leading axes."
            )
        nbytes = opts.serialized_size(stored, name)
        plans.append(GroupPlan(f.shape, stored, name, nbytes, f, kv_order))
    return plans


def _options_of(options) -> tq_jax.Options:
    if isinstance(options, tq_jax.Options):
        return options
    return tq_jax.encode_options(bits=options, norm_dtype="float16")


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


# ----------------------------------------------------------------------------- key binding

# The frame's facts live in the dependency-free tq_jax._src.frames, which the CLI reads too.
KEY_TRAILER_MAGIC = _frames.KEY_TRAILER_MAGIC  # b"TQK1"
KEY_DIGEST_BYTES = _frames.KEY_DIGEST_BYTES  # 16
KEY_TRAILER_BYTES = _frames.KEY_TRAILER_BYTES
"""Bytes a key-bound value carries after its blob(s): ``b"TQK1"`` + BLAKE2b-128 of the key."""


class KeyMismatchError(ValueError):
    """A stored value was not written for the key it was read under (or lost its trailer)."""


KEY_MISMATCH = (
    "refused the value read under key {key}: {why}. It was written for another key (values "
    "swapped or copied between keys, another tenant's entry) or damaged in the store; it is "
    "reported as a miss and never decoded. Nothing to fix if rare; if every load fails, check "
    "that all writers use the same checksum preset."
)
NOT_CHECKSUMMED = (
    "refused the value read under key {key}: group {group}'s TQ01 blob has no CRC32 trailer, but "
    "this serde's preset has checksum=True, so every value it reads must carry one (a value written "
    "by a serde without checksum, or by another tool). Give all writers of this store the same preset."
)


def object_key_bytes(key: ObjectKey) -> bytes:
    """A canonical, unambiguous encoding of every field of an ``ObjectKey``.

    Length-prefixed model name, chunk hash and cache salt, and the rank and group as
    decimal strings, under a fixed prefix; what :func:`key_digest` hashes and what
    :mod:`~tq_jax.bridge._src.seal` binds as AES-GCM associated data.
    """
    fields = (
        key.model_name.encode("utf-8"),
        bytes(key.chunk_hash),
        str(int(key.kv_rank)).encode(),
        str(int(key.object_group_id)).encode(),
        key.cache_salt.encode("utf-8"),
    )
    return b"tq_jax ObjectKey v1" + b"".join(len(f).to_bytes(4, "little") + f for f in fields)


def key_digest(key: ObjectKey) -> bytes:
    """BLAKE2b-128 of :func:`object_key_bytes`: the key binding of a checksummed value.

    Not a MAC (anyone may compute it): with the blob's CRC32 it catches values that
    were damaged, swapped or copied between keys by accident. Against a writer with
    intent, use the ``encrypt`` option (AES-GCM, the key as associated data).
    """
    return hashlib.blake2b(object_key_bytes(key), digest_size=KEY_DIGEST_BYTES).digest()


def describe_key(key: ObjectKey) -> str:
    """A key as LMCache's RESP/fs adapters name it: ``model@rank@group@hash[@salt]``."""
    base = f"{key.model_name}@{int(key.kv_rank):08x}@{int(key.object_group_id):x}@{bytes(key.chunk_hash).hex()}"
    return f"{base}@{key.cache_salt}" if key.cache_salt else base


def check_key_trailer(trailer: np.ndarray, key: ObjectKey) -> None:
    """Raises :class:`KeyMismatchError` unless ``trailer`` is ``key``'s trailer."""
    got = bytes(trailer)
    if len(got) < KEY_TRAILER_BYTES:
        raise KeyMismatchError(KEY_MISMATCH.format(key=describe_key(key), why=f"the value ends {KEY_TRAILER_BYTES - len(got)} bytes before its key trailer (truncated)"))
    if got[: len(KEY_TRAILER_MAGIC)] != KEY_TRAILER_MAGIC:
        raise KeyMismatchError(KEY_MISMATCH.format(key=describe_key(key), why="the key trailer is missing or damaged"))
    if not hmac.compare_digest(got[len(KEY_TRAILER_MAGIC) : KEY_TRAILER_BYTES], key_digest(key)):
        raise KeyMismatchError(KEY_MISMATCH.format(key=describe_key(key), why="the key trailer names another key"))


def write_bytes(dst: MemoryObj, need: int, fill, layout: MemoryLayoutDesc | None = None) -> int:
    """Lets ``fill(out)`` write ``need`` bytes into ``dst``'s uint8 buffer; returns ``need``.

    ``out`` is a numpy view of ``dst`` when it is host memory, else a host buffer copied
    to ``dst`` afterwards.

    Raises:
        ValueError: ``dst`` is not uint8 or holds fewer than ``need`` bytes.
    """
    out_t = dst.tensor
    if out_t.dtype != torch.uint8:
        raise ValueError(DST_NOT_UINT8.format(dtype=out_t.dtype))
    if out_t.numel() < need:
        raise ValueError(DST_TOO_SMALL.format(have=out_t.numel(), layout=[list(s) for s in (layout.shapes if layout else dst.get_shapes())], need=need))
    on_host = out_t.device.type == "cpu"
    out = dlpack.numpy_view(out_t.reshape(-1)) if on_host else np.empty(need, np.uint8)
    fill(out[:need])
    if not on_host:
        out_t.reshape(-1)[:need].copy_(torch.from_numpy(out))
    return need


def read_bytes(src: MemoryObj) -> np.ndarray:
    """A 1-D uint8 host view (or copy, off the host) of a byte ``MemoryObj``.

    Raises:
        ValueError: ``src`` is not uint8.
    """
    if src.tensor.dtype != torch.uint8:
        raise ValueError(SRC_NOT_UINT8.format(dtype=src.tensor.dtype))
    return _host_bytes(src.tensor)


# ----------------------------------------------------------------------------- serde


class TQJaxSerializer(Serializer):
    """Encodes KV ``MemoryObj``s into TQ01 blobs (see the module docstring).

    With the defaults every blob is TQ01 version 1, which the reference plugin reads;
    a non-default value of any version-2 option (per-K/V bits, raw edge layers, the
    fast rotation, float32 norms, log-coded norms, norm correction, checksum) writes
    version 2.

    The keyword arguments are the codec rows of the bridge's option table
    (:data:`tq_jax.bridge._src.schema.OPTIONS`): ``head_dim``, ``bits``, ``seed`` and every
    :class:`tq_jax.Options` field, each checked by its row (same defaults, same errors
    as the LMCache serde dict).

    Args:
        head_dim: vector length; the last axis of every group is split into
            ``(X // head_dim, head_dim)``.
        bits: bits per coordinate, 1..8 (2, 3, 4, 6, 8 stay version 1).
        seed: rotation seed (int32 range); readers take it from the blob.
        device: ``"cpu"`` (default), ``"gpu"``, ``"tpu"``, ``"auto"``, optionally
            ``":index"``, or a ``jax.Device``.
        kv_layout: how the chunk's axes hold keys and values (:data:`KV_LAYOUTS`;
            :mod:`~tq_jax.bridge._src.layouts`): ``"auto"`` (default), ``"split"``,
            ``"fused"``, ``"vllm-cpu"`` or ``"latent"``.
        block_size: vLLM's block size, for ``kv_layout="vllm-cpu"`` (default 128,
            vLLM's CPU default).
        paired: what ``kv_layout="auto"`` reads an ``[L, T, H·2·D]`` chunk as:
            ``"fused"`` (default; vLLM's GPU backends) or ``"vllm-cpu"`` (its CPU
            backend). The LMCache factory picks it by the host
            (:func:`tq_jax.bridge._src.registry.build_serde`).
        bind_key: append the key trailer (:data:`KEY_TRAILER_BYTES`) after the blob(s),
            so that a reader refuses the value under any other key. Default: on when
            ``checksum`` is (a checksummed value is then bound to its key); version-1
            values (no checksum) stay the reference plugin's exact bytes.
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

    def __init__(self, head_dim: int = 128, bits: int = 4, seed: int = 42, device="cpu", *, kv_layout: str = "auto",
                 block_size: int = 128, paired: str = "fused", bind_key: bool | None = None, **options) -> None:
        self.options = codec_options_for(head_dim=head_dim, bits=bits, seed=seed, **options)
        check_values({"kv_layout": kv_layout, "block_size": block_size})
        self.kv_layout, self.block_size, self.paired = kv_layout, block_size, _check_paired(paired)
        self.head_dim = head_dim
        self.bits = bits
        self.seed = seed
        self.device = device if isinstance(device, jax.Device) else resolve_device(device)
        self.bind_key = self.options.checksum if bind_key is None else bool(bind_key)
        self.on_plan = None  # called with (shapes, dtypes) of every layout planned (the registry's warm-up remembers them)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """Exact byte length of :meth:`serialize`'s output for ``layout_desc``.

        Raises:
            ValueError: the layout cannot be stored (see :func:`plan_layout`).
        """
        blobs = sum(p.nbytes for p in self.plan(layout_desc))
        return blobs + (KEY_TRAILER_BYTES if self.bind_key else 0)

    def plan(self, layout_desc: MemoryLayoutDesc) -> list[GroupPlan]:
        """:func:`plan_layout` under this serializer's options and ``kv_layout``."""
        plans = plan_layout(layout_desc, self.head_dim, self.options, self.kv_layout, self.block_size, self.paired)
        if self.on_plan is not None:
            self.on_plan(layout_desc.shapes, layout_desc.dtypes)
        return plans

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Writes the TQ01 blob(s) of ``src`` (and the key trailer) into ``dst.tensor``.

        Args:
            src: the KV object (any number of groups; bfloat16/float16/float32).
            dst: a uint8 byte buffer of at least ``estimate_serialized_size`` bytes.
            key: the object's key; bound into the value when ``bind_key``.

        Returns:
            Exactly ``estimate_serialized_size(layout of src)``.

        Raises:
            ValueError: unsupported layout, ``dst`` not uint8 or too small, or a vector
                norm beyond float16's range (``tq_jax.NormOverflowError``).
        """
        layout = _layout_of(src)
        need = self.estimate_serialized_size(layout)
        return write_bytes(dst, need, lambda out: self.encode_into(src, out, key), layout)

    def encode_into(self, src: MemoryObj, out: np.ndarray, key: ObjectKey) -> int:
        """:meth:`serialize` into a host uint8 array ``out`` of at least the estimate."""
        plans = self.plan(_layout_of(src))
        off = 0
        for g, (t, p) in enumerate(zip(_group_tensors(src), plans)):
            if tuple(t.shape) != p.shape or _TORCH_DTYPE_NAMES.get(t.dtype) != p.dtype:
                raise ValueError(
                    SRC_LAYOUT_CHANGED.format(group=g, shape=list(t.shape), dtype=t.dtype, want_shape=list(p.shape), want_dtype=p.dtype)
                )
            if t.device.type == "cpu":
                x = dlpack.numpy_view(t.contiguous())  # a view of L1 memory
            else:
                x = dlpack.to_jax(t)  # stays on its accelerator
            x = layouts.to_stored(x, p.form, p.kv_order)  # a view, or K/V order read once by the encoder
            n = tq_jax.dump_into(x, out[off : off + p.nbytes], options=self.options, device=self.device)
            if n != p.nbytes:  # the core promises serialized_size; keep LMCache's fs contract safe
                raise RuntimeError(f"tq_jax.dump_into wrote {n} bytes for group {g}, expected {p.nbytes}")
            off += n
        if self.bind_key:
            out[off : off + len(KEY_TRAILER_MAGIC)] = np.frombuffer(KEY_TRAILER_MAGIC, np.uint8)
            out[off + len(KEY_TRAILER_MAGIC) : off + KEY_TRAILER_BYTES] = np.frombuffer(key_digest(key), np.uint8)
            off += KEY_TRAILER_BYTES
        return off


class TQJaxDeserializer(Deserializer):
    """Decodes TQ01 blobs (ours or the reference's, QJL included) into KV ``MemoryObj``s.

    All codec parameters come from the blob headers; only where to compute, and whether
    values must be bound to their key, is configured.

    A blob in K/V order (:mod:`~tq_jax.bridge._src.layouts`) is put back in the chunk's own
    order, which needs the writer's ``kv_layout`` (and ``block_size``); a blob whose shape
    fits neither order of this reader's layout is refused as a shape mismatch.

    Args:
        device: as for :class:`TQJaxSerializer`.
        kv_layout, block_size, paired: as for :class:`TQJaxSerializer`: build it like
            the serializer writing the store.
        bind_key: every value must carry CRC32-checked blobs and the trailer of the key
            it is read under (:class:`KeyMismatchError` otherwise); checked before
            anything is decoded. Build it like the serializer writing the store.
    """

    def __init__(self, device="cpu", *, kv_layout: str = "auto", block_size: int = 128, paired: str = "fused",
                 bind_key: bool = False) -> None:
        check_values({"kv_layout": kv_layout, "block_size": block_size})
        self.kv_layout, self.block_size, self.paired = kv_layout, block_size, _check_paired(paired)
        self.device = device if isinstance(device, jax.Device) else resolve_device(device)
        self.bind_key = bool(bind_key)

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Decodes ``src``'s blob(s) into ``dst``'s tensors in place, whatever their float dtype.

        Raises:
            tq_jax.WireError: a blob is malformed or shorter than its header declares.
            KeyMismatchError: ``bind_key`` and the value is not bound to ``key``.
            ValueError: ``src`` is not uint8, or a blob's shape does not match ``dst``.
        """
        self.decode_from(read_bytes(src), dst, key)

    def decode_from(self, buf: np.ndarray, dst: MemoryObj, key: ObjectKey) -> None:
        """:meth:`deserialize` from a host uint8 array holding the stored value."""
        tensors = _group_tensors(dst)
        spans, off = [], 0
        for g, t in enumerate(tensors):  # every header first: nothing is decoded from a refused value
            if t.dtype not in _TORCH_DTYPE_NAMES:
                raise ValueError(DST_NOT_FLOAT.format(group=g, dtype=t.dtype))
            # The decode below verifies a blob's CRC32 before writing its group; only the
            # groups after the first need it here, before group 0 is written.
            h = tq_jax.peek_header(buf[off:], verify=g > 0)
            if self.bind_key and not h.checksum:
                raise KeyMismatchError(NOT_CHECKSUMMED.format(key=describe_key(key), group=g))
            n = _blob_nbytes(h)
            f, kv_order = self._form_of(h, tuple(t.shape), g)
            spans.append((off, n, f, kv_order))
            off += n
        if self.bind_key:
            check_key_trailer(buf[off : off + KEY_TRAILER_BYTES], key)
        for t, (off, n, f, kv_order) in zip(tensors, spans):
            blob = buf[off : off + n]  # the parser raises TruncatedError if buf is short
            on_host = t.device.type == "cpu" and t.is_contiguous()
            if on_host and not kv_order:
                tq_jax.load_into(blob, dlpack.numpy_view(t), device=self.device)
                continue
            if on_host:  # decoded into this thread's scratch, then reordered into the chunk
                y = _scratch(f.stored(kv_order), dlpack.numpy_dtype(t.dtype))
                tq_jax.load_into(blob, y, device=self.device)
                layouts.restore_into(y, f, kv_order, dlpack.numpy_view(t))
                continue
            arr = tq_jax.loads(blob, dtype=dlpack.numpy_dtype(t.dtype), device=self.device)
            dlpack.copy_into(t, layouts.from_stored(arr, f, kv_order))

    def _form_of(self, h: tq_jax.Header, dst_shape: tuple[int, ...], group: int):
        """``(form, kv_order)`` of a blob read into a destination group: which of the
        reader layout's two stored orders the blob's shape is (ValueError: neither)."""
        try:
            f = layouts.form(dst_shape, h.shape[-1], self.kv_layout, self.block_size, group=group, paired=self.paired)
        except ValueError:
            f = None  # the blob's head_dim does not fit the destination at all
        kv_order = None if f is None else layouts.which(f, h.shape)
        if kv_order is None:
            raise ValueError(
                SHAPE_MISMATCH.format(group=group, blob_shape=list(h.shape), blob_dtype=h.dtype, bits=h.bits, dst_shape=list(dst_shape))
            )
        return f, kv_order


_SCRATCH = threading.local()


def _scratch(shape, dtype) -> np.ndarray:
    """This thread's reusable 64-byte-aligned host buffer as a ``shape`` array of ``dtype``.

    A value whose stored order is not the chunk's is decoded here and then reordered
    into the chunk: reusing one buffer per thread (the size of the largest chunk it has
    read, whose shape LMCache chose) spares every call a chunk-sized allocation and its
    page faults, which concurrent workers would otherwise take on every hit."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH.buf = _blocks.aligned_empty((nbytes,), np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def _check_paired(paired: str) -> str:
    if paired not in layouts.PAIRED:
        raise ValueError(f"paired must be one of {layouts.PAIRED} (what kv_layout 'auto' reads an [L, T, H*2*D] chunk as), "
                         f"got {paired!r}.")
    return paired


def _blob_nbytes(h: tq_jax.Header) -> int:
    """A blob's full length (trailer included), from its header alone."""
    return _wire.blob_nbytes(h)
