"""The strategy menus, framework-free: every neutral op with a menu has property cases
(tests/strategy_props.py; run in tests/torch/test_torch_strategies.py and
tests/jax/test_jax_strategies.py), every strategy names a placement per operand and result
and only dims that exist, and what the properties found stays fixed."""

from __future__ import annotations

from diphoma_compile.ir import DType, Shard, TensorType
from diphoma_compile.ir.strategies import fits_axis, strategies_of
from tests.strategy_props import malformed, neutral_cases, op_of, rows_with_strategies


def test_every_op_with_a_menu_has_property_cases():
    covered = {c.name for c in neutral_cases()}
    missing = rows_with_strategies() - covered
    assert not missing, f"op rows with strategies but no property case: {sorted(missing)}"


def test_every_strategy_has_the_ops_shape():
    bad = []
    for case in neutral_cases():
        op, ins = case.op, case.ins
        outs = [v.type for v in op.results]
        bad += [f"{case}: {s}: {e}" for s in strategies_of(op, ins, outs)
                if (e := malformed(s, ins, outs))]
    assert not bad, "\n".join(bad)


def test_iota_does_not_split_along_its_own_dim():
    # each device would count from 0 instead of from its offset (found by the properties)
    out = TensorType((4, 8), DType.i32)
    op = op_of("iota", [], [out], {"dim": 1})
    splits = {s.outputs[0] for s in strategies_of(op, [], [out]) if fits_axis(s, [], [out], 2)}
    assert Shard(0) in splits and Shard(1) not in splits
