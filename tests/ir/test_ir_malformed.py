"""Malformed IR: each text is rejected with the right error, naming where and what is wrong.

Syntax errors come from ``parse`` as IRParseError and name the line; semantic errors come
from ``verify(parse(text))`` as IRVerifyError and show the offending op marked ``>>``."""

from __future__ import annotations

import pytest

from diphoma_compile.errors import IRParseError, IRVerifyError
from diphoma_compile.ir import parse, verify

AB = "%a: f32[4], %b: f32[4]"
DP = "mesh[dp=4]"


def graph(*ops: str, ins: str = AB, outs: str = "", mesh: str = "") -> str:
    """A graph around op lines: line 1 the header, line 2 the inputs, ops from line 4."""
    head = "graph @g" + (f" {mesh}" if mesh else "")
    lines = [f"{head} (", f"  {ins}", ") {", *(f"  {op}" for op in ops),
             f"  return ({outs})", "}"]
    return "\n".join(lines) + "\n"


def cond_graph(*branches: list[str], ins: str = "%a: f32[4], %p: bool[]",
               result: str = "%r: f32[4]", inputs: str = "%p, %a", after=()) -> str:
    """A graph with one cond op whose branches are given as lists of lines."""
    ops = [f"{result} = cond({inputs}) ("]
    for br in branches:
        ops += br
    ops += [")", *after]
    return graph(*ops, ins=ins)


# ====================================================================== parse errors

PARSE_CASES = [
    # id, text, line, words in the message
    ("unknown-dtype", graph("%c: f33[4] = add(%a, %b)"), 4, ["unknown dtype 'f33'"]),
    ("unknown-dtype-input", graph(ins="%a: float32[4]"), 2, ["unknown dtype 'float32'"]),
    ("unclosed-shape-bracket", graph("%c: f32[4 = add(%a, %b)"), 4,
     ["expected ']'", "found '='"]),
    ("unclosed-input-paren", graph("%c: f32[4] = add(%a, %b"), 4,
     ["expected ')'", "found end of line"]),
    ("unclosed-attr-brace", graph("%c: f32[] = reduce_sum(%a) {dims=[0]"), 4,
     ["expected '}'", "end of line"]),
    ("unclosed-graph-body", "graph @g (%a: f32[4]) {\n  %c: f32[4] = neg(%a)\n", 3,
     ["expected an op or 'return'", "end of text"]),
    ("bad-shard-dim", graph("%c: f32[4] {dp: S(x)} = neg(%a)", mesh=DP), 4,
     ["expected a dimension", "found 'x'"]),
    ("float-shard-dim", graph("%c: f32[4] {dp: S(1.5)} = neg(%a)", mesh=DP), 4,
     ["expected a dimension (an int)", "1.5"]),
    ("unknown-placement", graph("%c: f32[4] {dp: Q} = neg(%a)", mesh=DP), 4,
     ["unknown placement 'Q'"]),
    ("bad-partial-op", graph("%c: f32[4] {dp: P(mul)} = neg(%a)", mesh=DP), 4,
     ["partial reduction 'mul'", "sum, avg, max, min"]),
    ("axis-placed-twice", graph("%c: f32[4] {dp: S(0), dp: R} = neg(%a)", mesh=DP), 4,
     ["axis 'dp' is placed twice"]),
    ("negative-dim", graph("%c: f32[-4] = neg(%a)"), 4, ["dimension -4", "ints >= 0"]),
    ("float-dim", graph("%c: f32[2.5] = neg(%a)"), 4,
     ["expected a dimension size (an int)", "2.5"]),
    ("missing-equals", graph("%c: f32[4] add(%a, %b)"), 4, ["expected '='", "found 'add'"]),
    ("missing-op-name", graph("%c: f32[4] = (%a, %b)"), 4, ["expected an op name"]),
    ("unterminated-string", graph('%c: f32[4] = neg(%a) loc="mlp.py:9'), 4,
     ["unterminated string"]),
    ("unterminated-quoted-name", graph('%"c: f32[4] = neg(%a)'), 4, ["unterminated string"]),
    ("bad-string-escape", graph('%c: f32[4] = neg(%a) loc="a\\qb"'), 4,
     ["bad string", "invalid \\escape"]),
    ("duplicate-attribute", graph("%c: f32[] = reduce_sum(%a) {dims=[0], dims=[0]}"), 4,
     ["attribute 'dims' is given twice"]),
    ("duplicate-meta", graph("%c: f32[4] = neg(%a) phase=forward phase=backward"), 4,
     ["phase is given twice"]),
    ("unknown-phase", graph("%c: f32[4] = neg(%a) phase=sideways"), 4,
     ["unknown phase 'sideways'"]),
    ("format-version", "# diphoma-ir v2\n" + graph("%c: f32[4] = neg(%a)"), 1,
     ["unsupported format line '# diphoma-ir v2'"]),
    ("text-after-graph", graph("%c: f32[4] = neg(%a)") + "\njunk here\n", 8,
     ["unexpected text after the graph", "'junk'"]),
    ("second-graph", graph() + graph(), 6, ["unexpected text after the graph", "'graph'"]),
    ("unexpected-character", graph("%c: f32[4] = neg(%a) $"), 4,
     ["unexpected character '$'"]),
    ("unknown-input-role", graph(ins="%a: f32[4] parm"), 2, ["unknown input role 'parm'"]),
    ("role-link-on-non-state", graph(ins="%w: f32[4] param, %a: f32[4] param(of=%w)"), 2,
     ["only optimizer and communication state link to a parameter"]),
    ("unknown-role-field", graph(ins="%w: f32[4] param, %m: f32[4] opt_state(for=%w)"), 2,
     ["unexpected role field 'for'"]),
    ("unknown-output-role", graph("%c: f32[] = reduce_sum(%a) {dims=[0]}", outs="%c lost"),
     5, ["unknown output role 'lost'"]),
    ("mesh-size-zero", graph(mesh="mesh[dp=0]"), 1, ["mesh axis 'dp' has size 0"]),
    ("mesh-axis-twice", graph(mesh="mesh[dp=2, dp=4]"), 1, ["mesh axis 'dp' is given twice"]),
    ("missing-graph-keyword", "grph @g () {\n  return ()\n}\n", 1, ["expected 'graph'"]),
    ("region-missing-yield",
     cond_graph(["^t(%x: f32[4]) {", "%t: f32[4] = neg(%x)", "}"]), 7,
     ["expected an op or 'yield'", "'}'"]),
    ("regions-not-closed",
     cond_graph(["^t(%x: f32[4]) {", "yield %x", "}"])
     .replace("  )\n", "").rstrip("\n") + "\n", 8,
     ["')' closing the regions"]),
]


