"""What a tensor file holds, read from headers only: the engine of ``tq-jax inspect``.

:func:`describe` reads a safetensors file (compressed by tq-jax or not), a ``.npy`` /
``.npz`` file, a bare TQ01 blob, or a value an LMCache L2 adapter stored through the
tq_jax serde (saved to a file: an ``fs`` file, or a Redis value): the blob(s) with the
key trailer of the checksum presets, or a sealed value (``encrypt``; the frames are
:mod:`tq_jax._src.frames`). It returns a JSON-ready description; :func:`render` formats it
as the command's table. Nothing is decoded, and nothing is verified that needs the
ObjectKey (the key trailer's digest) or the master key (a sealed value).
"""

from __future__ import annotations

import math
import os
import types

import numpy as np

from tq_jax._src import frames as _frames
from tq_jax._src import safetensors_io as _st
from tq_jax._src import wire as _wire
from tq_jax._src.batch.errors import BatchError
from tq_jax._src.batch.metadata import META_KEY, TQ_DTYPES, blob_headers, read_tq_metadata
from tq_jax._src.batch.sources import check_input, open_source

__all__ = ["describe", "render", "header_labels", "options_label"]


def header_labels(h) -> tuple[str, str]:
    """(bits, other options) of a TQ01 header, compactly: ("4/3", "raw 2+2, hadamard, f32 norms")."""
    kv = h.kv_layout
    bits = f"{h.bits}/{h.value_bits}" if kv and h.value_bits != h.bits else str(h.bits)
    return bits, options_label(
        skip_first_layers=h.skip_first if kv else 0,
        skip_last_layers=h.skip_last if kv else 0,
        rotation=h.rotation, norm_dtype=h.norm_dtype, norm_bits=h.norm_bits,
        norm_correction=h.norm_correction, checksum=h.checksum, qjl=h.use_qjl, trellis=h.trellis,
    )


def options_label(**o) -> str:
    out = []
    if o.get("skip_first_layers") or o.get("skip_last_layers"):
        out.append(f"raw {o.get('skip_first_layers', 0)}+{o.get('skip_last_layers', 0)}")
    if o.get("rotation", "haar") != "haar":
        out.append(o["rotation"])
    if o.get("norm_dtype") == "float32":
        out.append("f32 norms")
    if o.get("trellis"):
        out.append("trellis")
    if o.get("norm_bits"):
        out.append(f"{o['norm_bits']}-bit log norms")
    if o.get("norm_correction"):
        out.append("norm corr")
    if o.get("checksum"):
        out.append("crc32")
    if o.get("qjl"):
        out.append("qjl")
    return ", ".join(out) or "-"


