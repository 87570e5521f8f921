"""What a tensor file holds, read from headers only: the engine of ``tq-jax inspect``.

:func:`describe` reads a safetensors file (compressed by tq-jax or not), a ``.npy`` /
``.npz`` file, or a bare TQ01 blob, and returns a JSON-ready description;
:func:`render` formats it as the command's table. Nothing is decoded.
"""

from __future__ import annotations

import math
import os
import types

import numpy as np

from tq_jax import safetensors_io as _st
from tq_jax import wire as _wire
from tq_jax.batch.errors import BatchError
from tq_jax.batch.metadata import META_KEY, TQ_DTYPES, blob_headers, read_tq_metadata
from tq_jax.batch.sources import check_input, open_source

__all__ = ["describe", "render", "header_labels", "options_label"]


def header_labels(h) -> tuple[str, str]:
    """(bits, other options) of a TQ01 header, compactly: ("4/3", "raw 2+2, hadamard, f32 norms")."""
    kv = h.kv_layout
    bits = f"{h.bits}/{h.value_bits}" if kv and h.value_bits != h.bits else str(h.bits)
    return bits, options_label(
        skip_first_layers=h.skip_first if kv else 0,
        skip_last_layers=h.skip_last if kv else 0,
        rotation=h.rotation, norm_dtype=h.norm_dtype, norm_bits=h.norm_bits,
        norm_correction=h.norm_correction, checksum=h.checksum, qjl=h.use_qjl,
    )


def options_label(**o) -> str:
    out = []
    if o.get("skip_first_layers") or o.get("skip_last_layers"):
        out.append(f"raw {o.get('skip_first_layers', 0)}+{o.get('skip_last_layers', 0)}")
    if o.get("rotation", "haar") != "haar":
        out.append(o["rotation"])
    if o.get("norm_dtype") == "float32":
        out.append("f32 norms")
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
    Nothing is decoded: only headers are read.

    Raises:
        BatchError: the file is not a readable tensor file, or a bare TQ01 blob is
            corrupt or truncated (a blob's length follows from its header).
    """
    path = check_input(path)
    with open(path, "rb") as f:
        magic = f.read(len(_wire.MAGIC))
        size = os.fstat(f.fileno()).st_size
    if magic == _wire.MAGIC:  # a bare blob (memory-mapped: a v2 checksum covers all of it)
        try:
            h = _wire.peek_header(np.memmap(path, np.uint8, mode="r"))
        except _wire.WireError as e:
            raise BatchError(f"{path}: corrupt TQ01 blob: {e}") from None
        need = _wire.blob_nbytes(h)
        if size != need:
            what = "truncated" if size < need else f"followed by {size - need:,} bytes that are not part of it"
            raise BatchError(
                f"{path}: corrupt TQ01 blob: its header declares {need:,} bytes (shape {list(h.shape)}, "
                f"{h.bits} bits) but the file holds {size:,}: the blob is {what}. Re-copy or re-create the file."
            )
        orig = math.prod(h.shape) * _st.DTYPES[TQ_DTYPES[_wire.DTYPES.index(h.dtype)]].itemsize
        bits, opts = header_labels(h)
        return {"file": path, "kind": "TQ01 blob", "bytes": size, "tensors": [{
            "name": os.path.basename(path), "kind": "TQ01", "dtype": h.dtype, "shape": list(h.shape),
            "bits": bits, "seed": h.seed, "version": h.version, "options": opts, "blobs": 1,
            "stored_bytes": size, "original_bytes": orig, "ratio": orig / size if size else None,
            "blob_headers": [h._asdict()],
        }]}
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


def _cell(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def render(doc: dict, verbose: bool = False) -> str:
    """:func:`describe`'s ``doc`` as the table ``tq-jax inspect`` prints (``verbose``: one
    line per blob too)."""
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
