"""Facts the passes read from op definitions and frontend marks, never from framework names:
how an op draws random numbers (data-parallel), whether it is a view (the plan's memory), and
the sharding facts of the table rows (zero padding, partial sums)."""

from __future__ import annotations

import pytest

from diphoma_compile.errors import PassError
from diphoma_compile.ir import parse, verify
from diphoma_compile.ir.ops import OPS, Category, is_view, op_def, random_draw
from diphoma_compile.mesh import Mesh
from diphoma_compile.passes import DataParallelRecord, PassContext, Pipeline
from diphoma_compile.report.plan import build_plan

# A one-layer step whose activations meet a random draw of their own shape (dropout) made
# by DRAW; the update is plain SGD.
STEP = """# diphoma-ir v1
graph @drop (
  %w: f32[8,8] param,
  %x: f32[4,8] batch,
  %k: key[] rng,
) {{
  %h: f32[4,8] = dot(%x, %w) {{lhs_contract=[1], rhs_contract=[0]}} phase=forward
  {draw}
  %d: f32[4,8] = mul(%h, %m) phase=forward loc="model.py:3"
  %loss: f32[] = reduce_mean(%d) {{dims=[0, 1]}} phase=forward
  %g: f32[8,8] = dot(%x, %d) {{lhs_contract=[0], rhs_contract=[0]}} phase=backward
  %w2: f32[8,8] = sub(%w, %g) phase=update
  return (
    %loss loss,
    %w2 replaces(%w),
  )
}}
"""
OPAQUE_GLOBAL = ('%m: f32[4,8] = opaque() {target="fw.rand", rng=global, effectful=true} '
                 'phase=forward loc="model.py:2"')
OPAQUE_KEY = '%m: f32[4,8] = opaque(%k) {target="fw.bits", rng=key} phase=forward'
NEUTRAL_KEYED = "%m: f32[4,8] = rng_uniform(%k) phase=forward"
NEUTRAL_SEEDED = "%m: f32[4,8] = rng_uniform() {seed=3} phase=forward"
NEUTRAL_FRESH = '%m: f32[4,8] = rng_uniform() phase=forward loc="model.py:2"'


def _dp(draw: str):
    g = verify(parse(STEP.format(draw=draw))).replace(mesh=Mesh({"dp": 2}))
    ctx = PassContext()
    out = Pipeline.from_spec("data-parallel{axis=dp}").run(g, ctx)
    return out, ctx


@pytest.mark.parametrize("draw, how", [(OPAQUE_GLOBAL, "global"), (OPAQUE_KEY, "key"),
                                       (NEUTRAL_KEYED, "key"), (NEUTRAL_SEEDED, "key"),
                                       (NEUTRAL_FRESH, "global")])
def test_random_draw_reads_the_mark_or_the_category(draw, how):
    g = verify(parse(STEP.format(draw=draw)))
    (op,) = [op for op in g.ops if op.results[0].name == "m"]
    assert random_draw(op) == how
    assert all(random_draw(o) is None for o in g.ops if o is not op)


@pytest.mark.parametrize("draw", [OPAQUE_GLOBAL, NEUTRAL_FRESH])
def test_per_process_draws_meeting_the_batch_are_noted(draw):
    g, ctx = _dp(draw)
    assert ctx.decision(DataParallelRecord).random_per_device == ("model.py:3",)
    plan = build_plan(g, ctx.decisions)
    assert plan.notes["data-parallel"]["random_per_device"] == ["model.py:3"]


@pytest.mark.parametrize("draw", [OPAQUE_KEY, NEUTRAL_KEYED, NEUTRAL_SEEDED])
def test_keyed_draws_meeting_the_batch_are_refused(draw):
    with pytest.raises(PassError, match="random numbers drawn from a JAX key meet per-device"):
        _dp(draw)


def test_views_are_layout_rows_and_marked_framework_ops():
    assert {n for n, d in OPS.items() if d.view} == {"reshape", "transpose", "slice",
                                                      "broadcast_in_dim"}
    text = STEP.format(draw=NEUTRAL_FRESH).replace(
        "  %d: f32[4,8]", '  %v: f32[4,8] = opaque(%h) {target="fw.alias", view=true} '
                          'phase=forward\n  %d: f32[4,8]')
    g = verify(parse(text))
    by = {op.results[0].name: op for op in g.ops}
    assert is_view(by["v"]) and not is_view(by["d"]) and not is_view(by["h"])


def test_sharding_facts_are_fields_of_the_rows():
    # zeros stay zeros (a flat shard's padding) through these; partial sums pass neg/add
    assert op_def("relu").zero_when == (0,) and op_def("exp").zero_when == ()
    assert op_def("select").zero_when == (1, 2)
    assert op_def("neg").linear and op_def("add").linear and not op_def("mul").linear
    assert op_def("reduce_mean").partial == "avg" and op_def("reduce_prod").partial is None
    assert all(d.category is Category.unary or d.category is Category.binary
               for d in OPS.values() if d.linear)
