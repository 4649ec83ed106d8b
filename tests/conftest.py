"""Shared fixtures: the golden-file checker and its --update-golden switch; 8 CPU devices
for JAX."""

from __future__ import annotations

import os
from pathlib import Path

# Eight virtual CPU devices for the JAX parallel tests; it must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

# XLA compiles the tests' many small programs with LLVM at -O0 (XLA's own HLO passes still
# run): tests/jax and the examples' tests took 25% less time so on 2 cores (291 s against
# 386 s, 2026-12-03); what they compare is
# compiled alike on both sides (the user's jax.jit step and the project's programs).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import pytest

from diphoma_compile.testing.golden import check_golden

GOLDEN_DIR = Path(__file__).parent / "golden"
CASES_DIR = Path(__file__).parent / "ir_cases"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/* with the current output instead of comparing")


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """``golden("name.ir", text)`` compares with tests/golden/name.ir (or rewrites it)."""
    update = request.config.getoption("--update-golden")

    def check(name: str, actual: str) -> None:
        check_golden(GOLDEN_DIR / name, actual, update=update)
    return check


@pytest.fixture
def ir_case():
    """``ir_case("name")`` reads tests/ir_cases/name.ir."""
    return lambda name: (CASES_DIR / f"{name}.ir").read_text()
