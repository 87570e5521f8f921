"""What every study's report shares: the commit it ran at, and the markdown written out."""

from __future__ import annotations

import subprocess


def commit() -> str:
    """The short hash of HEAD (the commit a run names in its report)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def write(lines: list[str], out: str | None) -> None:
    """Print the report's ``lines`` and, with ``out``, write them there."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        open(out, "w").write(text)
