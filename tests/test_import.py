"""`import tq_jax` stays pure JAX + numpy: torch and lmcache load only with the bridge."""

import os
import subprocess
import sys

import pytest


def test_import_tq_jax_does_not_import_torch_or_lmcache():
    code = (
        "import sys, tq_jax; "
        "bad = sorted(m for m in ('torch', 'lmcache') if m in sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_tq_jax_is_light_and_every_public_name_resolves():
    """`import tq_jax` loads neither numpy nor jax (the CLI installs its signal handlers
    first); each name in __all__ then loads its module on first use."""
    code = (
        "import sys, tq_jax; "
        "heavy = sorted(m for m in ('jax', 'numpy', 'jaxlib') if m in sys.modules); "
        "assert not heavy, heavy; "
        "import tq_jax._src.codec, tq_jax._src.blob, tq_jax._src.wire, tq_jax._src.options; "
        "mods = {'codec': tq_jax._src.codec, 'blob': tq_jax._src.blob, 'wire': tq_jax._src.wire, 'options': tq_jax._src.options}; "
        "assert all(getattr(tq_jax, n) is getattr(mods[tq_jax._EXPORTS[n].split('.')[-1]], n) for n in tq_jax.__all__); "
        "ns = {}; exec('from tq_jax import *', ns); "
        "assert set(tq_jax.__all__) <= set(ns), set(tq_jax.__all__) - set(ns); "
        "assert set(tq_jax.__all__) <= set(dir(tq_jax)); "
        "import pytest; "
        "pytest.raises(AttributeError, getattr, tq_jax, 'no_such_name')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow  # two fresh pytest processes
def test_ci_refuses_to_run_with_a_test_dependency_missing(tmp_path):
    """Under CI a missing test dependency stops the run instead of skipping its tests."""
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    code = (
        "import importlib.util, sys; real = importlib.util.find_spec; "
        "importlib.util.find_spec = lambda n, *a: None if n == 'safetensors' else real(n, *a); "
        "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--rootdir', sys.argv[1], "
        "'-c', sys.argv[2], sys.argv[1]]))"
    )
    conftest = os.path.join(os.path.dirname(__file__), "conftest.py")
    (tmp_path / "conftest.py").write_text(open(conftest).read())
    # conftest reads the extras from ROOT/pyproject.toml, ROOT being its folder's parent
    pyproject = os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml")
    (tmp_path.parent / "pyproject.toml").write_text(open(pyproject).read())
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    env = dict(os.environ, CI="true")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(ini)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "safetensors (extra `test`)" in r.stdout + r.stderr, r.stdout + r.stderr
    env.pop("CI")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(ini)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_norm_overflow_error_is_one_class_defined_by_the_format():
    """The format (wire) defines it; the blob layer and the package name the same class."""
    import tq_jax
    from tq_jax._src import blob, wire

    assert tq_jax.NormOverflowError is blob.NormOverflowError is wire.NormOverflowError
    assert wire.NormOverflowError.__module__ == "tq_jax._src.wire"


@pytest.mark.slow  # a fresh process; the quick tier keeps the two import checks above
def test_submodules_are_attributes_loaded_on_first_use():
    """`tq_jax.kvcache.init` works after a bare `import tq_jax`, which still loads no jax."""
    code = (
        "import sys, tq_jax; "
        "assert 'jax' not in sys.modules and 'numpy' not in sys.modules; "
        "assert 'tq_jax.kvcache' not in sys.modules and 'kvcache' in dir(tq_jax); "
        "assert 'tq_jax._src.options' not in sys.modules; "
        "import importlib; "
        "assert callable(tq_jax.kvcache.init) and tq_jax.kvcache is importlib.import_module('tq_jax.kvcache'); "
        "assert tq_jax._src.wire.parse is tq_jax.parse and tq_jax._src.options.Options is tq_jax.Options; "
        "assert 'torch' not in sys.modules; "
        "import pytest; pytest.raises(AttributeError, getattr, tq_jax, 'no_such_module')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow  # a fresh process importing torch and LMCache; the kvcache test above is the same path
def test_bridge_is_an_attribute_where_lmcache_is_installed():
    import importlib.util

    if importlib.util.find_spec("lmcache") is None:
        pytest.skip("the lmcache extra is not installed")
    code = "import tq_jax; assert tq_jax.bridge.register is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_python_floor_is_what_the_code_needs():
    """pyproject's requires-python admits no Python the sources or tests cannot run on:
    every file parses with that version's grammar, and the standard-library modules
    they import exist there (tomllib, which conftest reads pyproject.toml with, is 3.11)."""
    import ast
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = tomllib.loads((root / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = tuple(int(x) for x in re.fullmatch(r">=\s*(\d+)\.(\d+)", spec).groups())
    new_in = {"tomllib": (3, 11)}  # stdlib modules newer than 3.10 that anything imports
    files = [p for d in ("tq_jax", "bridge", "tests", "benchmarks", "tools") for p in (root / d).rglob("*.py")
             if "bridge" not in p.relative_to(root).parts[1:2] or d != "tq_jax"]
    assert len(files) > 50
    for path in files:
        tree = ast.parse(path.read_text(), str(path), feature_version=floor)
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                need = new_in.get(name.split(".")[0])
                assert need is None or need <= floor, f"{path}: imports {name} (Python {need}), floor {floor}"