@pytest.mark.parametrize("text,line,words", [c[1:] for c in PARSE_CASES],
                         ids=[c[0] for c in PARSE_CASES])
def test_parse_error(text: str, line: int, words: list[str]) -> None:
    with pytest.raises(IRParseError) as ei:
        parse(text)
    e = ei.value
    msg = str(e)
    assert e.line == line, msg
    assert f"line {line}," in msg
    assert e.col >= 1
    # the message quotes the offending source line under the position
    assert f"  | {text.split(chr(10))[line - 1]}" in msg
    for w in words:
        assert w in msg, f"{w!r} not in:\n{msg}"


def test_parse_error_caret_points_at_the_column() -> None:
    text = graph("%c: f32[4] add(%a, %b)")
    with pytest.raises(IRParseError) as ei:
        parse(text)
    e = ei.value
    src = "  %c: f32[4] add(%a, %b)"
    assert e.col == src.index("add") + 1
    assert f"  | {src}\n  | {' ' * (e.col - 1)}^" in str(e)


def test_parse_errors_are_parse_errors_not_crashes() -> None:
    # Texts that once escaped as other exception types must come back as IRParseError.
    for text in ['graph @"g\\x" () {\n  return ()\n}\n',
                 graph('%c: f32[4] = neg(%a) loc="tab\there"')]:
        with pytest.raises(IRParseError):
            parse(text)


# ====================================================================== verify errors

MUL_P = "%c: f32[4] = all_reduce(%a) {axis=dp, op=sum}"

