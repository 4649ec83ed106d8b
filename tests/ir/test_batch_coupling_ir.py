"""ir/batch_coupling.py on hand-written steps: which forward ops combine examples of the
batch (split along dimension 0), which are per example or a mean over examples."""

from __future__ import annotations

from diphoma_compile.ir import parse
from diphoma_compile.ir.batch_coupling import batch_coupling, split_batch, split_notes


def _graph(body: str, inputs: str = "%x: f32[8,4] batch, %w: f32[4,3] param",
           outputs: str = "%loss loss"):
    return parse(f"# diphoma-ir v1\ngraph @g (\n  {inputs},\n) {{\n{body}\n"
                 f"  return (\n    {outputs},\n  )\n}}\n")


def _found(body: str, **kw) -> list:
    return batch_coupling(_graph(body, **kw))


def test_a_mean_over_examples_of_per_example_terms_combines_nothing():
    assert _found("""
  %y: f32[8,3] = dot(%x, %w) {lhs_contract=[1], rhs_contract=[0]} phase=forward
  %e: f32[8,3] = exp(%y) phase=forward
  %s: f32[] = reduce_sum(%e) {dims=[0, 1]} phase=forward
  %n: f32[] = full() {value=24.0} phase=forward
  %loss: f32[] = div(%s, %n) phase=forward""") == []


def test_a_maximum_over_the_batch_returned_as_a_minimum_combines_nothing():
    """-max(-x) as a metric: data parallelism combines it by min (passes/data_parallel.py)."""
    assert _found("""
  %loss: f32[] = reduce_mean(%x) {dims=[0, 1]} phase=forward
  %n: f32[8,4] = neg(%x) phase=forward
  %m: f32[] = reduce_max(%n) {dims=[0, 1]} phase=forward
  %mn: f32[] = neg(%m) phase=forward""", outputs="%loss loss,\n    %mn metric") == []


def test_a_sum_over_the_batch_in_nonlinear_math_is_found():
    found = _found("""
  %y: f32[8,3] = dot(%x, %w) {lhs_contract=[1], rhs_contract=[0]} phase=forward
  %m: f32[3] = reduce_mean(%y) {dims=[0]} phase=forward
  %loss0: f32[3] = exp(%m) phase=forward
  %loss: f32[] = reduce_sum(%loss0) {dims=[0]} phase=forward""")
    assert [(c.op, c.certain) for c in found] == [("exp", True)]
    assert "not linear" in found[0].why


def test_scalar_math_on_sums_is_judged_by_its_reader():
    """A count clamped to at least one is still a count: dividing by it depends on the
    data; a loss that is the log of a mean over the batch combines examples."""
    count = _found("""
  %l: f32[8,4] = mul(%x, %x) phase=forward
  %s: f32[] = reduce_sum(%l) {dims=[0, 1]} phase=forward
  %c: f32[] = reduce_sum(%m) {dims=[0]} phase=forward
  %one: f32[] = full() {value=1.0} phase=forward
  %k: f32[] = max(%c, %one) phase=forward
  %loss: f32[] = div(%s, %k) phase=forward""", inputs="%x: f32[8,4] batch, %m: f32[8] batch")
    assert [(c.op, c.certain) for c in count] == [("div", False)]
    logmean = _found("""
  %s: f32[] = reduce_mean(%x) {dims=[0, 1]} phase=forward
  %loss: f32[] = log(%s) phase=forward""")
    assert [(c.op, c.certain) for c in logmean] == [("log", True)]


def test_a_product_of_two_batch_values_across_examples_is_found():
    """A contrastive loss's logits: every example against every other."""
    found = _found("""
  %t: f32[4,8] = transpose(%x) {perm=[1, 0]} phase=forward
  %g: f32[8,8] = dot(%x, %t) {lhs_contract=[1], rhs_contract=[0]} phase=forward
  %loss: f32[] = reduce_sum(%g) {dims=[0, 1]} phase=forward""")
    assert [(c.op, c.certain) for c in found] == [("dot", True)]


def test_a_division_by_a_count_over_the_batch_depends_on_the_data():
    graph = _graph("""
  %l: f32[8,4] = mul(%x, %x) phase=forward
  %r: f32[8] = reduce_sum(%l) {dims=[1]} phase=forward
  %lm: f32[8] = mul(%r, %m) phase=forward
  %s: f32[] = reduce_sum(%lm) {dims=[0]} phase=forward
  %c: f32[] = reduce_sum(%m) {dims=[0]} phase=forward
  %loss: f32[] = div(%s, %c) phase=forward""", inputs="%x: f32[8,4] batch, %m: f32[8] batch")
    found = batch_coupling(graph)
    assert [(c.op, c.certain) for c in found] == [("div", False)]
    assert "count" in found[0].why
    # the plan's two lists: nothing that differs whatever the data; this one
    assert split_notes(found) == ((), (str(found[0]),))


def test_constants_take_the_placement_their_reader_needs():
    """A constant broadcast to the batch's shape is the same on every share; so, for this
    question, are positions along the batch (an iota picking each row's entry): the share
    builds them for its own rows."""
    assert _found("""
  %c: f32[] = full() {value=2.0} phase=forward
  %b: f32[8,4] = broadcast_in_dim(%c) {dims=[]} phase=forward
  %y: f32[8,4] = mul(%x, %b) phase=forward
  %loss: f32[] = reduce_mean(%y) {dims=[0, 1]} phase=forward""") == []
    assert _found("""
  %i: f32[8,4] = iota() {dim=0} phase=forward
  %y: f32[8,4] = mul(%x, %i) phase=forward
  %loss: f32[] = reduce_mean(%y) {dims=[0, 1]} phase=forward""") == []


