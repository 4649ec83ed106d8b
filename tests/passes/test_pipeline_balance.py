"""Where the pipeline pass cuts (passes/pipeline_balance.py), on plain cost lists: the
dynamic program's balanced cuts, and each cut's move to where its two stages plus its
sends take least time."""

from __future__ import annotations

from diphoma_compile.passes.pipeline_balance import balanced_cuts, cheapest_near


def prefix(cost: list[float]) -> list[float]:
    out = [0.0]
    for c in cost:
        out.append(out[-1] + c)
    return out


def test_balanced_cuts_minimise_the_largest_stage():
    cost = [1, 1, 1, 1, 4, 2, 2]
    assert balanced_cuts(cost, [1, 2, 3, 4, 5, 6], 2) == [4]          # 4 | 8 -> 4 and 8
    assert balanced_cuts(cost, [1, 2, 3, 4, 5, 6], 3) == [4, 5]       # 4 | 4 | 4
    assert balanced_cuts(cost, [2, 6], 3) == [2, 6]                    # only these places
    assert balanced_cuts(cost, [3], 3) is None                         # too few places
    assert balanced_cuts(cost, [], 1) == []


def test_a_cut_moves_where_a_message_less_is_worth_the_imbalance():
    """Eight ops of 1 s; the balanced cut at 4 sends two values (5 s of latency each way),
    those at 3 and 5 one: 3 | 5 stages plus 2 x 5 s (15) beats 4 | 4 plus 2 x 10 s (24),
    and of the two equal ones the nearer the balance, then the earlier, wins. With a
    latency of 0.1 s the imbalance costs more than the message and the cut stays."""
    pre = prefix([1.0] * 8)
    points = [2, 3, 4, 5]
    for latency, want in ((5.0, 3), (0.1, 4)):
        values = {2: 1, 3: 1, 4: 2, 5: 1}
        xfer = [2 * values.get(k, 1) * latency for k in range(9)]
        assert cheapest_near([4], points, pre, xfer) == [want], latency


def test_on_a_tie_a_cut_stays_where_the_balance_put_it():
    pre = prefix([1.0] * 8)
    assert cheapest_near([4], [3, 4, 5], pre, [0.0] * 9) == [4]
    # each cut moves between its neighbours only (the first moved, the second after it)
    assert cheapest_near([3, 6], [2, 3, 4, 6, 7], pre, [0.0] * 9) == [3, 6]


def test_every_stage_holds_an_op_that_reads_a_parameter():
    """Ops 0 and 1 read parameters (a layer's matmul), 2 and 3 are activations (a loss):
    unconstrained, 2 | 2 is the balance and leaves the second stage without a parameter;
    constrained, the cut falls at 1 (1 | 3), and 3 stages cannot each hold one of two. A
    cut's move keeps both of its stages holding one, however cheap the sends elsewhere."""
    cost, holds, points = [1, 1, 1, 1], [True, True, False, False], [1, 2, 3]
    assert balanced_cuts(cost, points, 2) == [2]
    assert balanced_cuts(cost, points, 2, holds) == [1]
    assert balanced_cuts(cost, points, 3, holds) is None
    xfer = [0.0, 5.0, 0.0, 5.0, 0.0]          # a cut at 2 sends least
    assert cheapest_near([1], points, prefix(cost), xfer) == [2]
    assert cheapest_near([1], points, prefix(cost), xfer, holds) == [1]
