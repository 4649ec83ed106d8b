"""The strategy menus of the neutral ops, run in JAX: every strategy over 2 and 4 devices
gives the op's whole result (tests/strategy_props.py says how)."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from tests.jax_run import run_jax  # noqa: E402
from diphoma_compile.ir.ops import op_def  # noqa: E402
from tests.strategy_props import assert_all, check_cases, neutral_cases  # noqa: E402

# without x64, JAX computes the i64 and f64 of some cases in 32 bits (both sides alike)
pytestmark = pytest.mark.filterwarnings("ignore:Explicitly requested dtype:UserWarning")

CASES = neutral_cases(seed=1)


def _group(name: str) -> str:
    return op_def(name).category.name


# one jitted program per group of ops (unary, binary, reduce, layout, ...): compiling a
# program per op would take most of the test's time
@pytest.mark.parametrize("group", sorted({_group(c.name) for c in CASES}))
def test_every_strategy_gives_the_whole_result(group):
    assert_all(check_cases([c for c in CASES if _group(c.name) == group], run_jax))
