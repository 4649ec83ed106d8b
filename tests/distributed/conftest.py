"""The one launch of the distributed tests: every check registered in dist_checks.py runs
on dist_checks.WORLD gloo ranks once per session, and every test here asserts on its results."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def runs() -> list[dict]:
    """Rank r's results: ``runs[r][check name]``, and ``runs[r]["seconds"][check name]``."""
    import dist_checks
    from dist_harness import launch
    return launch(dist_checks.run_all, world=dist_checks.WORLD, timeout=400)


@pytest.fixture(scope="session")
def cases(runs) -> dict[str, list[dict]]:
    """The training cases' results by case id, one entry per rank."""
    return {name: [r["cases"][name] for r in runs] for name in runs[0]["cases"]}
