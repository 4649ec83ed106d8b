"""Analyses: producers and users, dependency order, liveness and peak bytes, costs."""

from __future__ import annotations

import textwrap

import pytest

from diphoma_compile.ir import parse, verify
from diphoma_compile.ir.analysis import (
    OpCost,
    dependency_graph,
    free_inputs,
    graph_cost,
    liveness,
    op_cost,
    producers,
    topo_order,
    users,
)


def g_(text: str):
    return verify(parse(textwrap.dedent(text)))


def names(ops) -> list[str]:
    return [op.results[0].name if op.results else op.name for op in ops]


# ====================================================================== producers and users

REGIONS = """\
    graph @g (
      %a: f32[4], %b: f32[4], %p: bool[]
    ) {
      %c: f32[4] = add(%a, %b)
      %r: f32[4] = cond(%p, %c) (
        ^t(%x: f32[4]) {
          %t: f32[4] = mul(%x, %b)
          yield %t
        }
        ^f(%y: f32[4]) {
          %s: f32[4] = call() (
            ^body() {
              yield %a
            }
          )
          yield %s
        }
      )
      %d: f32[4] = neg(%r)
      return (%d)
    }
"""


def test_producers_include_nested_ops() -> None:
    g = g_(REGIONS)
    prod = producers(g)
    assert set(prod) == {"c", "r", "t", "s", "d"}  # not inputs, not region arguments
    assert prod["c"] is g.ops[0] and prod["r"] is g.ops[1] and prod["d"] is g.ops[2]
    cond = g.ops[1]
    assert prod["t"] is cond.regions[0].ops[0]
    assert prod["s"] is cond.regions[1].ops[0]


def test_users_count_region_captures() -> None:
    g = g_(REGIONS)
    add, cond, neg = g.ops
    mul = cond.regions[0].ops[0]
    call = cond.regions[1].ops[0]
    u = users(g)
    # %b: read by add, and inside ^t by mul, which makes the cond around it a user too
    assert u["b"] == [add, mul, cond]
    # %a: read by add, and yielded from a region nested two deep: call and cond both use it
    assert u["a"] == [add, call, cond]
    assert u["c"] == [cond] and u["p"] == [cond]
    assert u["t"] == [cond] and u["s"] == [cond]  # region yields are uses by the op
    assert u["r"] == [neg]
    assert "d" not in u  # graph outputs are not ops
    assert all(len(v) == len({id(o) for o in v}) for v in u.values())  # no duplicates


def test_free_inputs_of_an_op_with_regions() -> None:
    g = g_(REGIONS)
    assert free_inputs(g.ops[1]) == ["p", "c", "b", "a"]
    assert free_inputs(g.ops[0]) == ["a", "b"]


# ====================================================================== dependency order

CHAIN = """\
    graph @g mesh[pp=2] (
      %x: f32[4]
    ) {
      %a: f32[4] = neg(%x)
      %b: f32[4] = exp(%x)
      %c: f32[4] = add(%a, %b)
      send(%c) {axis=pp, peer=1}
      %r: f32[4] = recv() {axis=pp, peer=0}
      %d: f32[4] = mul(%r, %c)
      return (%d)
    }
"""


def test_topo_order_of_a_program_in_order_is_program_order() -> None:
    g = g_(CHAIN)
    assert topo_order(g) == list(g.ops)
    dg = dependency_graph(g)
    assert set(dg.edges) == {(0, 2), (1, 2), (2, 3), (2, 5), (4, 5)}
    assert dg.edges[2, 3]["value"] == "c"


def test_topo_order_respects_dependencies_of_reordered_ops() -> None:
    g = g_(CHAIN)
    a, b, c, send, recv, d = g.ops
    order = topo_order(g.replace(ops=(d, c, b, a, send, recv)))
    pos = {id(op): k for k, op in enumerate(order)}
    for producer, consumer in [(a, c), (b, c), (c, d), (recv, d), (c, send)]:
        assert pos[id(producer)] < pos[id(consumer)]
    # among ready ops, the earlier one in the list goes first: b before a
    assert names(order[:3]) == ["b", "a", "c"]


def test_topo_order_follows_region_captures() -> None:
    g = g_(REGIONS)
    add, cond, neg = g.ops
    order = topo_order(g.replace(ops=(neg, cond, add)))
    assert order == [add, cond, neg]


def test_effectful_ops_keep_their_relative_order() -> None:
    g = g_(CHAIN)
    a, b, c, send, recv, d = g.ops
    # send is listed first but needs %c, made last; recv needs nothing. Dependencies alone
    # would run recv before send; effects must stay in their listed order.
    order = topo_order(g.replace(ops=(send, recv, a, b, c, d)))
    assert names(order).index("send") < names(order).index("r")
    assert names(order) == ["a", "b", "c", "send", "r", "d"]
    # and the other way round: recv listed first stays first
    order = topo_order(g.replace(ops=(recv, send, a, b, c, d)))
    assert names(order).index("r") < names(order).index("send")