VERIFY_CASES = [
    # id, text, offending op line (None: a graph-level error), words in the message
    # --- SSA scoping
    ("use-before-definition",
     graph("%c: f32[4] = add(%a, %d)", "%d: f32[4] = neg(%a)"),
     "%c: f32[4] = add(%a, %d)", ["add uses %d before it is defined"]),
    ("use-before-definition-in-region",
     cond_graph(["^t(%x: f32[4]) {", "%t: f32[4] = add(%x, %late)", "yield %t", "}"],
                after=["%late: f32[4] = neg(%a)"]),
     "%t: f32[4] = add(%x, %late)", ["uses %late before it is defined"]),
    ("use-of-region-value-outside",
     cond_graph(["^t(%x: f32[4]) {", "%t: f32[4] = neg(%x)", "yield %t", "}"],
                after=["%u: f32[4] = neg(%t)"]),
     "%u: f32[4] = neg(%t)", ["neg uses %t before it is defined"]),
    ("defined-twice",
     graph("%c: f32[4] = add(%a, %b)", "%c: f32[4] = neg(%a)"),
     "%c: f32[4] = neg(%a)", ["%c is defined twice"]),
    ("defined-twice-redefines-input", graph("%a: f32[4] = neg(%b)"),
     "%a: f32[4] = neg(%b)", ["%a is defined twice"]),
    ("defined-twice-region-then-outer",
     cond_graph(["^t(%x: f32[4]) {", "%t: f32[4] = neg(%x)", "yield %t", "}"],
                after=["%t: f32[4] = neg(%a)"]),
     "%t: f32[4] = neg(%a)", ["%t is defined twice"]),
    ("defined-twice-outer-then-region",
     cond_graph(["^t(%x: f32[4]) {", "%a: f32[4] = neg(%x)", "yield %a", "}"]),
     "%a: f32[4] = neg(%x)", ["%a is defined twice"]),
    ("defined-twice-sibling-regions",
     cond_graph(["^t(%x: f32[4]) {", "%t: f32[4] = neg(%x)", "yield %t", "}"],
                ["^f(%y: f32[4]) {", "%t: f32[4] = exp(%y)", "yield %t", "}"]),
     "%t: f32[4] = exp(%y)", ["%t is defined twice"]),
    ("region-argument-shadows-outer",
     cond_graph(["^t(%a: f32[4]) {", "yield %a", "}"]),
     "%r: f32[4] = cond(%p, %a)", ["region argument %a is defined twice"]),
    ("input-declared-twice", graph(ins="%a: f32[4], %a: f32[4]"), None,
     ["input %a is declared twice"]),
    # --- op vocabulary and attributes
    ("unknown-op-did-you-mean", graph("%c: f32[4] = addd(%a, %b)"),
     "%c: f32[4] = addd(%a, %b)", ["unknown op 'addd'", "hint: did you mean add"]),
    ("unknown-op-no-match", graph("%c: f32[4] = my_custom_kernel(%a)"),
     "%c: f32[4] = my_custom_kernel(%a)", ["unknown op 'my_custom_kernel'", "opaque {target=...}"]),
    ("missing-required-attribute", graph("%c: f32[] = reduce_sum(%a)"),
     "%c: f32[] = reduce_sum(%a)", ["reduce_sum needs attribute 'dims'"]),
    ("missing-required-attribute-dot",
     graph("%c: f32[] = dot(%a, %b) {lhs_contract=[0]}"),
     "%c: f32[] = dot(%a, %b) {lhs_contract=[0]}", ["dot needs attribute 'rhs_contract'"]),
    ("unknown-attribute", graph("%c: f32[4] = add(%a, %b) {foo=1}"),
     "%c: f32[4] = add(%a, %b) {foo=1}", ["add has unknown attribute(s) foo"]),
    ("unknown-attribute-lists-known", graph("%c: f32[] = reduce_sum(%a) {dim=[0], dims=[0]}"),
     "%c: f32[] = reduce_sum(%a) {dim=[0], dims=[0]}",
     ["unknown attribute(s) dim", "known: dims, keepdim"]),
    ("wrong-attribute-kind-ints", graph("%c: f32[4] = transpose(%a) {perm=0}"),
     "%c: f32[4] = transpose(%a) {perm=0}",
     ["transpose: attribute perm=0 should be a list of ints"]),
    ("wrong-attribute-kind-dtype", graph("%c: f32[4] = convert(%a) {dtype=f33}"),
     "%c: f32[4] = convert(%a) {dtype=f33}", ["attribute dtype='f33' should be a dtype"]),
    ("wrong-attribute-kind-bool",
     graph("%c: f32[] = reduce_sum(%a) {dims=[0], keepdim=1}"),
     "%c: f32[] = reduce_sum(%a) {dims=[0], keepdim=1}",
     ["attribute keepdim=1 should be true or false"]),
    ("wrong-attribute-kind-reduce",
     graph("%c: f32[4] = all_reduce(%a) {axis=dp, op=mul}", mesh=DP),
     "%c: f32[4] = all_reduce(%a) {axis=dp, op=mul}",
     ["attribute op='mul' should be one of sum, avg, max, min"]),
    ("wrong-attribute-kind-choice", graph("%c: f32[4] = gelu(%a) {approximate=fast}"),
     "%c: f32[4] = gelu(%a) {approximate=fast}", ["should be one of none, tanh"]),
    ("regions-on-plain-op",
     graph("%c: f32[4] = neg(%a) (", "^r() {", "yield", "}", ")"),
     "%c: f32[4] = neg(%a)", ["neg takes no regions"]),
    # --- shape and dtype rules
    ("add-shape-mismatch", graph("%c: f32[4] = add(%a, %b)", ins="%a: f32[4], %b: f32[5]"),
     "%c: f32[4] = add(%a, %b)", ["add:", "(4,), (5,) do not broadcast"]),
    ("declared-result-shape-wrong", graph("%c: f32[5] = neg(%a)"),
     "%c: f32[5] = neg(%a)", ["neg: result 0 is declared f32[5] but the op gives f32[4]"]),
    ("declared-result-dtype-wrong", graph("%c: f32[4] = lt(%a, %b)"),
     "%c: f32[4] = lt(%a, %b)", ["declared f32[4] but the op gives bool[4]"]),
    ("dot-contracting-mismatch",
     graph("%c: f32[2,3] = dot(%a, %b) {lhs_contract=[1], rhs_contract=[0]}",
           ins="%a: f32[2,4], %b: f32[5,3]"),
     "%c: f32[2,3] = dot(%a, %b) {lhs_contract=[1], rhs_contract=[0]}",
     ["dot: lhs dim 1 (4) does not match rhs dim 0 (5)"]),
    ("dot-wrong-result-shape",
     graph("%c: f32[2,4] = dot(%a, %b) {lhs_contract=[1], rhs_contract=[0]}",
           ins="%a: f32[2,4], %b: f32[4,3]"),
     "%c: f32[2,4] = dot(%a, %b) {lhs_contract=[1], rhs_contract=[0]}",
     ["declared f32[2,4] but the op gives f32[2,3]"]),
    ("reduce-dims-out-of-range", graph("%c: f32[] = reduce_sum(%a) {dims=[1]}"),
     "%c: f32[] = reduce_sum(%a) {dims=[1]}", ["dims (1,) out of range for rank 1"]),
    ("reduce-dims-repeated",
     graph("%c: f32[] = reduce_sum(%a) {dims=[0, 0]}", ins="%a: f32[4,4]"),
     "%c: f32[] = reduce_sum(%a) {dims=[0, 0]}", ["repeats a dimension"]),
    ("reshape-changes-numel", graph("%c: f32[2,3] = reshape(%a)"),
     "%c: f32[2,3] = reshape(%a)",
     ["reshape from f32[4] to f32[2,3] changes the number of elements"]),
    ("dtype-mismatch-without-convert",
     graph("%c: f32[4] = add(%a, %b)", ins="%a: f32[4], %b: f16[4]"),
     "%c: f32[4] = add(%a, %b)",
     ["inputs must share one dtype", "f32[4], f16[4]", "insert an explicit convert"]),
    ("wrong-arity", graph("%c: f32[4] = mul(%a)"),
     "%c: f32[4] = mul(%a)", ["mul: takes 2 input(s), found 1"]),
    ("scale-operand-not-scalar", graph("%c: f32[4] = add(%a, %b, %b)",
                                       ins="%a: f32[4], %b: f32[4]"),
     "%c: f32[4] = add(%a, %b, %b)", ["alpha operand must be a 0-d float, found f32[4]"]),
    # --- placements and collectives
    ("reduce-scatter-indivisible",
     graph("%c: f32[6] {dp: S(0)} = reduce_scatter(%a) {axis=dp, dim=0, op=sum}",
           ins="%a: f32[6] {dp: P(sum)}", mesh=DP),
     "%c: f32[6] {dp: S(0)} = reduce_scatter(%a) {axis=dp, dim=0, op=sum}",
     ["dim 0 of size 6 does not divide among 4 devices of axis 'dp'", "hint:", "F"]),
    ("all-reduce-input-not-partial",
     graph(MUL_P, ins="%a: f32[4] {dp: S(0)}", mesh=DP), MUL_P,
     ["all_reduce on axis 'dp'", "takes a P(sum) or V input, found S(0)"]),
    ("all-reduce-input-replicated", graph(MUL_P, ins="%a: f32[4]", mesh=DP), MUL_P,
     ["takes a P(sum) or V input, found R"]),
    ("all-reduce-op-mismatch",
     graph("%c: f32[4] = all_reduce(%a) {axis=dp, op=avg}", ins="%a: f32[4] {dp: P(sum)}",
           mesh=DP),
     "%c: f32[4] = all_reduce(%a) {axis=dp, op=avg}",
     ["all_reduce{op=avg} takes a P(avg) or V input, found P(sum)"]),
    ("collective-result-placement-wrong",
     graph("%c: f32[4] {dp: S(0)} = all_reduce(%a) {axis=dp, op=sum}",
           ins="%a: f32[4] {dp: P(sum)}", mesh=DP),
     "%c: f32[4] {dp: S(0)} = all_reduce(%a) {axis=dp, op=sum}",
     ["all_reduce on axis 'dp' gives R, but its result is declared S(0)"]),
    ("collective-axis-not-in-mesh",
     graph("%c: f32[4] = all_reduce(%a) {axis=tp, op=sum}", ins="%a: f32[4] {dp: P(sum)}",
           mesh=DP),
     "%c: f32[4] = all_reduce(%a) {axis=tp, op=sum}",
     ["attribute axis='tp' should be a mesh axis (dp)"]),
    ("collective-without-mesh", graph("%c: f32[4] = all_gather(%a) {axis=dp, dim=0}"),
     "%c: f32[4] = all_gather(%a) {axis=dp, dim=0}", ["the graph has no mesh"]),
    ("result-placed-on-missing-axis",
     graph("%c: f32[4] {tp: S(0)} = neg(%a)", mesh=DP),
     "%c: f32[4] {tp: S(0)} = neg(%a)",
     ["result %c is placed on axis 'tp', which the mesh lacks (dp)"]),
    ("input-placed-on-missing-axis", graph(ins="%a: f32[4] {tp: S(0)}", mesh=DP), None,
     ["input %a is placed on axis 'tp', which the mesh lacks (dp)"]),
    ("placement-without-mesh", graph(ins="%a: f32[4] {dp: S(0)}"), None,
     ["input %a is placed on axis 'dp', which the mesh lacks (no axes)"]),
    ("shard-dim-beyond-rank",
     graph("%c: f32[4] {dp: S(1)} = neg(%a)", mesh=DP),
     "%c: f32[4] {dp: S(1)} = neg(%a)", ["result %c is split on dim 1 but has rank 1"]),
    ("shard-dim-negative",
     graph("%c: f32[4] {dp: S(-1)} = neg(%a)", ins="%a: f32[4] {dp: S(-1)}", mesh=DP),
     None, ["input %a is split on dim -1 but has rank 1"]),
    ("opaque-fed-sharded-input",
     graph("%c: f32[4] {dp: S(0)} = opaque(%a) {target=my_kernel}",
           ins="%a: f32[4] {dp: S(0)}", mesh=DP),
     "%c: f32[4] {dp: S(0)} = opaque(%a) {target=my_kernel}",
     ["opaque cannot take inputs placed (S(0)) on axis 'dp'", "hint: insert a collective"]),
    ("partial-plus-shard",
     graph("%c: f32[4] {dp: P(sum)} = add(%a, %b)",
           ins="%a: f32[4] {dp: P(sum)}, %b: f32[4] {dp: S(0)}", mesh=DP),
     "%c: f32[4] {dp: P(sum)} = add(%a, %b)",
     ["add cannot take inputs placed (P(sum), S(0)) on axis 'dp'"]),
    ("partial-plus-replicated",
     graph("%c: f32[4] {dp: P(sum)} = add(%a, %b)", ins="%a: f32[4] {dp: P(sum)}, %b: f32[4]",
           mesh=DP),
     "%c: f32[4] {dp: P(sum)} = add(%a, %b)",
     ["add cannot take inputs placed (P(sum), R) on axis 'dp'"]),
    # --- roles
    ("opt-state-linked-to-non-param",
     graph(ins="%x: f32[4] batch, %m: f32[4] opt_state(of=%x, slot=momentum)"), None,
     ["optimizer state %m names %x, which is not a parameter input"]),
    ("opt-state-linked-to-unknown",
     graph(ins="%m: f32[4] opt_state(of=%w)"), None,
     ["optimizer state %m names %w, which is not a parameter input"]),
    ("output-undefined", graph(outs="%nope"), None,
     ["output %nope is not defined at graph level"]),
    ("output-replaces-non-input",
     graph("%c: f32[4] = neg(%a)", "%d: f32[4] = neg(%c)", outs="%d replaces(%c)"), None,
     ["output %d replaces %c, which is not a graph input"]),
    ("output-replaces-other-dtype",
     graph("%c: f16[4] = convert(%a) {dtype=f16}", outs="%c replaces(%a)"), None,
     ["output %c (f16[4]) replaces input %a of another type (f32[4])"]),
    ("output-replaces-other-placement",
     graph("%c: f32[8] = all_gather(%w) {axis=dp, dim=0}", ins="%w: f32[8] {dp: S(0)} param",
           outs="%c replaces(%w)", mesh=DP),
     None, ["output %c (f32[8]) replaces input %w of another type (f32[8] {dp: S(0)})"]),
    ("input-replaced-twice",
     graph("%c: f32[4] = neg(%a)", "%d: f32[4] = exp(%a)",
           outs="%c replaces(%a), %d replaces(%a)"), None,
     ["input %a is replaced by more than one output"]),
    ("two-loss-outputs",
     graph("%c: f32[] = reduce_sum(%a) {dims=[0]}", "%d: f32[] = reduce_sum(%b) {dims=[0]}",
           outs="%c loss, %d loss"), None,
     ["the graph has 2 loss outputs; at most one is allowed", "metric"]),
    ("non-scalar-loss", graph("%c: f32[4] = neg(%a)", outs="%c loss"), None,
     ["loss output %c is f32[4], not a scalar"]),
    # --- order
    ("stage-order",
     graph("%c: f32[4] = neg(%a) stage=1", "%d: f32[4] = neg(%c) stage=0"),
     "%d: f32[4] = neg(%c) stage=0", ["neg in stage 0 uses %c from a later stage 1"]),
    ("phase-order-forward-uses-backward",
     graph("%c: f32[4] = neg(%a) phase=backward", "%d: f32[4] = neg(%c) phase=forward"),
     "%d: f32[4] = neg(%c) phase=forward",
     ["neg (forward) uses %c made in the later backward phase"]),
    ("phase-order-backward-uses-update",
     graph("%c: f32[4] = neg(%a) phase=update", "%d: f32[4] = neg(%c) phase=backward"),
     "%d: f32[4] = neg(%c) phase=backward",
     ["neg (backward) uses %c made in the later update phase"]),
    # --- regions
    ("region-yields-invisible-value",
     cond_graph(["^t(%x: f32[4]) {", "%t: f32[4] = neg(%x)", "yield %t", "}"],
                ["^f(%y: f32[4]) {", "yield %t", "}"]),
     "%r: f32[4] = cond(%p, %a)", ["region ^f yields %t, which it cannot see"]),
    ("region-yields-own-result",
     cond_graph(["^t(%x: f32[4]) {", "yield %r", "}"]),
     "%r: f32[4] = cond(%p, %a)", ["region ^t yields %r, which it cannot see"]),
    ("cond-branch-arguments-mismatch",
     cond_graph(["^t(%x: f32[4]) {", "yield %x", "}"], ["^f(%y: f32[5]) {", "yield %a", "}"]),
     "%r: f32[4] = cond(%p, %a)",
     ["cond: branch 1 arguments vs inputs: (f32[5]) does not match (f32[4])"]),
    ("cond-branch-yields-mismatch",
     cond_graph(["^t(%x: f32[4]) {", "yield %x", "}"],
                ["^f(%y: f32[4]) {", "%z: f16[4] = convert(%y) {dtype=f16}", "yield %z", "}"]),
     "%r: f32[4] = cond(%p, %a)",
     ["cond: branch 1 yields vs results: (f16[4]) does not match (f32[4])"]),
    ("cond-predicate-not-scalar",
     cond_graph(["^t(%x: f32[4]) {", "yield %x", "}"], ins="%a: f32[4], %p: bool[2]"),
     "%r: f32[4] = cond(%p, %a)", ["cond's first input is a scalar int or bool"]),
    ("while-cond-not-bool",
     graph("%r: f32[4] = while(%a) (", "^c(%x: f32[4]) {", "yield %x", "}",
           "^b(%y: f32[4]) {", "yield %y", "}", ")"),
     "%r: f32[4] = while(%a)", ["cond must yield one bool[], yields (f32[4])"]),
]


