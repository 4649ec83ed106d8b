"""Placements: sharded programs that verify, declared placements the rules reject,
per-device shapes under S and F, and Mesh validation."""

from __future__ import annotations

import pytest

from diphoma_compile.errors import IRError, IRVerifyError, MeshError
from diphoma_compile.ir import (
    FLAT,
    REPLICATE,
    DType,
    FlatShard,
    Partial,
    Replicate,
    Shard,
    TensorType,
    op_def,
    parse,
    verify,
)
from diphoma_compile.ir.sharding_rules import expected_collective, propagate
from diphoma_compile.mesh import Mesh


def graph(ins: str, *ops: str, mesh: str = "mesh[dp=4]", outs: str = "") -> str:
    lines = [f"graph @g {mesh} (", f"  {ins}", ") {", *(f"  {op}" for op in ops),
             f"  return ({outs})", "}"]
    return "\n".join(lines) + "\n"


def rule_placements(g, axis: str = "dp") -> list[tuple]:
    """What the op table's rules give for each top-level op, from its inputs' placements."""
    types = g.value_types()
    got = []
    for op in g.ops:
        d = op_def(op.name)
        ins = [types[n] for n in op.inputs]
        outs = [v.type for v in op.results]
        if op.attrs.get("axis") == axis and d.category.value == "collective":
            want, _ = expected_collective(op, ins[0].placement(axis))
            got.append((want,))
        else:
            got.append(tuple(propagate(op, ins, outs, axis, d.sharding_rule)))
    return got


# ====================================================================== valid placements