def describe(path: str) -> dict:
    """What ``tq-jax inspect`` reports about ``path``, as a JSON-ready dict: the file's
    kind and size, its user metadata, and one row per tensor (kind, dtype, shape, bits,
    seed, version, options, blobs, stored and original bytes, ratio, blob headers).
    Nothing is decoded: only headers are read. A stored L2 value adds ``key_binding``
    (the key trailer's digest, not verified) or is ``sealed`` (frame and sizes only).

    Raises:
        BatchError: the file is not a readable tensor file, a bare TQ01 blob is
            corrupt or truncated (a blob's length follows from its header), or a stored
            value's blobs are not followed by exactly nothing, another blob or a key trailer.
    """
    path = check_input(path)
    with open(path, "rb") as f:
        head = f.read(_frames.SEAL_OVERHEAD)
        size = os.fstat(f.fileno()).st_size
    version = _frames.sealed_version(head)
    if version is not None:
        return _describe_sealed(path, size, version)
    if head[:4] in _frames.SEAL_MAGICS:
        raise BatchError(f"{path}: a sealed L2 value ({head[:4].decode()}) cut short: {size} bytes, fewer than the "
                         f"{_frames.SEAL_OVERHEAD} of its frame alone. Re-copy the value from the store.")
    if head[: len(_wire.MAGIC)] == _wire.MAGIC:  # a bare blob, or blobs + a key trailer
        return _describe_blobs(path, size)
    with open_source(path) as src:
        doc = read_tq_metadata(src)
        metas = doc["tensors"] if doc else {}
        rows = []
        for info in src.tensors.values():
            meta = metas.get(info.name)
            if meta is None:
                rows.append({"name": info.name, "kind": "raw", "dtype": info.dtype, "shape": list(info.shape),
                             "stored_bytes": info.nbytes, "original_bytes": info.nbytes, "ratio": 1.0})
                continue
            headers = blob_headers(src, info.name, meta)
            hs = [h for _, _, h in headers]
            orig = math.prod(meta["shape"]) * _st.DTYPES[meta["dtype"]].itemsize
            o = meta.get("options") if isinstance(meta.get("options"), dict) else {}
            if o:  # what the writer asked for (chunks of a KV tensor carry their local share)
                kb, vb = o.get("key_bits"), o.get("value_bits")
                bits = str(kb) if kb == vb else f"{kb}/{vb}"
                opts = options_label(**o, qjl=any(h.use_qjl for h in hs))
            else:
                labels = sorted({header_labels(h) for h in hs})
                bits, opts = ",".join(sorted({b for b, _ in labels})), "; ".join(sorted({x for _, x in labels}))
            seeds = sorted({h.seed for h in hs})
            versions = sorted({h.version for h in hs})
            rows.append({
                "name": info.name, "kind": "TQ01", "dtype": meta["dtype"], "shape": meta["shape"],
                "bits": bits, "seed": seeds[0] if len(seeds) == 1 else seeds,
                "version": versions[0] if len(versions) == 1 else versions, "options": opts,
                "blobs": len(hs), "stored_bytes": info.nbytes, "original_bytes": orig,
                "ratio": orig / info.nbytes if info.nbytes else None,
                "blob_headers": [dict(h._asdict(), offset=off, nbytes=nb) for off, nb, h in headers],
            })
        user_meta = {k: v for k, v in src.metadata.items() if k != META_KEY}
        return {"file": path, "kind": f"tq-jax {src.kind}" if doc else src.kind, "bytes": size,
                "format_version": doc["version"] if doc else None, "metadata": user_meta, "tensors": rows}


SEALED_NOTE = (
    "encrypted per tenant (AES-GCM, the ObjectKey bound as associated data): the TQ01 header is inside the "
    "ciphertext, so nothing more can be shown without the master key; the LMCache serde with the same "
    "`encrypt` block opens it"
)


def _describe_sealed(path: str, size: int, version: int) -> dict:
    magic = _frames.SEAL_V1_MAGIC if version == 1 else _frames.SEAL_V2_MAGIC
    return {"file": path, "kind": f"sealed L2 value ({magic.decode()})", "bytes": size, "tensors": [],
            "sealed": {"frame": magic.decode(), "plaintext_bytes": size - _frames.SEAL_OVERHEAD,
                       "overhead_bytes": _frames.SEAL_OVERHEAD, "note": SEALED_NOTE}}


def _corrupt(path: str, end: int, size: int, h, what: str = "") -> BatchError:
    what = what or ("truncated" if size < end else f"followed by {size - end:,} bytes that are not part of it")
    return BatchError(
        f"{path}: corrupt TQ01 blob: its header declares {end:,} bytes (shape {list(h.shape)}, "
        f"{h.bits} bits) but the file holds {size:,}: the blob is {what}. Re-copy or re-create the file."
    )