def test_pure_independent_ops_keep_program_order() -> None:
    g = g_(CHAIN)
    a, b, c, send, recv, d = g.ops
    assert names(topo_order(g.replace(ops=(b, a, c, send, recv, d)))) == \
        ["b", "a", "c", "send", "r", "d"]


# ====================================================================== liveness

LIVE = """\
    graph @g {mesh}(
      %x: f32[8]{x}
    ) {{
      %a: f32[8,8]{a} = broadcast_in_dim(%x) {{dims=[1]}}
      %b: f32[8,8]{a} = exp(%a)
      %c: f32[8]{x} = reduce_sum(%b) {{dims=[0]}}
      %d: f32[8]{x} = add(%c, %x)
      return (%d)
    }}
"""


def test_liveness_small_graph_by_hand() -> None:
    g = g_(LIVE.format(mesh="", x="", a=""))
    lv = liveness(g)
    assert lv.born == {"x": -1, "a": 0, "b": 1, "c": 2, "d": 3}
    assert lv.last_use == {"x": 3, "a": 1, "b": 2, "c": 3, "d": 4}  # outputs live to the end
    #                 x    a    b    c   d
    # op 0 (a):      32 + 256                 = 288
    # op 1 (b):      32 + 256 + 256           = 544
    # op 2 (c):      32 +       256 + 32      = 320
    # op 3 (d):      32 +             32 + 32 =  96
    assert lv.bytes_at == (288, 544, 320, 96)
    assert lv.peak_bytes == 544 and lv.peak_index == 1
    assert liveness(g, per_device=False) == lv  # no mesh: per device is the whole tensor


def test_liveness_per_device_shrinks_under_shards() -> None:
    g = g_(LIVE.format(mesh="mesh[dp=4] ", x=" {dp: S(0)}", a=" {dp: S(1)}"))
    lv = liveness(g)
    assert lv.bytes_at == (72, 136, 80, 24)  # each split value holds a quarter
    assert lv.peak_bytes == 136 and lv.peak_index == 1
    logical = liveness(g, per_device=False)
    assert logical.bytes_at == (288, 544, 320, 96)


def test_liveness_flat_shards_count_padding() -> None:
    g = g_("""\
        graph @g mesh[dp=4] (
          %w: f32[10] {dp: F}, %lr: f32[]
        ) {
          %s: f32[10] {dp: F} = mul(%w, %lr)
          %n: f32[10] {dp: F} = sub(%w, %s)
          return (%n replaces(%w))
        }
    """)
    lv = liveness(g)
    # a flat shard of 10 floats over 4 devices holds 3 (padded): 12 bytes
    assert lv.bytes_at == (12 + 4 + 12, 12 + 12 + 12)
    assert liveness(g, per_device=False).bytes_at == (40 + 4 + 40, 40 + 40 + 40)


def test_liveness_dead_values_and_captures() -> None:
    g = g_("""\
        graph @g (
          %x: f32[4], %unused: f32[100]
        ) {
          %dead: f32[16] = iota() {dim=0}
          %y: f32[4] = neg(%x)
          %z: f32[4] = call() (
            ^f() {
              %w: f32[4] = add(%x, %y)
              yield %w
            }
          )
          return (%z)
        }
    """)
    lv = liveness(g)
    assert lv.last_use["dead"] == 0          # a value never used lives for its own op
    assert lv.last_use["x"] == 2             # read inside the region of op 2
    assert lv.last_use["y"] == 2
    assert "w" not in lv.born                # region values are not top-level values
    # op 0: x 16 + unused 400 + dead 64; op 1: x + y; op 2: x + y + z
    assert lv.bytes_at == (16 + 400 + 64, 16 + 16, 16 + 16 + 16)
    assert lv.peak_index == 0


# ====================================================================== costs

BATCH_DOT = "{lhs_batch=[0], lhs_contract=[2], rhs_batch=[0], rhs_contract=[1]}"


def test_dot_and_elementwise_flops() -> None:
    g = g_("""\
        graph @g (
          %x: f32[32,8], %w: f32[8,16], %a: f32[4,8,2], %b: f32[4,2,3], %v: f32[10]
        ) {
          %h: f32[32,16] = dot(%x, %w) {lhs_contract=[1], rhs_contract=[0]}
          %k: f32[32,16] = add(%h, %h)
          %bd: f32[4,8,3] = dot(%a, %b) BATCH_DOT
          %ge: f32[10] = gelu(%v)
          %s: f32[16] = reduce_sum(%k) {dims=[0]}
          %t: f32[16,32] = transpose(%k) {perm=[1, 0]}
          return (%s, %bd, %ge, %t)
        }
    """.replace("BATCH_DOT", BATCH_DOT))
    total, per = graph_cost(g)
    M, N, K = 32, 16, 8
    assert per[0].flops == 2 * M * N * K == 8192
    assert per[0].bytes == (32 * 8 + 8 * 16 + 32 * 16) * 4  # read both, write the result
    assert per[1].flops == 32 * 16                           # one flop per result element
    assert per[2].flops == 2 * 4 * 8 * 3 * 2                 # batch * M * N * K, times 2
    assert per[3].flops == 8 * 10                            # gelu: 8 flops per element
    assert per[4].flops == 32 * 16                           # reduce: one per input element
    assert per[5].flops == 0                                 # layout ops move, not compute
    assert all(c.comm_bytes == 0 for c in per)
    assert total == sum(per, OpCost())