def test_a_mean_plus_a_term_of_the_weights_stays_a_mean():
    """mean + weight decay: the shares' results average to the batch's. A sum plus the
    term is found: adding the shares' results counts the term once per share, averaging
    them divides the sum."""
    body = """
  %l: f32[8,4] = mul(%x, %x) phase=forward
  %m: f32[] = {kind}(%l) {{dims=[0, 1]}} phase=forward
  %ww: f32[4,3] = mul(%w, %w) phase=forward
  %r: f32[] = reduce_sum(%ww) {{dims=[0, 1]}} phase=forward
  %loss: f32[] = add(%m, %r) phase=forward"""
    assert _found(body.format(kind="reduce_mean")) == []
    assert [(c.op, c.certain) for c in _found(body.format(kind="reduce_sum"))] == \
        [("add", True)]


_SUM_OR_MEAN = """
  %l: f32[8,4] = mul(%x, %x) phase=forward
  %r: f32[8] = reduce_sum(%l) {{dims=[1]}} phase=forward
  %s: f32[] = reduce_sum(%r) {{dims=[0]}} phase=forward
  %n: f32[] = full() {{value={n}}} phase=forward
  %loss: f32[] = div(%s, %n) phase=forward"""


def test_a_sum_over_the_rows_is_told_from_a_mean():
    """A sum divided by the elements it adds (the rows, or the rows times a summed dim:
    ``jnp.mean`` as JAX writes it, ``sum() / x.shape[0]``) is a mean: the shares' values
    average to the batch's. Divided by another number (the global batch's size, 64, or
    a scale) it stays a sum: they add up to it. Neither is a coupling."""
    kinds = {}
    for n in (8.0, 32.0, 64.0, 2.0):
        split = split_batch(_graph(_SUM_OR_MEAN.format(n=n)))
        assert split.couplings == ()
        kinds[n] = split.combine["loss"]
    assert kinds == {8.0: "avg", 32.0: "avg", 64.0: "sum", 2.0: "sum"}


def test_a_mean_added_to_a_sum_is_found():
    found = _found("""
  %m: f32[] = reduce_mean(%x) {dims=[0, 1]} phase=forward
  %s: f32[] = reduce_sum(%x) {dims=[0, 1]} phase=forward
  %loss: f32[] = add(%m, %s) phase=forward""")
    assert [(c.op, c.certain) for c in found] == [("add", True)]


def test_a_nonlinear_loss_backpropagated_but_not_returned_is_found():
    """sqrt(mean) differentiated while the step returns something else."""
    found = _found("""
  %m: f32[] = reduce_mean(%x) {dims=[0, 1]} phase=forward
  %s: f32[] = sqrt(%m) phase=forward
  %loss: f32[] = neg(%m) phase=forward
  %g: f32[] = div(%s, %m) phase=backward""")
    assert [(c.op, c.certain) for c in found] == [("sqrt", True)]


def test_a_loss_that_is_a_maximum_over_the_batch_is_found():
    found = _found("""
  %loss: f32[] = reduce_max(%x) {dims=[0, 1]} phase=forward""")
    assert [(c.op, c.certain) for c in found] == [("reduce_max", True)]


def test_backward_and_update_are_not_judged():
    """Only the forward decides: the backward's sums over the batch (a weight's gradient)
    are what data parallelism averages."""
    assert _found("""
  %y: f32[8,3] = dot(%x, %w) {lhs_contract=[1], rhs_contract=[0]} phase=forward
  %loss: f32[] = reduce_mean(%y) {dims=[0, 1]} phase=forward
  %g: f32[3] = reduce_sum(%y) {dims=[0]} phase=backward
  %e: f32[3] = exp(%g) phase=backward""") == []


def test_a_division_marked_as_a_mean_of_the_rows_sum_needs_no_second_trace():
    """A sum over the rows divided by their number (8) may be a mean or a sum divided by a
    number that equals them here: ``scaled_by_rows`` lists it for the step traced at more
    rows. Marked ``{mean=true}`` by the frontend (jnp.mean's division) it is not listed,
    unless what it divides was summed over the rows before (a mean of a sum over rows:
    the mark says nothing of that earlier sum)."""
    from diphoma_compile.ir.batch_coupling import scaled_by_rows
    mean = """
  %s: f32[] = reduce_sum(%x) {dims=[0]} phase=forward
  %n: f32[] = full() {value=8.0} phase=forward
  %loss: f32[] = div(%s, %n)%s phase=forward"""
    inputs = "%x: f32[8] batch"
    assert scaled_by_rows(_graph(mean.replace("%s phase", " phase"), inputs=inputs))
    assert scaled_by_rows(_graph(mean.replace("%s phase", " {mean=true} phase"),
                                 inputs=inputs)) == []
    earlier = """
  %r: f32[8] = reduce_sum(%x) {dims=[0]} phase=forward
  %s: f32[] = reduce_sum(%r) {dims=[0]} phase=forward
  %n: f32[] = full() {value=8.0} phase=forward
  %loss: f32[] = div(%s, %n) {mean=true} phase=forward"""
    assert scaled_by_rows(_graph(earlier, inputs="%x: f32[8,8] batch"))
