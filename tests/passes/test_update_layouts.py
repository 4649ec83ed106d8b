"""Weight-update sharding's choice of piece per tensor, framework-neutral: the three layouts,
and optimizer state of another shape than its parameter (factored moments)."""

from __future__ import annotations

import pytest

from diphoma_compile.ir.types import FLAT, REPLICATE, DType, Shard, TensorType
from diphoma_compile.passes.spec import parse_spec
from diphoma_compile.passes.weight_update_sharding import linked_placement, shard_placement


def t(*shape: int, tp: bool = False) -> TensorType:
    x = TensorType(tuple(shape), DType.f32)
    return x.with_placement("tp", Shard(0)) if tp else x


@pytest.mark.parametrize("shape, flat, dims, mixed", [
    ((509, 66), FLAT, REPLICATE, FLAT),
    ((66, 264), FLAT, Shard(1), Shard(1)),
    ((264, 66), FLAT, Shard(0), Shard(0)),
    ((5,), FLAT, REPLICATE, FLAT),
    ((), REPLICATE, REPLICATE, REPLICATE),
])
def test_each_layout_picks_its_piece(shape, flat, dims, mixed):
    assert [shard_placement(t(*shape), 8, lay)[0] for lay in ("flat", "dims", "dims-or-flat")] \
        == [flat, dims, mixed]


def test_dims_or_flat_keeps_a_tensor_split_on_another_axis_whole_and_says_why():
    p, why = shard_placement(t(9, 5, tp=True), 8, "dims-or-flat")
    assert p == REPLICATE and "split over another axis" in why


def test_a_factored_moment_follows_its_parameter_s_split_dimension():
    # (24, 48) is split on dim 0: the row moment (24,) keeps it, the column moment (48,) not
    assert linked_placement(t(24), t(24, 48), 8, "dims-or-flat") == (Shard(0), "")
    p, why = linked_placement(t(48), t(24, 48), 8, "dims-or-flat")
    assert p == REPLICATE and "lacks the parameter's split dimension 0" in why
    # a 3-d parameter split on dim 1 (4 does not divide 8): dropping dim 0 moves it to dim 0
    assert linked_placement(t(16, 6), t(4, 16, 6), 8, "dims-or-flat") == (Shard(0), "")
    assert linked_placement(t(4, 6), t(4, 16, 6), 8, "dims-or-flat")[0] == REPLICATE


@pytest.mark.parametrize("state, param, layout, words", [
    ((33,), (33, 66), "dims-or-flat", "split flat"),
    ((66,), (33, 66), "dims", "stays whole"),
    ((16,), (16, 16), "dims-or-flat", "cannot be told from the shapes"),
    ((7, 3), (16, 24), "dims-or-flat", "not its parameter's [16, 24] less one dimension"),
])
def test_factored_state_kept_whole_says_why(state, param, layout, words):
    p, why = linked_placement(t(*state), t(*param), 8, layout)
    assert p == REPLICATE and words in why


def test_placeholders_stay_whole():
    assert linked_placement(t(1), t(16, 24), 8, "dims-or-flat")[0] == REPLICATE


def test_an_unknown_layout_is_refused():
    from diphoma_compile.ir import Graph
    from diphoma_compile.mesh import Mesh
    from diphoma_compile.passes import PassContext, PassFailure
    from diphoma_compile.passes.weight_update_sharding import WeightUpdateSharding
    g = Graph("s", (), (), ()).replace(mesh=Mesh({"dp": 2}))
    assert parse_spec("weight-update-sharding{layout=dims-or-flat}")[0].layout == "dims-or-flat"
    with pytest.raises(PassFailure, match="layout='rows' is not one of flat, dims, dims-or-flat"):
        WeightUpdateSharding(axis="dp", layout="rows")(g, PassContext())


def test_torch_s_keepdim_factored_moments_follow_their_parameter_too():
    """torch.optim.Adafactor keeps the reduced dimension as size 1: row_var [rows, 1],
    col_var [1, cols]. Under layout=dims the row moment of a row-split weight is split with
    it; under torch's flat layout both stay whole, and the plan says it is the flat split."""
    assert linked_placement(t(24, 1), t(24, 48), 8, "dims") == (Shard(0), "")
    p, why = linked_placement(t(1, 48), t(24, 48), 8, "dims")
    assert p == REPLICATE and "lacks the parameter's split dimension 0" in why
    p, why = linked_placement(t(24, 1), t(24, 48), 8, "flat")
    assert p == REPLICATE and "split flat" in why
    p, why = linked_placement(t(24, 2), t(24, 48), 8, "dims")
    assert p == REPLICATE and "of size 1" in why