def _describe_blobs(path: str, size: int) -> dict:
    """A bare blob, or what the LMCache serde stores: blob(s) back to back (one per KV
    group), then the key trailer when the preset checksums. Every header is read (memory-
    mapped: a v2 checksum covers its whole blob); the trailer's digest is shown, not checked."""
    mm = np.memmap(path, np.uint8, mode="r")
    blobs, off, trailer = [], 0, None
    while True:
        try:
            h = _wire.peek_header(mm[off:])
        except _wire.WireError as e:
            raise BatchError(f"{path}: corrupt TQ01 blob{f' at byte {off:,}' if off else ''}: {e}") from None
        end = off + _wire.blob_nbytes(h)
        blobs.append((off, end - off, h))
        rest = size - end
        if rest <= 0:
            if rest < 0:
                raise _corrupt(path, end, size, h)
            break
        tail = bytes(mm[end : end + len(_wire.MAGIC)])
        if _frames.ends_with_key_trailer(mm[end:], 0):
            trailer = bytes(mm[end + len(_frames.KEY_TRAILER_MAGIC) : size])
            break
        if tail == _frames.KEY_TRAILER_MAGIC:
            raise _corrupt(path, end, size, h, f"followed by a damaged key trailer ({rest:,} bytes; a key trailer is "
                                               f"{_frames.KEY_TRAILER_BYTES})")
        if tail != _wire.MAGIC:
            raise _corrupt(path, end, size, h)
        off = end
    rows = []
    for i, (o, n, h) in enumerate(blobs):
        orig = math.prod(h.shape) * _st.DTYPES[TQ_DTYPES[_wire.DTYPES.index(h.dtype)]].itemsize
        bits, opts = header_labels(h)
        name = os.path.basename(path) if len(blobs) == 1 else f"group {i}"
        rows.append({
            "name": name, "kind": "TQ01", "dtype": h.dtype, "shape": list(h.shape),
            "bits": bits, "seed": h.seed, "version": h.version, "options": opts, "blobs": 1,
            "stored_bytes": n, "original_bytes": orig, "ratio": orig / n if n else None,
            "blob_headers": [dict(h._asdict(), offset=o, nbytes=n)],
        })
    if trailer is None and len(blobs) == 1:
        return {"file": path, "kind": "TQ01 blob", "bytes": size, "tensors": rows}
    doc = {"file": path, "kind": "L2 value" if trailer is None else "key-bound L2 value", "bytes": size, "tensors": rows}
    if trailer is not None:
        doc["key_binding"] = {"trailer": _frames.KEY_TRAILER_MAGIC.decode(), "algorithm": "BLAKE2b-128",
                              "digest": trailer.hex(), "verified": False}
    return doc


def _cell(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def render(doc: dict, verbose: bool = False) -> str:
    """:func:`describe`'s ``doc`` as the table ``tq-jax inspect`` prints (``verbose``: one
    line per blob too)."""
    if doc.get("sealed"):
        s = doc["sealed"]
        return (f"{doc['file']}: {doc['kind']}, {doc['bytes']:,} bytes: {s['note']}.\n"
                f"  frame {s['frame']}: {s['overhead_bytes']} bytes of frame (magic, salt or nonce, tag) around "
                f"{s['plaintext_bytes']:,} bytes of TQ01 blob(s)")
    lines = []
    rows = [["name", "kind", "dtype", "shape", "bits", "seed", "ver", "blobs", "stored", "original", "ratio",
             "options"]]
    for t in doc["tensors"]:
        tq = t["kind"] == "TQ01"
        rows.append([
            t["name"], t["kind"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar",
            _cell(t["bits"]) if tq else "-", _cell(t["seed"]) if tq else "-", _cell(t["version"]) if tq else "-",
            str(t["blobs"]) if tq else "-", f"{t['stored_bytes']:,}", f"{t['original_bytes']:,}",
            f"{t['ratio']:.2f}x" if t["ratio"] else "-", t["options"] if tq else "",
        ])
        if verbose and tq:
            for i, h in enumerate(t["blob_headers"]):
                bits, opts = header_labels(types.SimpleNamespace(**h))
                rows.append([f"  blob {i}", "", h["dtype"], "x".join(map(str, h["shape"])), bits,
                             str(h["seed"]), str(h["version"]), "", f"{h.get('nbytes', doc['bytes']):,}", "", "",
                             opts])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines.append(f"{doc['file']}: {doc['kind']}, {doc['bytes']:,} bytes, {len(doc['tensors'])} tensor(s)")
    if doc.get("key_binding"):
        kb = doc["key_binding"]
        lines.append(f"  bound to a key ({kb['algorithm']} {kb['digest']}, the {kb['trailer']} trailer): the LMCache "
                     f"serde checks it against the ObjectKey on load; not verified here")
    for k, v in (doc.get("metadata") or {}).items():
        lines.append(f"  metadata {k} = {v if len(v) <= 80 else v[:77] + '...'}")
    for r in rows:
        cells = [c.ljust(w) if i < 4 or i == 11 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  " + "  ".join(cells).rstrip())
    stored = sum(t["stored_bytes"] for t in doc["tensors"])
    orig = sum(t["original_bytes"] for t in doc["tensors"])
    n_tq = sum(t["kind"] == "TQ01" for t in doc["tensors"])
    lines.append(f"total: {n_tq} TQ01 tensor(s), {len(doc['tensors']) - n_tq} raw; {stored:,} bytes stored, "
                 f"{orig:,} original" + (f" ({orig / stored:.2f}x)" if stored else ""))
    return "\n".join(lines)
