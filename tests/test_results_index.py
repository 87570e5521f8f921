"""benchmarks/results/README.md indexes every result file: each file there has one row
(what it measures, its command, the doc citing it), and each row names a file there."""

from __future__ import annotations

import pathlib
import re

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _rows() -> list[list[str]]:
    text = (RESULTS / "README.md").read_text(encoding="utf-8")
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in text.splitlines() if ln.startswith("| `")]
    return rows


def test_every_result_file_has_one_row_and_every_row_a_file():
    named = [re.fullmatch(r"`([^`]+)`", row[0]).group(1) for row in _rows()]
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")
    assert sorted(named) == files, (sorted(set(files) - set(named)), sorted(set(named) - set(files)))


def test_every_row_says_what_command_and_who_cites():
    for row in _rows():
        assert len(row) == 4 and all(row[1:3]), row  # a dash in "cited by" says: no doc cites it
