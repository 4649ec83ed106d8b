"""ir/row_probe.py: a step traced at one row per share matched with its probe at two."""

from __future__ import annotations

from diphoma_compile.ir import parse
from diphoma_compile.ir.batch_coupling import split_batch
from diphoma_compile.ir.row_probe import RowProbe, probe_names, probe_rows


def _graph(rows: int, body: str) -> object:
    return parse(f"# diphoma-ir v1\ngraph @g (\n  %x: f32[{rows},4] batch,\n"
                 f"  %m: f32[{rows}] batch,\n  %w: f32[4] param,\n) {{\n{body}\n"
                 "  return (\n    %loss loss,\n  )\n}\n")


# a masked mean: sum(x @ w * m) / sum(m)
_MASKED = """
  %y{c}: f32[{r}] = dot(%x, %w) {{lhs_contract=[1], rhs_contract=[0]}} phase=forward
  %l{c}: f32[{r}] = mul(%y{c}, %m) phase=forward
  %s{c}: f32[] = reduce_sum(%l{c}) {{dims=[0]}} phase=forward
  %n{c}: f32[] = reduce_sum(%m) {{dims=[0]}} phase=forward
  %loss: f32[] = div(%s{c}, %n{c}) phase=forward"""


def test_values_match_through_a_copy_only_one_trace_has():
    """The probe (two rows) copies x before the product, as torch does where one row
    makes the copy needless; its names differ. Every value of the step is matched, and
    the masked mean found in the probe is carried to the one-row step's names."""
    one = _graph(1, _MASKED.format(c="", r=1))
    two = _graph(2, "  %xc: f32[2,4] = reshape(%x) phase=forward" + _MASKED.format(c="_", r=2)
                 .replace("dot(%x,", "dot(%xc,"))
    names = probe_names(one, two, 2)
    assert {names[k] for k in ("y_", "l_", "s_", "n_", "loss")} == {"y", "l", "s", "n", "loss"}
    assert split_batch(one).counted == () and not split_batch(one).judged
    split = split_batch(one, RowProbe.of(one, two, 2))
    (c,) = split.counted
    assert (c.made, c.count) == ("loss", "n") and split.judged and split.probed


def test_ops_reading_other_values_are_not_matched():
    """Two ops alike but for what they read: the probe's count sums x's first column
    where the step sums the mask. Not matched, so the mean over that count is not
    carried over (the analysis says less, never something of another value)."""
    one = _graph(1, _MASKED.format(c="", r=1))
    two = _graph(2, "  %col: f32[2,1] = slice(%x) {limits=[2, 1], starts=[0, 0]}"
                    " phase=forward\n  %colr: f32[2] = reshape(%col) phase=forward"
                 + _MASKED.format(c="_", r=2).replace("reduce_sum(%m)", "reduce_sum(%colr)"))
    names = probe_names(one, two, 2)
    assert names.get("y_") == "y" and "n_" not in names and "loss" not in names
    split = split_batch(one, RowProbe.of(one, two, 2))
    assert split.counted == () and not split.judged        # said, not dropped silently
    assert [u.split(" (")[1] for u in split.unmatched] == ["div): divides by a sum over "
                                                            "the batch"]


def test_an_op_reading_nothing_must_fit():
    """At one row an ``iota`` of the rows is an ``iota`` of 1, which an ``iota`` of 12 (the
    heads) must not be taken for, however the two sequences align."""
    one = _graph(1, "  %h: i32[12] = iota() {dim=0} phase=forward" + _MASKED.format(c="", r=1))
    two = _graph(2, "  %h_: i32[1] = iota() {dim=0} phase=forward" + _MASKED.format(c="_", r=2))
    names = probe_names(one, two, 2)
    assert "h_" not in names and names["loss"] == "loss"


def test_an_op_at_another_rank_links_what_follows_but_is_not_named():
    """JAX's pick of one label per row drops the rows' dim of size 1 from its index: the
    two traces' reshapes differ in rank. They are paired in the stretch between aligned
    ops, as reading the same values, so the ops after them are matched (the masked mean
    is carried back); the reshapes' own results are not named."""
    body = """
  %p{c}: f32[{r},4] = mul(%x, %x) phase=forward
  %q{c}: f32[{sh}] = reshape(%p{c}) phase=forward
  %t{c}: f32[{r},4] = reshape(%q{c}) phase=forward
  %y{c}: f32[{r}] = dot(%t{c}, %w) {{lhs_contract=[1], rhs_contract=[0]}} phase=forward
  %l{c}: f32[{r}] = mul(%y{c}, %m) phase=forward
  %s{c}: f32[] = reduce_sum(%l{c}) {{dims=[0]}} phase=forward
  %n{c}: f32[] = reduce_sum(%m) {{dims=[0]}} phase=forward
  %loss: f32[] = div(%s{c}, %n{c}) phase=forward"""
    one = _graph(1, body.format(c="", r=1, sh="4"))
    two = _graph(2, body.format(c="_", r=2, sh="2,4"))
    names = probe_names(one, two, 2)
    assert "q_" not in names and names["t_"] == "t" and names["loss"] == "loss"
    (c,) = split_batch(one, RowProbe.of(one, two, 2)).counted
    assert (c.made, c.count) == ("loss", "n")


def test_probe_rows_is_a_prime_no_constant_of_the_step_is_a_multiple_of():
    """At two rows a loss halved by hand (``sum / 2``) was taken for a mean over them. The
    probe's rows are 7, or the next prime where a constant (or its reciprocal) of the
    step is a multiple of it."""
    plain = _graph(1, _MASKED.format(c="", r=1))
    assert probe_rows(plain) == 7
    for value in (14.0, 1 / 7, 7.0):
        g = _graph(1, f"  %k: f32[] = full() {{value={value}}} phase=forward"
                   + _MASKED.format(c="", r=1))
        assert probe_rows(g) == 11, value
    # a mask's fill (-1e9, float32's lowest) is no multiple of 7: large constants were
    # taken for multiples of every prime (a review, 2026-12-06: probed at 37)
    for value in (0.5, -1e9, -3.4028234663852886e38):
        assert probe_rows(_graph(1, f"  %k: f32[] = full() {{value={value}}} phase=forward"
                                 + _MASKED.format(c="", r=1))) == 7, value


def test_a_transpose_of_a_square_value_is_not_read_through():
    """Only the probe transposes a square value (at one row it is 1 x 1): the result is
    not the operand's value in the operand's layout, so it is not named as it (a rows dim
    carried so would point at the wrong dim)."""
    sq = ("  %sq: f32[{r},{r}] = dot(%x, %x) {{lhs_contract=[1], rhs_contract=[1]}} "
          "phase=forward\n")
    one = _graph(1, sq.format(r=1) + _MASKED.format(c="", r=1))
    two = _graph(2, sq.format(r=2) + "  %t: f32[2,2] = transpose(%sq) {perm=[1, 0]} "
                 "phase=forward\n" + _MASKED.format(c="_", r=2))
    names = probe_names(one, two, 2)
    assert names["sq"] == "sq" and "t" not in names
