"""Where code lives: no import cycles, no use of another module's private names, no
oversized modules — checked over every module of tq_jax/** and bridge/** (installed as
``tq_jax.bridge``) from their source, function-local and ``TYPE_CHECKING`` imports
included.

Rules (docs/architecture.md):

* An *edge* A → B is any import of B in A, wherever it sits (module level, inside a
  function, under ``TYPE_CHECKING``), a string naming B handed to a call (the CLI's
  ``_OnFirstUse("tq_jax._src.batch")``, ``importlib.import_module``), and a public name read
  through the package (``import tq_jax; tq_jax.dumps`` is an edge to ``tq_jax._src.blob``,
  by ``tq_jax._EXPORTS``). The package ``tq_jax/__init__.py`` itself is a lazy façade
  (PEP 562: it imports nothing until a name is read), so it has no outgoing edges.
* A *private name* is one with a single leading underscore. A module may use its own,
  and may import a private *module* of the package (``_kernels``, ``_lru``: package
  internals with public names of their own), but never read ``_name`` from another
  module.
* No module over :data:`MAX_LINES` lines, except ``tq_jax/_src/wire.py`` (the one parser).

``KNOWN`` lists known offences still being removed (none now). A listed offence that no
longer occurs fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 650
LONG_ALLOWED = {"tq_jax._src.wire"}

# Known offences that are being removed (none now); a listed offence that no longer
# occurs fails too, so the list only shrinks.
KNOWN = {
    "cycles": set(),
    "private": set(),
    "long": set(),
}


def _modules() -> dict[str, Path]:
    """Module name → source file, for tq_jax/** (not its bridge link) and bridge/**."""
    out = {}
    for top, pkg in (("tq_jax", "tq_jax"), ("bridge", "tq_jax.bridge")):
        base = ROOT / top
        for dirpath, dirnames, files in os.walk(base):
            rel = Path(dirpath).relative_to(base)
            if top == "tq_jax" and rel.parts[:1] == ("bridge",):
                dirnames.clear()
                continue
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not (top == "tq_jax" and d == "bridge")]
            for f in files:
                if not f.endswith(".py"):
                    continue
                parts = [pkg, *rel.parts] + ([] if f == "__init__.py" else [f[:-3]])
                out[".".join(p for p in parts if p)] = Path(dirpath) / f
    return out


MODULES = _modules()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _exports() -> dict[str, str]:
    tree = ast.parse((ROOT / "tq_jax" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
                return ast.literal_eval(node.value)
    raise AssertionError("tq_jax/__init__.py has no _EXPORTS")


EXPORTS = _exports()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


class _Walker(ast.NodeVisitor):
    """Collects one module's edges and its reads of other modules' private names."""

    def __init__(self, name: str):
        self.name = name
        self.package = name if name in PACKAGES else name.rpartition(".")[0]
        self.edges: set[str] = set()
        self.private: set[tuple[str, str, str]] = set()
        self.aliases: dict[str, str] = {}  # local name -> module it is bound to

    def _edge(self, target: str) -> None:
        if target == "tq_jax":
            return  # names read through the façade are resolved where they are read
        if target != self.name:
            self.edges.add(target)

    def _resolve_from(self, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = self.package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _use(self, module: str, attr: str) -> None:
        """``attr`` read from ``module``: an edge, and a private-name check."""
        if module == "tq_jax":
            if attr in EXPORTS:
                self._edge(EXPORTS[attr])
            elif f"tq_jax.{attr}" in MODULES:
                self._edge(f"tq_jax.{attr}")
            return
        if f"{module}.{attr}" in MODULES:  # a submodule: private modules are package internals
            self._edge(f"{module}.{attr}")
            return
        self._edge(module)
        if _private(attr) and module != self.name:
            self.private.add((self.name, module, attr))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name in MODULES:
                self._edge(a.name)
                if a.asname:
                    self.aliases[a.asname] = a.name
                elif a.name == "tq_jax" or a.name.startswith("tq_jax."):
                    self.aliases["tq_jax"] = "tq_jax"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = self._resolve_from(node)
        if module not in MODULES:
            return
        for a in node.names:
            self._use(module, a.name)
            sub = f"{module}.{a.name}"
            if sub in MODULES:
                self.aliases[a.asname or a.name] = sub

    def _module_of(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            outer = self._module_of(node.value)
            if outer is not None and f"{outer}.{node.attr}" in MODULES:
                return f"{outer}.{node.attr}"
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        module = self._module_of(node.value)
        if module is not None:
            self._use(module, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        for arg in node.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in MODULES:
                self._edge(arg.value)
        self.generic_visit(node)


def _analyse() -> tuple[dict[str, set[str]], set[tuple[str, str, str]]]:
    graph, private = {}, set()
    for name, path in MODULES.items():
        if name == "tq_jax":
            graph[name] = set()  # the lazy façade: no import-time edges
            continue
        w = _Walker(name)
        w.visit(ast.parse(path.read_text(), str(path)))
        graph[name] = {e for e in w.edges if e in MODULES}
        private |= w.private
    return graph, private


GRAPH, PRIVATE = _analyse()


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_walker_sees_every_kind_of_import():
    """The checks below are only as good as the graph: spot-check edges of each kind."""
    assert "tq_jax._src.codec" in GRAPH["tq_jax._src.blob"]  # module level, aliased
    assert "tq_jax._src.codec" in GRAPH["tq_jax._src.options"]  # function-local (Options.codec_config)
    assert "tq_jax._src.batch" in GRAPH["tq_jax._src.cli"]  # a module named by a string (_OnFirstUse)
    assert "tq_jax._src.blob" in GRAPH["tq_jax._src.batch.plan"]  # tq_jax.serialized_size, through the façade
    assert "tq_jax.bridge._src.registry" in GRAPH["tq_jax.bridge"]  # bridge/ is tq_jax.bridge
    assert len(MODULES) > 30 and all(p.exists() for p in MODULES.values())


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = set(_cycles(GRAPH))
    assert found - KNOWN["cycles"] == set(), f"import cycles: {[sorted(c) for c in found - KNOWN['cycles']]}"
    assert KNOWN["cycles"] - found == set(), f"fixed: remove {KNOWN['cycles'] - found} from KNOWN"


def test_no_module_uses_another_modules_private_names():
    assert PRIVATE - KNOWN["private"] == set(), sorted(PRIVATE - KNOWN["private"])
    assert KNOWN["private"] - PRIVATE == set(), f"fixed: remove {KNOWN['private'] - PRIVATE} from KNOWN"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_the_line_limit(name):
    n = len(MODULES[name].read_text().splitlines())
    if name in LONG_ALLOWED:
        return
    if name in KNOWN["long"]:
        assert n > MAX_LINES, f"{name} has {n} lines now: remove it from KNOWN['long']"
        return
    assert n <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {n} lines (limit {MAX_LINES}): split it along a seam"
