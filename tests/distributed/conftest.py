"""The one launch of the distributed tests: every check registered in dist_checks.py runs
on dist_checks.WORLD gloo ranks once per session, and every test here asserts on its results."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def runs() -> list[dict]:
    """Rank r's results: ``runs[r][check name]``, and ``runs[r]["seconds"][check name]``.

    The launch took 333 s on a 2-core AVX2 machine (AMD EPYC, 2026-12-02), close to the
    400 s deadline it had; the deadline leaves room for a slower or loaded machine, since a
    launch cut short fails every distributed test at once."""
    import dist_checks
    from dist_harness import launch
    return launch(dist_checks.run_all, world=dist_checks.WORLD, timeout=1200)


@pytest.fixture(scope="session")
def cases(runs) -> dict[str, list[dict]]:
    """The training cases' results by case id, one entry per rank."""
    return {name: [r["cases"][name] for r in runs] for name in runs[0]["cases"]}