VALID = [
    ("dot-batch-split-flows-to-result",
     graph("%x: f32[32,8] {dp: S(0)} batch, %w: f32[16,8] param",
           "%h: f32[32,16] {dp: S(0)} = dot(%x, %w) {lhs_contract=[1], rhs_contract=[1]}")),
    ("dot-rhs-free-dim-split",
     graph("%x: f32[32,8], %w: f32[8,16] {dp: S(1)}",
           "%h: f32[32,16] {dp: S(1)} = dot(%x, %w) {lhs_contract=[1], rhs_contract=[0]}")),
    ("dot-batch-dims-split-both-sides",
     graph("%a: f32[4,8,2] {dp: S(0)}, %b: f32[4,2,3] {dp: S(0)}",
           "%c: f32[4,8,3] {dp: S(0)} = dot(%a, %b) {lhs_batch=[0], lhs_contract=[2], "
           "rhs_batch=[0], rhs_contract=[1]}")),
    ("dot-contracting-split-both-sides-is-partial-sum",
     graph("%g: f32[32,4] {dp: S(0)}, %a: f32[32,16] {dp: S(0)}",
           "%gw: f32[4,16] {dp: P(sum)} = dot(%g, %a) {lhs_contract=[0], rhs_contract=[0]}")),
    ("reduce-over-split-dim",
     graph("%h: f32[32,16] {dp: S(0)}",
           "%s: f32[16] {dp: P(sum)} = reduce_sum(%h) {dims=[0]}",
           "%m: f32[] {dp: P(avg)} = reduce_mean(%h) {dims=[0, 1]}",
           "%x: f32[16] {dp: P(max)} = reduce_max(%h) {dims=[0]}",
           "%n: f32[1,16] {dp: P(min)} = reduce_min(%h) {dims=[0], keepdim=true}")),
    ("reduce-over-other-dim-keeps-split",
     graph("%h: f32[8,32] {dp: S(1)}",
           "%s: f32[32] {dp: S(0)} = reduce_sum(%h) {dims=[0]}",
           "%k: f32[1,32] {dp: S(1)} = reduce_sum(%h) {dims=[0], keepdim=true}")),
    ("reduce-sum-of-flat-over-all-dims",
     graph("%v: f32[4,5] {dp: F}", "%s: f32[] {dp: P(sum)} = reduce_sum(%v) {dims=[0, 1]}")),
    ("all-reduce-partial-to-replicated",
     graph("%p: f32[16] {dp: P(sum)}, %q: f32[] {dp: P(avg)}",
           "%r: f32[16] = all_reduce(%p) {axis=dp, op=sum}",
           "%m: f32[] = all_reduce(%q) {axis=dp, op=avg}")),
    ("reduce-scatter-to-dim-and-flat-then-all-gather-back",
     graph("%p: f32[16,3] {dp: P(sum)}, %q: f32[10] {dp: P(sum)}",
           "%s: f32[16,3] {dp: S(0)} = reduce_scatter(%p) {axis=dp, dim=0, op=sum}",
           "%f: f32[10] {dp: F} = reduce_scatter(%q) {axis=dp, dim=flat, op=sum}",
           "%g: f32[16,3] = all_gather(%s) {axis=dp, dim=0}",
           "%h: f32[10] = all_gather(%f) {axis=dp, dim=flat}")),
    ("take-shard-replicated-to-flat-and-dim",
     graph("%w: f32[10], %v: f32[8,3]",
           "%f: f32[10] {dp: F} = take_shard(%w) {axis=dp, dim=flat}",
           "%s: f32[8,3] {dp: S(0)} = take_shard(%v) {axis=dp, dim=0}")),
    ("all-to-all-moves-split",
     graph("%x: f32[8,4] {dp: S(0)}",
           "%y: f32[8,4] {dp: S(1)} = all_to_all(%x) {axis=dp, from_dim=0, to_dim=1}")),
    ("elementwise-on-flat-shards-with-replicated-scalar",
     graph("%w: f32[10] {dp: F}, %m: f32[10] {dp: F}, %lr: f32[] hyper",
           "%s: f32[10] {dp: F} = mul(%m, %lr)",
           "%n: f32[10] {dp: F} = sub(%w, %s)",
           "%e: f32[10] {dp: Fx} = exp(%n)")),
    ("elementwise-split-with-broadcast-row",
     graph("%x: f32[32,8] {dp: S(0)}, %b: f32[8]",
           "%y: f32[32,8] {dp: S(0)} = add(%x, %b)")),
    ("partial-sums-through-linear-math",
     graph("%p: f32[4] {dp: P(sum)}, %q: f32[4] {dp: P(sum)}, %s: f32[]",
           "%a: f32[4] {dp: P(sum)} = add(%p, %q)",
           "%n: f32[4] {dp: P(sum)} = neg(%a)",
           "%m: f32[4] {dp: P(sum)} = mul(%n, %s)",
           "%d: f32[4] {dp: P(sum)} = div(%m, %s)")),
    ("index-select-split-indices",
     graph("%table: f32[100,16] param, %ids: i32[32] {dp: S(0)} batch",
           "%e: f32[32,16] {dp: S(0)} = index_select(%table, %ids) {axis=0}")),
    ("index-select-split-indices-inner-axis",
     graph("%table: f32[16,100], %ids: i64[2,8] {dp: S(1)}",
           "%e: f32[16,2,8] {dp: S(2)} = index_select(%table, %ids) {axis=1}")),
    ("index-add-into-partial-zero-base",
     graph("%ids: i32[32] {dp: S(0)}, %g: f32[32,16] {dp: S(0)}",
           "%z: f32[100,16] {dp: P(sum)} = full() {value=0}",
           "%gt: f32[100,16] {dp: P(sum)} = index_add(%z, %ids, %g) {axis=0}",
           "%r: f32[100,16] = all_reduce(%gt) {axis=dp, op=sum}")),
    ("zero-float-full-may-be-partial",
     graph("%x: f32[4]", "%z: f32[4] {dp: P(sum)} = full() {value=0.0}")),
    ("reshape-and-transpose-carry-splits",
     graph("%x: f32[32,8] {dp: S(0)}, %v: f32[3,5] {dp: F}",
           "%y: f32[32,2,4] {dp: S(0)} = reshape(%x)",
           "%t: f32[8,32] {dp: S(1)} = transpose(%x) {perm=[1, 0]}",
           "%f: f32[15] {dp: F} = reshape(%v)")),
    ("varying-local-batch-through-any-op",
     graph("%x: f32[4,8] {dp: V} batch, %w: f32[16,8] param",
           "%h: f32[4,16] {dp: V} = opaque(%x, %w) {target=aten.linear.default}",
           "%l: f32[] {dp: V} = reduce_mean(%h) {dims=[0, 1]}",
           "%g: f32[] = all_reduce(%l) {axis=dp, op=avg}",
           "%t: f32[4,16] {dp: F} = reduce_scatter(%h) {axis=dp, dim=flat, op=avg}")),
    ("flat-zero-padding-through-update-math",
     graph("%g: f32[3,5] {dp: F}, %m: f32[3,5] {dp: F}, %c: f32[]",
           "%a: f32[3,5] {dp: F} = mul(%g, %c)",
           "%b: f32[3,5] {dp: F} = lerp(%m, %a, %c)",
           "%q: f32[3,5] {dp: F} = square(%b)",
           "%s: f32[] {dp: P(sum)} = reduce_sum(%q) {dims=[0, 1]}",
           "%e: f32[3,5] {dp: Fx} = add(%q, %c)",
           "%d: f32[3,5] {dp: Fx} = div(%b, %e)")),
    ("grouped-splits",     # a fused projection's [q | k | v] columns, each device its part
     graph("%w: f32[24,8] {dp: S(0,3)}, %x: f32[8,8]",
           "%t: f32[8,24] {dp: S(1,3)} = transpose(%w) {perm=[1, 0]}",
           "%h: f32[8,24] {dp: S(1,3)} = dot(%x, %t) {lhs_contract=[1], rhs_contract=[0]}",
           "%v: f32[8,3,8] {dp: S(2)} = reshape(%h)",
           "%s: f32[24] {dp: S(0,3)} = reduce_sum(%h) {dims=[0]}",
           "%g: f32[8,3,8] = all_gather(%v) {axis=dp, dim=2}")),
    ("two-axis-mesh",
     graph("%x: f32[8,4] {dp: S(0)}, %w: f32[4,6] {tp: S(1)}",
           "%h: f32[8,6] {dp: S(0), tp: S(1)} = dot(%x, %w) {lhs_contract=[1], rhs_contract=[0]}",
           "%s: f32[6] {dp: P(sum), tp: S(0)} = reduce_sum(%h) {dims=[0]}",
           "%r: f32[6] {tp: S(0)} = all_reduce(%s) {axis=dp, op=sum}",
           "%g: f32[6] = all_gather(%r) {axis=tp, dim=0}",
           mesh="mesh[dp=2, tp=2]")),
]


