"""Tests import references from the package, never from each other or from a study.

A reference another test imports from a test module runs that module's collection-time
code and ties two files' fixtures together; a study (``benchmarks/studies/``) answered a
question once and is not the library. The references live in the package
(``tq_jax._src.kvcache.reference``), shared fixtures in helper modules that are not tests
(``conftest.py``, ``kvcache_helpers.py``, ``device_path_helpers.py``, ...). Checked from the
sources of every ``tests/*.py``, imports inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FORBIDDEN_PACKAGES = ("benchmarks.studies",)


def _imported(tree: ast.AST) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``tree`` names (``from a import b``
    names both ``a`` and ``a.b``: ``b`` may be a submodule)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            out.add(base)
            out |= {f"{base}.{a.name}" if node.module else base + a.name for a in node.names}
    return out


def offences(source: str) -> list[str]:
    """The modules ``source`` imports that a test may not: another test module
    (``test_*``, also as ``tests.test_*`` or relative) or a study."""
    bad = []
    for name in sorted(_imported(ast.parse(source))):
        parts = name.lstrip(".").split(".")
        if parts[-1].startswith("test_") and parts[:-1] in ([], ["tests"]):
            bad.append(name)
        elif any(name == p or name.startswith(p + ".") for p in FORBIDDEN_PACKAGES):
            bad.append(name)
    return [n for n in bad if not any(n.startswith(m + ".") for m in bad)]  # a module, not each name from it


def test_the_check_sees_each_kind_of_import():
    assert offences("from test_kvcache import dense_attention") == ["test_kvcache"]
    assert offences("def f():\n    import test_program") == ["test_program"]
    assert offences("from tests import test_wire") == ["tests.test_wire"]
    assert offences("from . import test_wire") == [".test_wire"]
    assert offences("from benchmarks.studies.passkey_key_floor import waterfill") == [
        "benchmarks.studies.passkey_key_floor"]
    assert offences("from benchmarks import studies") == ["benchmarks.studies"]
    assert offences("from kvcache_helpers import fill\nfrom tq_jax.kvcache import reference\n"
                    "from benchmarks import timing\nimport conftest") == []


def test_no_test_imports_another_test_or_a_study():
    paths = sorted(TESTS.glob("*.py"))
    assert len(paths) > 30 and TESTS / "test_kvcache.py" in paths
    found = {f"tests/{p.name}": bad for p in paths if (bad := offences(p.read_text()))}
    assert not found, (
        f"tests import other tests or studies: {found}. Import references from the package "
        "(tq_jax._src.kvcache.reference) and shared fixtures from a helper module that is not a test "
        "(conftest.py, kvcache_helpers.py, ...)."
    )
