"""Golden-file checks: compare text with tests/golden/<name>, or rewrite it on request."""

from __future__ import annotations

import difflib
from pathlib import Path


class GoldenMismatch(AssertionError):
    """The produced text differs from the golden file; the message is a unified diff."""


def check_golden(path: Path, actual: str, update: bool = False) -> None:
    """Assert ``actual`` equals the file at ``path``; with ``update`` rewrite the file.

    A missing golden file fails too (run with --update-golden to create it)."""
    path = Path(path)
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != actual:
            path.write_text(actual)
        return
    if not path.exists():
        raise GoldenMismatch(f"golden file {path} does not exist; run pytest --update-golden "
                             "to create it, then read and commit it")
    expected = path.read_text()
    if expected != actual:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), actual.splitlines(keepends=True),
            fromfile=f"{path} (golden)", tofile="actual"))
        raise GoldenMismatch(f"output differs from {path}; if the change is meant, run "
                             f"pytest --update-golden and review the diff:\n{diff}")
