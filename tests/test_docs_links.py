"""Every relative link in the repository's markdown resolves to a file that exists.

Pages move (research notes left ``docs/`` for ``benchmarks/studies/``); a link that
still points at the old place is a dead end for a reader, so the suite follows each one.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:")  # https:, mailto: ...


def dead_links(files) -> list[tuple[Path, str]]:
    """(file, target) for each relative link in ``files`` whose target does not exist."""
    return [(path, m.group(1)) for path in files for m in LINK.finditer(path.read_text(encoding="utf-8"))
            if not SCHEME.match(m.group(1)) and not (path.parent / m.group(1)).exists()]


def test_the_link_check_finds_a_dead_link(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [web](https://example.org) [anchor](there.md#a) [gone](../docs/quality.md)")
    assert dead_links([page]) == [(page, "../docs/quality.md")]


def test_every_relative_markdown_link_resolves():
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [ROOT / line for line in listed.split()]
    assert len(files) > 20, files  # the repository's pages were found
    assert [(str(p.relative_to(ROOT)), t) for p, t in dead_links(files)] == []