@pytest.mark.parametrize("text,op_line,words", [c[1:] for c in VERIFY_CASES],
                         ids=[c[0] for c in VERIFY_CASES])
def test_verify_error(text: str, op_line: str | None, words: list[str]) -> None:
    g = parse(text)  # syntactically fine
    with pytest.raises(IRVerifyError) as ei:
        verify(g)
    msg = str(ei.value)
    if op_line is not None:
        assert f">> {op_line}\n" in msg + "\n", f"op {op_line!r} not marked in:\n{msg}"
        assert "in graph @g, op #" in msg
        assert ei.value.op_path is not None
    for w in words:
        assert w in msg, f"{w!r} not in:\n{msg}"
    assert ei.value.reason in msg


def test_verify_error_shows_neighbours_and_region_path() -> None:
    text = cond_graph(["^t(%x: f32[4]) {", "%s: f32[4] = neg(%x)", "%t: f32[4] = add(%x, %q)",
                       "yield %t", "}"])
    with pytest.raises(IRVerifyError) as ei:
        verify(parse(text))
    e = ei.value
    assert e.op_path == "op #0 ^t #1"
    lines = str(e).splitlines()
    i = lines.index("  >> %t: f32[4] = add(%x, %q)")
    assert lines[i - 1] == "     %s: f32[4] = neg(%x)"
    assert lines[i - 2] == "  in graph @g, op #0 ^t #1:"


def test_verify_error_message_has_only_its_op_marked() -> None:
    text = graph("%c: f32[4] = neg(%a)", "%d: f32[4] = neg(%c)", "%e: f32[5] = neg(%d)",
                 "%f: f32[4] = neg(%d)", "%g: f32[4] = neg(%f)", "%h: f32[4] = neg(%g)")
    with pytest.raises(IRVerifyError) as ei:
        verify(parse(text))
    msg = str(ei.value)
    assert msg.count(">>") == 1
    # two neighbours either side, no more
    assert "neg(%a)" in msg and "= neg(%f)" in msg and "neg(%g)" not in msg


def test_verify_cases_are_distinct() -> None:
    ids = [c[0] for c in VERIFY_CASES] + [c[0] for c in PARSE_CASES]
    assert len(ids) == len(set(ids))
    assert len(PARSE_CASES) >= 20 and len(VERIFY_CASES) >= 20