@pytest.mark.parametrize("text", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_placements_verify(text: str) -> None:
    g = parse(text)
    assert verify(g) is g
    for axis in g.mesh.names:
        declared = [tuple(v.type.placement(axis) for v in op.results) for op in g.ops]
        assert rule_placements(g, axis) == declared


def test_data_parallel_step_verifies() -> None:
    # a whole data-parallel step: split batch, partial gradients, reduce-scatter to flat
    # shards (weight-update sharding), update on the shards, all-gather the new weights.
    text = graph(
        "%x: f32[32,8] {dp: S(0)} batch, %y: f32[32,4] {dp: S(0)} batch, "
        "%w: f32[4,8] param, %m: f32[4,8] {dp: F} opt_state(of=%w, slot=momentum), "
        "%lr: f32[] hyper",
        "%o: f32[32,4] {dp: S(0)} = dot(%x, %w) {lhs_contract=[1], rhs_contract=[1]} "
        "phase=forward",
        "%d: f32[32,4] {dp: S(0)} = sub(%o, %y) phase=forward",
        "%sq: f32[32,4] {dp: S(0)} = mul(%d, %d) phase=forward",
        "%ls: f32[] {dp: P(avg)} = reduce_mean(%sq) {dims=[0, 1]} phase=forward",
        "%loss: f32[] = all_reduce(%ls) {axis=dp, op=avg} phase=forward",
        "%gw: f32[4,8] {dp: P(sum)} = dot(%d, %x) {lhs_contract=[0], rhs_contract=[0]} "
        "phase=backward",
        "%gf: f32[4,8] {dp: F} = reduce_scatter(%gw) {axis=dp, dim=flat, op=sum} "
        "phase=backward",
        "%m2: f32[4,8] {dp: F} = add(%m, %gf) phase=update",
        "%wf: f32[4,8] {dp: F} = take_shard(%w) {axis=dp, dim=flat} phase=update",
        "%st: f32[4,8] {dp: F} = mul(%m2, %lr) phase=update",
        "%w2f: f32[4,8] {dp: F} = sub(%wf, %st) phase=update",
        "%w2: f32[4,8] = all_gather(%w2f) {axis=dp, dim=flat} phase=update",
        outs="%loss loss, %w2 replaces(%w), %m2 replaces(%m)")
    verify(parse(text))


# ====================================================================== rejected placements

INVALID = [
    # id, op line (the last one), inputs, words
    ("dot-result-declared-replicated",
     "%x: f32[32,8] {dp: S(0)}, %w: f32[16,8]",
     "%h: f32[32,16] = dot(%x, %w) {lhs_contract=[1], rhs_contract=[1]}",
     ["dot: result 0 is declared R on axis 'dp', but its inputs give S(0)"]),
    ("dot-result-declared-wrong-dim",
     "%x: f32[32,8] {dp: S(0)}, %w: f32[16,8]",
     "%h: f32[32,16] {dp: S(1)} = dot(%x, %w) {lhs_contract=[1], rhs_contract=[1]}",
     ["declared S(1) on axis 'dp', but its inputs give S(0)"]),
    ("dot-contraction-declared-replicated",
     "%g: f32[32,4] {dp: S(0)}, %a: f32[32,16] {dp: S(0)}",
     "%gw: f32[4,16] = dot(%g, %a) {lhs_contract=[0], rhs_contract=[0]}",
     ["declared R on axis 'dp', but its inputs give P(sum)"]),
    ("dot-contraction-split-one-side",
     "%g: f32[32,4] {dp: S(0)}, %a: f32[32,16]",
     "%gw: f32[4,16] {dp: P(sum)} = dot(%g, %a) {lhs_contract=[0], rhs_contract=[0]}",
     ["dot cannot take inputs placed (S(0), R) on axis 'dp'"]),
    ("reduce-over-split-declared-replicated",
     "%h: f32[32,16] {dp: S(0)}",
     "%s: f32[16] = reduce_sum(%h) {dims=[0]}",
     ["reduce_sum: result 0 is declared R on axis 'dp', but its inputs give P(sum)"]),
    ("reduce-mean-declared-partial-sum",
     "%h: f32[32,16] {dp: S(0)}",
     "%s: f32[16] {dp: P(sum)} = reduce_mean(%h) {dims=[0]}",
     ["declared P(sum) on axis 'dp', but its inputs give P(avg)"]),
    ("reduce-other-dim-declared-unshifted-dim",
     "%h: f32[4,8,32] {dp: S(2)}",
     "%s: f32[8,32] {dp: S(0)} = reduce_sum(%h) {dims=[0]}",
     ["declared S(0) on axis 'dp', but its inputs give S(1)"]),
    ("reduce-sum-of-dirty-padded-flat",
     "%v: f32[3,5] {dp: Fx}",
     "%s: f32[] {dp: P(sum)} = reduce_sum(%v) {dims=[0, 1]}",
     ["reduce_sum reduces a flat shard whose padding may be nonzero (Fx) on axis 'dp' "
      "(15 elements over 4 devices)"]),
    ("add-constant-dirties-flat-padding",
     "%v: f32[3,5] {dp: F}, %c: f32[]",
     "%s: f32[3,5] {dp: F} = add(%v, %c)",
     ["add: result 0 is declared F on axis 'dp', but its inputs give Fx"]),
    ("varying-mixed-with-split",
     "%v: f32[4,8] {dp: V}, %w: f32[4,8] {dp: S(0)}",
     "%s: f32[4,8] {dp: V} = add(%v, %w)",
     ["add cannot take inputs placed (V, S(0)) on axis 'dp'"]),
    ("varying-declared-replicated",
     "%v: f32[4,8] {dp: V}",
     "%s: f32[4,8] = exp(%v)",
     ["exp: result 0 is declared R on axis 'dp', but its inputs give V"]),
    ("reduce-mean-of-flat",
     "%v: f32[12] {dp: F}",
     "%s: f32[] {dp: P(avg)} = reduce_mean(%v) {dims=[0]}",
     ["reduce_mean cannot take inputs placed (F) on axis 'dp'"]),
    ("reduce-scatter-declared-flat-for-dim",
     "%p: f32[16] {dp: P(sum)}",
     "%s: f32[16] {dp: F} = reduce_scatter(%p) {axis=dp, dim=0, op=sum}",
     ["reduce_scatter on axis 'dp' gives S(0), but its result is declared F"]),
    ("reduce-scatter-declared-dim-for-flat",
     "%p: f32[16] {dp: P(sum)}",
     "%s: f32[16] {dp: S(0)} = reduce_scatter(%p) {axis=dp, dim=flat, op=sum}",
     ["reduce_scatter on axis 'dp' gives F, but its result is declared S(0)"]),
    ("all-gather-wrong-source",
     "%s: f32[16] {dp: S(0)}",
     "%g: f32[16] = all_gather(%s) {axis=dp, dim=flat}",
     ["all_gather{dim=flat} takes a F input, found S(0)"]),
    ("all-gather-declared-still-split",
     "%s: f32[16] {dp: S(0)}",
     "%g: f32[16] {dp: S(0)} = all_gather(%s) {axis=dp, dim=0}",
     ["all_gather on axis 'dp' gives R, but its result is declared S(0)"]),
    ("take-shard-of-split",
     "%s: f32[16] {dp: S(0)}",
     "%f: f32[16] {dp: F} = take_shard(%s) {axis=dp, dim=flat}",
     ["take_shard takes a replicated input, found S(0)"]),
    ("elementwise-flat-declared-replicated",
     "%w: f32[10] {dp: F}, %lr: f32[]",
     "%s: f32[10] = mul(%w, %lr)",
     ["mul: result 0 is declared R on axis 'dp', but its inputs give F"]),
    ("elementwise-flat-with-replicated-vector",
     "%w: f32[10] {dp: F}, %v: f32[10]",
     "%s: f32[10] {dp: F} = mul(%w, %v)",
     ["mul cannot take inputs placed (F, R) on axis 'dp'"]),
    ("elementwise-flat-with-split",
     "%w: f32[8] {dp: F}, %v: f32[8] {dp: S(0)}",
     "%s: f32[8] {dp: F} = add(%w, %v)",
     ["add cannot take inputs placed (F, S(0)) on axis 'dp'"]),
    ("elementwise-split-with-whole-operand",
     "%x: f32[32,8] {dp: S(0)}, %y: f32[32,8]",
     "%s: f32[32,8] {dp: S(0)} = add(%x, %y)",
     ["add cannot take inputs placed (S(0), R) on axis 'dp'"]),
    ("partial-through-nonlinear",
     "%p: f32[4] {dp: P(sum)}",
     "%e: f32[4] {dp: P(sum)} = exp(%p)",
     ["exp cannot take inputs placed (P(sum)) on axis 'dp'"]),
    ("partial-times-partial",
     "%p: f32[4] {dp: P(sum)}, %q: f32[4] {dp: P(sum)}",
     "%m: f32[4] {dp: P(sum)} = mul(%p, %q)",
     ["mul cannot take inputs placed (P(sum), P(sum)) on axis 'dp'"]),
    ("partial-linear-declared-replicated",
     "%p: f32[4] {dp: P(sum)}",
     "%n: f32[4] = neg(%p)",
     ["neg: result 0 is declared R on axis 'dp', but its inputs give P(sum)"]),
    ("index-select-declared-replicated",
     "%table: f32[100,16], %ids: i32[32] {dp: S(0)}",
     "%e: f32[32,16] = index_select(%table, %ids) {axis=0}",
     ["index_select: result 0 is declared R on axis 'dp', but its inputs give S(0)"]),
    ("index-select-table-split-on-axis",
     "%table: f32[100,16] {dp: S(0)}, %ids: i32[32]",
     "%e: f32[32,16] {dp: S(0)} = index_select(%table, %ids) {axis=0}",
     ["index_select cannot take inputs placed (S(0), R) on axis 'dp'"]),
    ("index-add-into-replicated-base",
     "%z: f32[100,16], %ids: i32[32] {dp: S(0)}, %g: f32[32,16] {dp: S(0)}",
     "%gt: f32[100,16] {dp: P(sum)} = index_add(%z, %ids, %g) {axis=0}",
     ["index_add cannot take inputs placed (R, S(0), S(0)) on axis 'dp'"]),
    ("nonzero-full-declared-partial",
     "%x: f32[4]",
     "%z: f32[4] {dp: P(sum)} = full() {value=1}",
     ["full cannot take inputs placed (no inputs) on axis 'dp'"]),
    ("zero-full-declared-partial-max",
     "%x: f32[4]",
     "%z: f32[4] {dp: P(max)} = full() {value=0}",
     ["full cannot take inputs placed (no inputs) on axis 'dp'"]),
    ("shard-not-dividing",
     "%x: f32[6,8]",
     "%s: f32[6,8] {dp: S(0)} = take_shard(%x) {axis=dp, dim=0}",
     ["result %s: dim 0 of size 6 does not divide among 4 devices of axis 'dp'"]),
    ("grouped-shard-not-dividing",
     "%x: f32[12,8]",
     "%s: f32[12,8] {dp: S(0,2)} = take_shard(%x) {axis=dp, dim=0}",
     ["dim 0 of size 12 does not divide among 4 devices of axis 'dp' in each of 2 groups"]),
    ("grouped-is-not-plain",
     "%x: f32[24,8] {dp: S(0,3)}",
     "%g: f32[24,8] = all_gather(%x) {axis=dp, dim=0}",
     ["all_gather{dim=0} takes a S(0) input, found S(0,3)"]),
    ("control-flow-fed-split",
     "%x: f32[8] {dp: S(0)}",
     "%r: f32[8] {dp: S(0)} = call(%x) (\n^f(%a: f32[8] {dp: S(0)}) {\nyield %a\n}\n)",
     ["call cannot take inputs placed (S(0)) on axis 'dp'"]),
    ("region-argument-placement-differs",
     "%x: f32[8] {dp: S(0)}",
     "%r: f32[8] {dp: S(0)} = call(%x) (\n^f(%a: f32[8]) {\nyield %a\n}\n)",
     ["region arguments vs inputs: (f32[8]) does not match (f32[8] {dp: S(0)})"]),
]


@pytest.mark.parametrize("ins,op_line,words", [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_rejected_placements(ins: str, op_line: str, words: list[str]) -> None:
    with pytest.raises(IRVerifyError) as ei:
        verify(parse(graph(ins, op_line)))
    msg = str(ei.value)
    assert f">> {op_line.splitlines()[0].removesuffix(' (')}\n" in msg + "\n", msg
    for w in words:
        assert w in msg, f"{w!r} not in:\n{msg}"


def test_zero_padded_flat_may_be_declared_dirty_not_the_reverse() -> None:
    ok = graph("%b: f32[3,5] {dp: F}", "%k: f32[3,5] {dp: Fx} = sqrt(%b)",
               outs="%k other")
    verify(parse(ok))
    bad = graph("%b: f32[3,5] {dp: Fx}", "%k: f32[3,5] {dp: F} = sqrt(%b)", outs="%k other")
    with pytest.raises(IRVerifyError, match="declared F on axis 'dp', but its inputs give Fx"):
        verify(parse(bad))


def test_placement_checks_apply_on_every_axis() -> None:
    # right on dp, wrong on tp
    text = graph("%x: f32[8,4] {dp: S(0)}, %w: f32[4,6] {tp: S(1)}",
                 "%h: f32[8,6] {dp: S(0)} = dot(%x, %w) {lhs_contract=[1], rhs_contract=[0]}",
                 mesh="mesh[dp=2, tp=2]")
    with pytest.raises(IRVerifyError, match="declared R on axis 'tp', but its inputs give S"):
        verify(parse(text))


def test_one_dim_split_on_two_axes_must_divide_their_product() -> None:
    mesh = "mesh[dp=4, tp=2]"
    ok = graph("%x: f32[8,3] {dp: S(0), tp: S(0)}",
               "%y: f32[8,3] {dp: S(0), tp: S(0)} = exp(%x)", mesh=mesh)
    g = verify(parse(ok))
    assert g.ops[0].result.type.local_shape(dict(g.mesh.axes)) == (1, 3)
    # 4 divides among 4 and among 2, but not among the 8 pieces the two splits make
    bad = graph("%x: f32[4,3]", "%y: f32[4,3] {dp: S(0), tp: S(0)} = exp(%x)", mesh=mesh)
    with pytest.raises(IRVerifyError) as ei:
        verify(parse(bad))
    msg = str(ei.value)
    assert "result %y: dim 0 of size 4 does not divide among 8 devices of axes 'dp', 'tp'" \
        in msg
    assert ">> %y: f32[4,3] {dp: S(0), tp: S(0)} = exp(%x)" in msg


def test_collective_on_one_axis_passes_other_axes_through() -> None:
    text = graph("%p: f32[8,6] {dp: P(sum), tp: S(1)}",
                 "%r: f32[8,6] = all_reduce(%p) {axis=dp, op=sum}",
                 mesh="mesh[dp=2, tp=2]")
    with pytest.raises(IRVerifyError, match="all_reduce: result 0 is declared R on axis 'tp', "
                                            "but its inputs give S.1."):
        verify(parse(text))


# ====================================================================== local shapes

AX = {"dp": 4, "tp": 2}


@pytest.mark.parametrize("shape,dtype,placements,local,nbytes", [
    ((8, 6), DType.f32, (), (8, 6), 192),
    ((8, 6), DType.f32, (("dp", REPLICATE),), (8, 6), 192),
    ((8, 6), DType.f32, (("dp", Partial("sum")),), (8, 6), 192),   # a full-size partial
    ((8, 6), DType.f32, (("dp", Shard(0)),), (2, 6), 48),
    ((8, 6), DType.bf16, (("tp", Shard(1)),), (8, 3), 48),
    ((8, 6), DType.f32, (("dp", Shard(0)), ("tp", Shard(1))), (2, 3), 24),
    ((8, 6), DType.f32, (("dp", Shard(1)),), (8, 2), 64),          # 6/4 rounds up
    ((10,), DType.f32, (("dp", FLAT),), (3,), 12),                 # 10/4 pads to 12
    ((3, 5), DType.f16, (("dp", FLAT),), (4,), 8),                 # 15/4 pads to 16
    ((16,), DType.f32, (("dp", FLAT),), (4,), 16),                 # exact: no padding
    ((16,), DType.f32, (("dp", FLAT), ("tp", FLAT)), (2,), 8),     # 16/(4*2)
    ((9,), DType.f32, (("dp", FLAT), ("tp", FLAT)), (2,), 8),      # 9/8 pads to 16
    ((8, 6), DType.f32, (("dp", Shard(0)), ("tp", FLAT)), (6,), 24),   # (2,6) then 12/2
    ((8, 5), DType.i8, (("tp", Shard(0)), ("dp", FLAT)), (5,), 5),     # (4,5)=20 then /4
    ((), DType.f32, (("dp", FLAT),), (1,), 4),                     # a scalar: 1/4 pads to 4
    ((10,), DType.f32, (("xx", Shard(0)),), (10,), 40),            # unknown axis: size 1
])
def test_local_shape_and_nbytes(shape, dtype, placements, local, nbytes) -> None:
    t = TensorType(shape, dtype, placements)
    assert t.local_shape(AX) == local
    assert t.local_nbytes(AX) == nbytes
    assert t.nbytes == t.numel * dtype.itemsize  # the logical size is unchanged


def test_flat_padding_rounds_up_and_covers_the_tensor() -> None:
    for n in range(1, 40):
        for k in (1, 2, 3, 4, 8):
            t = TensorType((n,), DType.f32, (("dp", FLAT),))
            (piece,) = t.local_shape({"dp": k})
            assert piece * k >= n > (piece - 1) * k


def test_tensor_type_canonical_placements_and_errors() -> None:
    a = TensorType((4,), DType.f32, (("tp", Shard(0)), ("dp", REPLICATE), ("cp", FLAT)))
    b = TensorType((4,), "f32", (("cp", FlatShard()), ("tp", Shard(0))))
    assert a == b and a.placements == (("cp", FLAT), ("tp", Shard(0)))
    assert a.placement("dp") == Replicate() and a.placement("zz") == REPLICATE
    assert str(a) == "f32[4] {cp: F, tp: S(0)}"
    assert a.with_placement("tp", REPLICATE).placements == (("cp", FLAT),)
    assert a.replicated() == TensorType((4,), DType.f32)
    g = TensorType((24, 8), DType.f32, (("tp", Shard(0, 3)),))
    assert str(g) == "f32[24,8] {tp: S(0,3)}" and Shard(0, 1) == Shard(0)
    assert g.local_shape({"tp": 4}) == (6, 8)
    with pytest.raises(IRError, match="groups must be >= 1"):
        Shard(0, 0)
    with pytest.raises(IRError, match="dimensions are ints >= 0"):
        TensorType((4, -1), DType.f32)
    with pytest.raises(IRError, match="names an axis twice"):
        TensorType((4,), DType.f32, (("dp", Shard(0)), ("dp", FLAT)))
    with pytest.raises(IRError, match="unknown dtype 'f31'"):
        TensorType((4,), "f31")
    with pytest.raises(IRError, match="partial reduction 'prod'"):
        Partial("prod")


# ====================================================================== mesh

@pytest.mark.parametrize("axes,words", [
    ({"1dp": 2}, ["'1dp' is not an identifier"]),
    ({"d-p": 2}, ["'d-p' is not an identifier"]),
    ({"": 2}, ["'' is not an identifier"]),
    (((3, 2),), ["3 is not an identifier"]),
    ({"dp": 0}, ["axis 'dp' has size 0", "positive int"]),
    ({"dp": -2}, ["axis 'dp' has size -2"]),
    ({"dp": True}, ["axis 'dp' has size True"]),
    ({"dp": 2.0}, ["axis 'dp' has size 2.0"]),
    ((("dp", 2), ("dp", 4)), ["mesh axis 'dp' is given twice"]),
])
def test_mesh_rejects(axes, words) -> None:
    with pytest.raises(MeshError) as ei:
        Mesh(axes)
    for w in words:
        assert w in str(ei.value)


def test_mesh_duplicate_axis_through_keywords() -> None:
    with pytest.raises(MeshError, match="'dp' is given twice"):
        Mesh({"dp": 2}, dp=4)


def test_mesh_axis_size_and_missing_axis() -> None:
    m = Mesh({"dp": 4, "pp": 2}, tp=2)
    assert m.names == ("dp", "pp", "tp") and m.size == 16
    assert m.axis_size("pp") == 2 and "tp" in m and "cp" not in m
    assert str(m) == "mesh[dp=4, pp=2, tp=2]"
    with pytest.raises(MeshError) as ei:
        m.axis_size("cp")
    assert "mesh has no axis 'cp' (axes: dp, pp, tp)" in str(ei.value)
    assert ei.value.hint
    with pytest.raises(MeshError, match=r"no axis 'dp' \(axes: none\)"):
        Mesh().axis_size("dp")
    assert not Mesh() and Mesh().size == 1
