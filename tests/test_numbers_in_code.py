"""Measured numbers live in results, not in code: the docstrings and comments of tq_jax/
and bridge/ state what the code guarantees and why, not how fast it ran or on which chip.

A measurement in a docstring goes stale without anyone noticing; in
``benchmarks/results/*.md`` it stands beside the command, the commit and the machine that
produced it, and can be re-measured (docs/architecture.md, "Measured numbers"). A
docstring may name that file; it does not copy the number.

What counts as a measured number (:data:`MEASURED`, case-sensitive, on one line):

* a timing: a number with ``ns``, ``µs``, ``us`` or ``ms`` (``3ms``), or with ``s`` or
  ``seconds`` after a space (``0.25 s``; ``4s`` is a struct format or four sigmas);
* a throughput: a number with ``GiB/s``, ``GB/s``, ``MiB/s``, ``MB/s`` or ``tokens/s``;
* a speed-up or error ratio: a number or range followed by ``x`` or ``×`` (``9.6x``,
  ``1.3–2.1x``; hex such as ``0x1f`` is not one);
* an accelerator model: ``H100``, ``H200``, ``A100``, ``V100``, ``L4``, ``L40S``, ``T4``,
  ``B200``, ``GH200``, ``MI300X`` or a TPU generation (``TPU v5e``, ``v6e``).

Comments are read with :mod:`tokenize`, docstrings (module, class, function) with
:mod:`ast`; string constants that are messages are not docstrings and are not read.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tq_jax", "bridge")
ALLOWED = 3  # lines that may still carry a number while their files are being rewritten

_NUMBER = r"(?<![\w.])\d+(?:\.\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?"
MEASURED = re.compile(
    rf"{_NUMBER}\s?(?:ns|µs|us|ms)\b|{_NUMBER}\s(?:s|seconds?)\b"  # a timing
    rf"|{_NUMBER}\s?(?:GiB|GB|MiB|MB|tokens)/s\b"  # a throughput
    rf"|{_NUMBER}\s?[x×](?![\w{{])"  # a ratio
    r"|\b(?:H100|H200|A100|V100|L4|L40S|T4|B200|GH200|MI300X?|TPU ?v\d+[a-z]*|v[4-7][ep])\b"  # an accelerator
)


def _docstring_lines(tree: ast.AST):
    """The line numbers of every module, class and function docstring in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield from range(first.value.lineno, first.value.end_lineno + 1)


def prose_lines(source: str) -> dict[int, str]:
    """Line number → the prose on it: a comment's text, or a docstring's line as written."""
    out = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    for n in _docstring_lines(ast.parse(source)):
        out[n] = lines[n - 1].strip()
    return out


def measured_lines(path: Path) -> list[str]:
    """``"path:line: text"`` for each comment or docstring line of ``path`` that carries a measured number."""
    rel = path.relative_to(ROOT)
    return [f"{rel}:{n}: {text.strip()}" for n, text in sorted(prose_lines(path.read_text()).items())
            if MEASURED.search(text)]


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("text", [
    "0.1-0.25 s on a CPU", "3ms", "12 µs a call", "2 seconds", "40 GB/s", "1.2 GiB/s", "900 tokens/s",
    "9.6x faster", "1.3–2.1x", "0.274x bf16", "on an H200", "TPU v5e", "a v6e chip",
])
def test_the_pattern_sees_each_kind_of_number(text):
    assert MEASURED.search(text)


@pytest.mark.parametrize("text", [
    "flags 0x1f", "int8 codes", "head_dim 128", "bits 2..8", "v2 header", "TQ01 v1", "3.5 bits", "sha256",
    "(..., d)", "x86", "the 1s complement", "100 % done", "[-4s, 4s]", "magic 4s",
])
def test_the_pattern_leaves_other_numbers_alone(text):
    assert not MEASURED.search(text)


def test_prose_lines_are_comments_and_docstrings_only():
    src = 'def f():\n    """Runs in\n    3 ms."""\n    s = "9.6x"  # on an H200\n    return s\n'
    assert prose_lines(src) == {2: '"""Runs in', 3: '3 ms."""', 4: "# on an H200"}


def test_docstrings_and_comments_carry_no_measured_numbers():
    found = [line for path in _sources() for line in measured_lines(path)]
    assert len(found) <= ALLOWED, (
        f"{len(found)} comment or docstring lines carry measured numbers (at most {ALLOWED}): state the design "
        "reason instead and keep the number in benchmarks/results/ (name the file if needed):\n" + "\n".join(found)
    )
