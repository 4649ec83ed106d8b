"""ir/grad_seed.py: the value a backward pass differentiates, found from its seed, and the
gradients' kind the batch analysis reads from it (``BatchSplit.gradients``)."""

from __future__ import annotations

import pytest

from diphoma_compile.ir import parse
from diphoma_compile.ir.batch_coupling import split_batch
from diphoma_compile.ir.grad_seed import differentiated

# a mean and a sum of the same terms on one line (JAX's value_and_grad(has_aux=True) of
# (mean, sum)), then the backward of whichever {seed} makes: the seed, a constant one,
# transposed by the reader that mirrors the differentiated value's last op
_STEP = """# diphoma-ir v1
graph @g (
  %x: f32[8,4] batch,
  %w: f32[4,3] param,
) {{
  %y: f32[8,3] = dot(%x, %w) {{lhs_contract=[1], rhs_contract=[0]}} phase=forward loc="l.py:1"
  %t: f32[8,3] = mul(%y, %y) phase=forward loc="l.py:1"
  %s: f32[] = reduce_sum(%t) {{dims=[0, 1]}} phase=forward loc="l.py:2"
  %n: f32[] = full() {{value=24.0}} phase=forward
  %m: f32[] = div(%s, %n) phase=forward loc="l.py:2"
  %one: f32[] = full() {{value=1.0}} phase=forward
  %half: f32[] = full() {{value=0.5}} phase=forward
  %h: f32[] = mul(%s, %half) phase=forward loc="l.py:3"
{seed}
  %gt: f32[8,3] = mul(%ct, %y) phase=backward loc="l.py:1"
  %gw: f32[4,3] = dot(%x, %gt) {{lhs_contract=[0], rhs_contract=[0]}} phase=backward loc="l.py:1"
  %nw: f32[4,3] = sub(%w, %gw) phase=update
  return (
    %{returned} loss,
    %nw replaces(%w),
  )
}}
"""
_MEAN = """  %c: f32[] = div(%one, %n) phase=backward loc="l.py:2"
  %ct: f32[8,3] = broadcast_in_dim(%c) {dims=[]} phase=backward loc="l.py:2\""""
_SUM = """  %ct: f32[8,3] = broadcast_in_dim(%one) {dims=[]} phase=backward loc="l.py:2\""""
_HALF = """  %c: f32[] = mul(%one, %half) phase=backward loc="l.py:3"
  %ct: f32[8,3] = broadcast_in_dim(%c) {dims=[]} phase=backward loc="l.py:2\""""


@pytest.mark.parametrize("seed, returned, found, gradients, loss", [
    (_MEAN, "s", ["m"], "avg", "sum"),     # the mean differentiated, the sum returned
    (_SUM, "m", ["s"], "sum", "avg"),      # the sum differentiated, the mean returned
    (_HALF, "m", ["h"], "sum", "avg"),     # half the sum: a sum scaled
    (_MEAN, "m", ["m"], "avg", "avg"),
])
def test_the_value_differentiated_is_found_from_the_seed(seed, returned, found, gradients,
                                                         loss):
    """The seed's first reader is the transpose of the value's last op, at its line with
    its other operands: ``div(1, n)`` mirrors ``s / n``, a broadcast of the one mirrors
    the ``reduce_sum`` at its line, ``mul(1, 0.5)`` mirrors ``s * 0.5``. The gradients
    combine as that value does, whatever the step returns (before, as the loss returned:
    summed where a mean was differentiated, 8x on 8 devices)."""
    graph = parse(_STEP.format(seed=seed, returned=returned))
    assert differentiated(graph) == found
    split = split_batch(graph)
    assert split.gradients == gradients
    assert split.combine.get(returned, "avg") == loss


def test_a_seed_without_a_mirror_leaves_the_gradients_to_the_loss():
    """A constant one read by the backward with no forward op mirroring its reader (its
    line lost): the value differentiated is not known, and the gradients combine as the
    loss returned does (``gradients`` None)."""
    graph = parse(_STEP.format(seed=_SUM.replace('loc="l.py:2"', 'loc="elsewhere.py:9"'),
                               returned="m"))
    assert differentiated(graph) is None
    assert split_batch(graph).gradients is None


def test_the_value_dropped_as_dead_is_found_on_the_step_as_traced():
    """``jax.grad`` computes the value differentiated and drops it: a pass removing dead
    ops removes its mirror. The step as traced (``traced``) still has it."""
    from diphoma_compile.passes.dce import dce_graph
    graph = parse(_STEP.format(seed=_HALF, returned="m"))
    dead = dce_graph(graph)
    assert "h" not in {v.name for op in dead.ops for v in op.results}
    assert split_batch(dead).gradients is None
    assert split_batch(dead, traced=graph).gradients == "sum"