def test_region_ops_are_counted_on_their_op() -> None:
    g = g_("""\
        graph @g (
          %x: f32[4]
        ) {
          %z: f32[4] = call(%x) (
            ^f(%a: f32[4]) {
              %b: f32[4] = add(%a, %a)
              %c: f32[4] = exp(%b)
              yield %c
            }
          )
          return (%z)
        }
    """)
    total, per = graph_cost(g)
    # the call itself costs nothing; add reads 2x16 B, writes 16 B; exp reads 16, writes 16
    assert per[0].flops == 8 and per[0].bytes == (16 + 16 + 16) + (16 + 16)
    assert total.flops == 8


COMM = """\
    graph @g mesh[dp=4, tp=2] (
      %p: f32[256] {dp: P(sum)}, %s: f32[256] {dp: S(0)}, %q: f32[256] {tp: P(sum)}
    ) {
      %r: f32[256] = all_reduce(%p) {axis=dp, op=sum}
      %rs: f32[256] {dp: S(0)} = reduce_scatter(%p) {axis=dp, dim=0, op=sum}
      %ag: f32[256] = all_gather(%s) {axis=dp, dim=0}
      %rt: f32[256] = all_reduce(%q) {axis=tp, op=sum}
      %ts: f32[256] {dp: F} = take_shard(%r) {axis=dp, dim=flat}
      return (%r, %rs, %ag, %rt, %ts)
    }
"""


def test_collective_comm_bytes_by_ring_formulas() -> None:
    g = g_(COMM)
    total, per = graph_cost(g)
    nbytes, n = 256 * 4, 4
    assert per[0].comm_bytes == 2 * (n - 1) / n * nbytes == 1536   # all_reduce
    assert per[1].comm_bytes == (n - 1) / n * nbytes == 768         # reduce_scatter
    assert per[2].comm_bytes == (n - 1) / n * nbytes == 768         # all_gather
    assert per[3].comm_bytes == 2 * (2 - 1) / 2 * nbytes == 1024    # all_reduce on tp=2
    assert per[4].comm_bytes == 0                                   # take_shard: a slice
    assert total.comm_bytes == 1536 + 768 + 768 + 1024
    # the reductions also compute: one add per element
    assert per[0].flops == per[1].flops == 256 and per[2].flops == 0


def test_op_cost_on_a_size_one_axis_sends_nothing() -> None:
    g = g_(COMM)
    types = g.value_types()
    assert op_cost(g.ops[0], types, {"dp": 1, "tp": 2}).comm_bytes == 0
    assert op_cost(g.ops[0], types, {"dp": 8, "tp": 2}).comm_bytes == int(2 * 7 / 8 * 1024)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_comm_bytes_scale_with_axis_size(n: int) -> None:
    g = g_(COMM)
    types = g.value_types()
    sizes = {"dp": n, "tp": 2}
    ar, rs, ag = (op_cost(op, types, sizes).comm_bytes for op in g.ops[:3])
    assert ar == int(2 * (n - 1) / n * 1024)
    padded = n * -(-256 // n) * 4   # the pieces are padded to equal sizes, and sent so
    assert rs == ag == int((n - 1) / n * padded)
    if padded == 1024:
        assert ar == pytest.approx(rs + ag, abs=1)  # all_reduce = reduce_scatter + all_gather


def test_peak_memory_counts_views_at_their_base_and_holds_inputs_throughout():
    from diphoma_compile.ir.analysis import peak_memory
    g = parse("""# diphoma-ir v1
graph @p (%x: f32[10] batch) {
  %a: f32[10] = neg(%x)
  %v: f32[2,5] = reshape(%a)
  %b: f32[10] = exp(%x)
  %w: f32[10] = reshape(%v)
  %c: f32[10] = add(%w, %b)
  %d: f32[] = reduce_sum(%c) {dims=[0]}
  return (%d other)
}
""")
    p = peak_memory(g)
    # %a (40 B, alive through its views until %c) + %b (40) + %c (40) at the add, with the
    # input's 40 held throughout; the reshapes own nothing
    assert p.inputs_bytes == 40
    assert p.bytes == 40 + 120 and g.ops[p.index].name == "add"
