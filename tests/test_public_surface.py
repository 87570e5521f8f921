"""The public surface is small and curated; everything else lives in the private cores
(``tq_jax/_src``, ``bridge/_src``), read from source so no optional extra is needed.

A public module is one whose dotted path has no component with a leading underscore;
its public names are its ``__all__``. Removed Python spellings raise errors that show
their replacement (tests/test_settings_front_door.py)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import tq_jax

ROOT = Path(__file__).resolve().parent.parent
MAX_PUBLIC_NAMES = 80
EXECUTORS = {"program", "resident", "blocks", "plan", "blob", "codec"}


def _public_modules() -> dict[str, Path]:
    out = {}
    for top, pkg in (("tq_jax", "tq_jax"), ("bridge", "tq_jax.bridge")):
        base = ROOT / top
        for dirpath, dirnames, files in os.walk(base):
            rel = Path(dirpath).relative_to(base)
            dirnames[:] = [d for d in dirnames if not d.startswith("_") and not (top == "tq_jax" and d == "bridge")]
            for f in files:
                if f.endswith(".py") and (f == "__init__.py" or not f.startswith("_")):
                    parts = [pkg, *rel.parts] + ([] if f == "__init__.py" else [f[:-3]])
                    out[".".join(parts)] = Path(dirpath) / f
    return out


def _all(path: Path) -> tuple[str, ...]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            if path == ROOT / "tq_jax" / "__init__.py":
                return tuple(tq_jax.__all__)  # computed from the façade's table
            return tuple(ast.literal_eval(node.value))
    return ()


def test_public_names_total_at_most_80():
    modules = _public_modules()
    counts = {name: len(_all(path)) for name, path in modules.items()}
    assert set(counts) == {
        "tq_jax", "tq_jax.wire", "tq_jax.cli", "tq_jax.kvcache", "tq_jax.kvcache.ragged", "tq_jax.batch",
        "tq_jax.adapters", "tq_jax.adapters.easydel", "tq_jax.bridge", "tq_jax.bridge.launch",
        "tq_jax.bridge.plugin", "tq_jax.bridge.smoke",
    }, sorted(counts)
    assert sum(counts.values()) <= MAX_PUBLIC_NAMES, counts


def test_every_public_name_is_defined_where_it_is_listed():
    import importlib

    for name, path in _public_modules().items():
        if name.startswith(("tq_jax.bridge", "tq_jax.adapters.")):
            continue  # optional extras (lmcache, easydel): the bridge's names are checked in its own tests
        module = importlib.import_module(name)
        for attr in _all(path):
            assert hasattr(module, attr), f"{name}.{attr}"


def test_dir_of_the_package_shows_no_executor_or_private_core():
    names = set(dir(tq_jax))
    assert not names & EXECUTORS and not any(n.startswith("_") and not n.startswith("__") for n in names), names
    assert {"kvcache", "wire", "batch", "cli", "bridge"} <= names
    assert tq_jax._src.codec.CodecConfig is tq_jax.CodecConfig  # the core stays reachable for tests and tools
