"""The data-parallel, weight-update-sharded torch step on 4 gloo ranks against the
single-device step on the global batch (and PyTorch DDP for AdamW): loss, parameters and
gathered optimizer state after ten steps; bytes sent equal the plan's; optimizer state per
rank is 1/N; wrong worlds and meshes fail before any collective; tensor parallelism (dp=1 x
tp=4, dp=2 x tp=2) against one device, with each rank holding its shards. One launch for
all (the session fixtures ``runs`` and ``cases`` in conftest.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import dist_checks  # noqa: E402
WORLD = dist_checks.WORLD
CASES = [dist_checks.case_id(*c) for c in dist_checks.CASES]


@pytest.mark.parametrize("case", [c for c in CASES if "sgdm" in c])
def test_sgd_momentum_matches_single_device(cases, case):
    r0 = cases[case][0]
    for a, b in zip(r0["losses"], r0["ref_losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (r0["losses"], r0["ref_losses"])
    assert r0["param"]["rel"] <= 1e-5, r0["param"]
    assert r0["state"]["rel"] <= 1e-5 and r0["state"]["keys"] > 0, r0["state"]


@pytest.mark.parametrize("case", [c for c in CASES if "adamw" in c])
def test_adamw_within_twice_ddp(cases, case):
    r0 = cases[case][0]
    for a, b in zip(r0["losses"], r0["ref_losses"]):
        assert abs(a - b) <= 1e-5, (r0["losses"], r0["ref_losses"])
    ours, ddp = r0["param"]["abs"], r0["ddp_param"]["abs"]
    assert ours <= 2 * ddp + 1e-7, f"params: diphoma {ours:.3g} vs DDP {ddp:.3g}"
    ours, ddp = r0["state"]["abs"], r0["ddp_state"]["abs"]
    assert ours <= 2 * ddp + 1e-7, f"optimizer state: diphoma {ours:.3g} vs DDP {ddp:.3g}"
    assert r0["state"]["steps_equal"]


@pytest.mark.parametrize("case", CASES)
def test_ranks_agree_and_keep_shards(cases, case):
    per_rank = cases[case]
    for r in per_rank[1:]:
        assert torch.equal(r["params"], per_rank[0]["params"]), "parameters differ by rank"
        assert r["losses"] == per_rank[0]["losses"], "losses differ by rank"
    for r in per_rank:
        assert r["state_local"], "opt.state does not hold this rank's shards"
        assert r["state_sharded"] > 0
        # gradients are reduce-scattered: no rank holds a whole one, .grad stays None
        assert r["grads_none"]


@pytest.mark.parametrize("case", CASES)
def test_bytes_sent_equal_plan(cases, case):
    for r in cases[case]:
        assert r["calls"] == dist_checks.STEPS
        assert r["plan"] == r["table"]
        assert r["counted"] == r["calls"] * r["plan"], (r["counted"], r["plan"])
        for kind, n in r["kinds_expected"].items():
            assert r["kinds_counted"].get(kind, 0) == n, (kind, r["kinds_counted"])


def test_fused_case_has_buckets(cases):
    r = cases["mlp-adamw-clip-fused"][0]
    assert r["buckets"] >= 2 and r["waits"] >= 1, r


@pytest.mark.parametrize("case", ["mlp-sgdm-clip", "mlp-adamw-clip"])
def test_fused_and_scheduled_matches_unfused(cases, case):
    """Buckets and async collectives give the unfused results up to summation order: a rank
    keeps its own piece of every member in a bucket, but gloo picks its reduction algorithm
    (and so the order in which ranks' values are added) by buffer size, so a packed buffer
    may add an element's contributions in another order than the tensor alone. Not bit for
    bit, then: within float32 rounding of the unfused run."""
    plain, fused = cases[case][0], cases[case + "-fused"][0]
    assert fused["buckets"] >= 2 and fused["waits"] >= 1
    for a, b in zip(plain["losses"], fused["losses"]):
        assert abs(a - b) <= 1e-6 * abs(a)
    diff = (plain["params"] - fused["params"]).abs().max().item()
    assert diff <= 1e-6 * plain["params"].abs().max().item(), diff


def test_optimizer_state_is_one_nth_per_rank(cases):
    for r in cases["gpt-adamw-clip"]:
        mem = r["memory"]
        assert mem["opt_state_bytes"] <= r["full_state_bytes"] / WORLD * 1.01, \
            (mem, r["full_state_bytes"])
        assert mem["param_bytes"] == r["full_param_bytes"]     # parameters stay whole
        assert mem["grad_bytes"] == 0


def test_resume_from_whole_state_reshards(runs):
    for r in runs:
        res = r["resume"]
        assert res["whole"]["exp_avg"] == (3, 7)
        assert res["after"]["exp_avg"] == (6,)        # ceil(21 / 4): a padded flat shard
    r0 = runs[0]["resume"]
    assert r0["param"]["abs"] <= 1e-6 and r0["state"]["abs"] <= 1e-6, r0


def test_process_subgroups(runs):
    by_group: dict[int, list[dict]] = {}
    for r in runs:
        by_group.setdefault(r["subgroups"]["group"], []).append(r["subgroups"])
    assert sorted(by_group) == [0, 1]
    for members in by_group.values():
        assert torch.equal(members[0]["params"], members[1]["params"])
        lead = members[0]
        assert lead["param"]["abs"] <= 1e-6 and lead["state"]["abs"] <= 1e-6, lead
    assert not torch.equal(by_group[0][0]["params"], by_group[1][0]["params"])


def test_parallelize_runs_on_this_runtime(runs):
    for r in runs:
        res = r["parallelize"]
        assert res["runner"] == "TorchDistStep"
        assert res["counted"] == res["calls"] * res["plan"]
    r0 = runs[0]["parallelize"]
    for a, b in zip(r0["losses"], r0["ref_losses"]):
        assert abs(a - b) <= 1e-5
    assert r0["param"]["abs"] <= 1e-6 and r0["state"]["abs"] <= 1e-6, r0


def test_inductor_per_rank_program_matches_single_device(runs):
    # Inductor's kernels round differently from eager's: losses within 1e-5, parameters and
    # optimizer state within 1e-5 of the single-device eager step
    for r in runs:
        res = r["inductor"]
        assert res["codegen"] == "inductor" and res["compile_s"] > 0
        assert res["functional"], "the compiled program has no _c10d_functional collective"
        # a collective the schedule starts early (the loss's all-reduce, before the
        # backward) runs while Inductor's kernels compute: its wait_tensor comes later
        assert res["overlapped"] >= 1, res
        assert "Inductor" in res["profile_refused"], res["profile_refused"]
        assert "profile(steps=0): the steps to time are a whole number" in \
            res["profile_no_steps"], res["profile_no_steps"]
        # counted per call of the compiled program (its collectives run out of Python's
        # sight; before, only the trace counted them: twice, then never again)
        sent = res["sent"]
        assert sent["counted"] == sent["steps"] * sent["planned"] > 0, sent
    r0 = runs[0]["inductor"]
    for a, b in zip(r0["losses"], r0["ref_losses"]):
        assert abs(a - b) <= 1e-5
    assert r0["param"]["abs"] <= 1e-5 and r0["state"]["abs"] <= 1e-5, r0


def test_scheduler_inside_the_step_runs_each_call(runs):
    r0 = runs[0]["scheduler"]
    for r in runs:
        res = r["scheduler"]
        assert res["lrs"] == [0.05 * 0.5 ** k for k in range(1, 5)], res["lrs"]
        assert res["last_epoch"] == 4
        assert res["losses"] == r0["losses"]
    assert r0["lrs"][-1] == r0["ref_lr"]
    for a, b in zip(r0["losses"], r0["ref_losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (r0["losses"], r0["ref_losses"])
    assert r0["param"]["rel"] <= 1e-5, r0["param"]


def test_max_min_metrics_match_the_global_batch(runs):
    r0 = runs[0]["summed"]
    assert sorted(r0["combined"].values()) == ["max", "min"]
    for got, want in zip(r0["got"], r0["want"]):
        for a, b in zip(got, want):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (got, want)
    assert r0["param"]["abs"] <= 1e-6, r0["param"]
    for r in runs:
        assert r["summed"]["got"] == r0["got"]     # every rank returns the same values


def test_a_loss_summed_over_the_batch_adds_up_across_ranks(runs):
    r0 = runs[0]["sum_loss"]
    assert sorted(r0["combined"].values()) == ["sum", "sum"] and r0["gradients"] == "sum"
    for got, want in zip(r0["got"], r0["want"]):
        for a, b in zip(got, want):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (got, want)
    assert r0["param"]["rel"] <= 1e-5, r0["param"]
    for r in runs:
        assert r["sum_loss"]["got"] == r0["got"]


def test_the_gradients_combine_as_the_value_backpropagated(runs):
    """A sum backpropagated with its mean returned: the gradients add up (they were
    averaged, 1/N); a mean backpropagated with a sum returned after the step: the sum
    adds up (it was averaged)."""
    r0 = runs[0]["differentiated"]
    assert (r0["summed_backward_step"]["gradients"], r0["halved_sum_step"]["gradients"]) == \
        ("sum", "avg")
    assert (r0["summed_backward_step"]["combined"], r0["halved_sum_step"]["combined"]) == \
        ([], ["sum"])
    for name, r in r0.items():
        for got, want in zip(r["got"], r["want"]):
            assert abs(got[0] - want[0]) <= 1e-5 * max(1.0, abs(want[0])), (name, got, want)
        assert r["param"]["rel"] <= 1e-5, (name, r["param"])
    for r in runs:
        assert {k: v["got"] for k, v in r["differentiated"].items()} == \
            {k: v["got"] for k, v in r0.items()}


def test_losses_aten_keeps_whole_and_nanmean_match_the_single_device_step(runs):
    """Sums of binary cross-entropy and smooth L1 add up across the ranks, as does a
    count_nonzero metric; a segmentation cross-entropy with ignored pixels and a nanmean
    divide by the batch's count (each was averaged, or divided by the rank's own count)."""
    r0 = runs[0]["rule_losses"]
    assert {k: (v["gradients"], v["combined"], v["counted"]) for k, v in r0.items()} == {
        "bce_sum_step": ("sum", ["sum", "sum"], 0), "smooth_l1_sum_step": ("sum", ["sum"], 0),
        "segmentation_step": ("avg", [], 1), "nanmean_step": ("avg", [], 1)}
    _match_the_single_device_step(runs, "rule_losses")


def _match_the_single_device_step(runs, check: str) -> None:
    """Each step of check ``check`` returns the single-device step's values within 1e-5
    and ends with its parameters within 1e-5 (rank 0), and every rank returns the same."""
    r0 = runs[0][check]
    for name, r in r0.items():
        for got, want in zip(r["got"], r["want"]):
            for a, b in zip(got, want):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (name, got, want)
        assert r["param"]["rel"] <= 1e-5, (name, r["param"])
    for r in runs:
        assert {k: v["got"] for k, v in r[check].items()} == \
            {k: v["got"] for k, v in r0.items()}


def test_losses_scaled_by_the_rows_match_the_single_device_step(runs):
    """Pieces' sums over the batch's rows average across the ranks (they were added up:
    N times the loss); a mean times the rows adds up (it was averaged: 1/N)."""
    r0 = runs[0]["scaled_losses"]
    assert {k: (v["gradients"], v["combined"]) for k, v in r0.items()} == {
        "pieces_over_rows_step": ("avg", []), "mean_times_rows_step": ("sum", ["sum"])}
    _match_the_single_device_step(runs, "scaled_losses")


def test_shard_params_with_l2_decay_and_zeros_left_match_the_single_device_step(runs):
    """Adam with L2 weight decay, and a step leaving zeros in .grad, under shard_params:
    each failed (a verifier error, a BackendError) until 2026-12-07; now within float32
    rounding of the single-device step over three steps."""
    r0 = runs[0]["shard_params_variants"]
    assert set(r0) == {"adam_l2", "zeros_left"}
    for name, r in r0.items():
        for got, want in zip(r["got"], r["want"]):
            assert abs(got[0] - want[0]) <= 1e-5 * max(1.0, abs(want[0])), (name, got, want)
        assert r["param"] <= 1e-5, (name, r["param"])


def test_a_state_dict_of_another_ranks_shards_is_refused(runs):
    """Under weight-update sharding and shard_params, opt.state_dict() and
    model.state_dict() hold the rank's own shards: loaded on the rank they came from they
    load; rank 0's loaded on another rank is refused, naming both ranks."""
    assert runs[0]["shard_marks"] == {"optimizer": "loaded", "model": "loaded"}
    for rank, r in enumerate(runs[1:], 1):
        assert r["shard_marks"] == {
            w: f"this {w} state dict holds rank 0's shards (of {len(runs)} ranks), and "
               f"this is rank {rank} of {len(runs)}" for w in ("optimizer", "model")}


def test_a_gradient_divided_by_its_norm_kept_to_its_rank_matches_the_single_device_step(
        runs):
    """``g / g.pow(2).sum(dims, keepdim=True).sqrt()`` under weight-update sharding's flat
    pieces: the [1, 1] norm is read as a 0-d tensor (it raised torch's "output with shape
    [18] doesn't match the broadcast shape [1, 18]" until 2026-12-07)."""
    r0 = runs[0]["normalized_grads"]
    assert r0["flat"] and r0["param"]["rel"] <= 1e-5, r0


def test_pipeline_with_tensor_parallel_stages_gives_every_rank_the_whole_model(runs):
    for r in runs:
        got = r["pp_tp"]
        assert max(abs(a - b) for a, b in zip(got["losses"], got["ref_losses"])) <= 1e-5
        assert max(got["param_abs"].values()) <= 1e-6, got["param_abs"]


def test_a_clipped_tensor_parallel_mlp_on_sequences_matches_the_single_device_step(runs):
    for r in runs:
        for name, got in r["tp_clip_3d"].items():
            assert max(abs(a - b) for a, b in zip(got["losses"], got["ref_losses"])) <= 1e-5
            assert got["param_abs"] <= 1e-5, (name, got)


def test_the_modules_own_forward_between_steps_is_refused_where_it_holds_pieces(runs):
    """Tensor-parallel shards (whose shapes fit each other: the forward ran and returned
    half the features), flat shard_params chunks and a pipeline's other stages' emptied
    parameters: the module called between steps is refused, saying what to do."""
    for r in runs:
        for got in (r["tp_clip_3d"]["sgd"]["eager"], r["tp_clip_3d"]["adamw"]["eager"],
                    r["pp_state"]["eager"]):
            assert got is not None and got.startswith("DiphomaError: the module "), got
            assert "was called outside the parallel step, but this rank holds " in got \
                and "step.state_dict()" in got, got
        assert "(another pipeline stage's)" in r["pp_state"]["eager"], r["pp_state"]["eager"]


def test_the_whole_state_dict_loads_into_a_module_holding_pieces(runs):
    """model.load_state_dict(step.state_dict()) between steps, the module holding
    tensor-parallel shards, shard_params chunks or a pipeline's stages: each rank takes
    its piece (it failed on the shapes: size mismatch), as FSDP2's set_model_state_dict
    takes a full state dict; the state gathered again is what was loaded."""
    for r in runs:
        for got in (r["tp_clip_3d"]["sgd"]["reloaded"], r["tp_clip_3d"]["adamw"]["reloaded"],
                    r["pp_state"]["reloaded"]):
            assert got == 0.0, got
        assert "holds only its piece of" in r["tp_clip_3d"]["sgd"]["eager"]


def test_metrics_and_buffers_computed_after_the_optimizer_step(runs):
    """The loss scaled after opt.step(), a count from the batch alone, a running average of
    the loss in a buffer: as on one device (they failed to verify or were refused)."""
    r0 = runs[0]["after_step"]
    for got, want in zip(r0["got"], r0["want"]):
        for a, b in zip(got, want):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (got, want)
    assert r0["param"]["rel"] <= 1e-5 and r0["buffer"] <= 1e-6, r0
    for r in runs:
        assert r["after_step"]["got"] == r0["got"]


def test_zero_grad_to_zeros_after_the_step_matches_the_single_device_step(runs):
    r0 = runs[0]["zero_last"]
    for got, want in zip(r0["got"], r0["want"]):
        assert abs(got[0] - want[0]) <= 1e-5 * max(1.0, abs(want[0])), (got, want)
    assert r0["param"]["rel"] <= 1e-5, r0
    assert all(r["zero_last"]["zeros"] and r["zero_last"]["got"] == r0["got"] for r in runs)


def test_uneven_batches_across_ranks_are_refused(runs):
    for r in runs:
        msg = r["summed"]["uneven"]
        assert msg is not None and msg.startswith("MeshError"), msg
        assert "different shapes: %batch.x is (3, 8) on rank 0 and (4, 8) on rank" in msg, msg


def test_ranks_that_build_different_programs_are_refused(runs):
    """A rank whose model differs from the others' (the same batch shapes) is caught
    when the step is built, on every rank, before any collective of the step runs."""
    for r in runs:
        msg = r["summed"]["other_program"]
        assert msg is not None and msg.startswith("MeshError"), msg
        assert "the ranks built different programs for the step" in msg, msg


@pytest.mark.parametrize("opt_name", ["sgdm", "adamw"])
def test_resnet_stem(runs, opt_name):
    """A bias-free stem conv on the images keeps one result of its convolution_backward;
    the per-rank program trains like the single-device step (SGD+momentum, every rank on
    the same batch) or like DDP (AdamW, a batch per rank: BatchNorm is rank-local)."""
    for r in runs:
        assert "error" not in r["stem"][opt_name], r["stem"][opt_name]["error"]
        assert torch.equal(r["stem"][opt_name]["params"], runs[0]["stem"][opt_name]["params"])
    r0 = runs[0]["stem"][opt_name]
    assert ("aten.convolution_backward.default", (1,)) in r0["kept"], r0["kept"]
    for a, b in zip(r0["losses"], r0["ref_losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (r0["losses"], r0["ref_losses"])
    for what in ("param", "state", "buffer"):
        assert r0[what]["rel"] <= 1e-5, (what, r0[what])
    assert r0["state"]["keys"] > 0


TP_CASES = [f"{m}-{o}" for m in dist_checks.TP_MESHES for o in ("sgdm", "adamw")]


@pytest.mark.parametrize("case", TP_CASES)
def test_tensor_parallel_matches_single_device(runs, case):
    """Megatron's splits over tp (and dp with weight-update sharding) against the
    single-device step on the global batch, three steps: the loss every step within 1e-5
    relative; then the whole parameters (state_dict(), gathered) and optimizer state.
    SGD+momentum: parameters within 1e-5 of their largest value. AdamW: within 1e-5
    absolute (DDP cannot run on a dp=1 x tp=4 mesh, so there is no DDP distance to scale),
    except the keys' biases: softmax ignores a shift shared by every key, so their exact
    gradient is zero and Adam turns the rounding noise into steps of up to lr each, in any
    implementation that sums in another order; they are held to that bound."""
    r0 = runs[0]["tp"][case]
    steps, lr = dist_checks.TP_STEPS, 1e-2
    assert len(r0["losses"]) == steps
    for a, b in zip(r0["losses"], r0["ref_losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (r0["losses"], r0["ref_losses"])
    assert r0["keys_equal"]
    devs = r0["param_abs"]
    if "sgdm" in case:
        assert max(devs.values()) <= 1e-5 * r0["param_scale"], devs
    else:
        for name, d in devs.items():
            bound = steps * lr * 1.1 if name.endswith("k.bias") else 1e-5
            assert d <= bound, (name, d)
    assert r0["state"]["keys"] > 0 and r0["state"]["steps_equal"]
    for key, d in r0["state_rel"].items():
        assert d <= 1e-5, (key, r0["state_rel"])


@pytest.mark.parametrize("case", TP_CASES)
def test_tensor_parallel_ranks_hold_shards(runs, case):
    """Between steps the module's parameters are the rank's shards (FSDP2's convention);
    state_dict() gathers the same whole model on every rank; bytes sent equal the plan's."""
    tp = dist_checks.TP_MESHES[case.rsplit("-", 1)[0]]["tp"]
    r0 = runs[0]["tp"][case]
    for r in runs:
        res = r["tp"][case]
        assert res["losses"] == r0["losses"]
        assert torch.equal(res["full"], r0["full"]), "ranks gather different models"
        assert res["q_shape"] == (32 // tp, 32) and res["o_shape"] == (32, 32 // tp)
        # Megatron: two all-reduces forward, two backward, per block
        assert res["kinds"]["tp"] == {"all_reduce": 8 * res["calls"]}, res["kinds"]
        assert res["counted"] == res["calls"] * res["plan"], (res["counted"], res["plan"])
        assert "cannot run" not in res["backend"]
        assert res["memory"]["grad_bytes"] == 0


def test_tensor_parallel_four_ways_holds_under_two_fifths_of_the_parameters(runs):
    for case in ("dp1-tp4-sgdm", "dp1-tp4-adamw"):
        for r in runs:
            res = r["tp"][case]
            share = res["memory"]["param_bytes"] / res["full_param_bytes"]
            assert share <= 0.40, (case, share)


ERRORS = {
    "world_size": ("MeshError", ["mesh axis 'dp' has 2 devices but the process group has 4",
                                 "torchrun --nproc_per_node=2"]),
    "mesh_without_axis": ("MeshError", ["has no axis 'dp'", "axes: tp"]),
    "other_axis": ("MeshError", ["no axis 'tp'"]),
    "not_transformed": ("MeshError", ["not distributed over mesh axis 'dp'",
                                      "data-parallel{axis=dp}"]),
    "pipeline_world": ("MeshError", ["has 6 devices but the process group has 4",
                                     "torchrun --nproc_per_node=6"]),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_before_any_collective(runs, name):
    kind, words = ERRORS[name]
    for r in runs:
        got = r["errors"][name]
        assert got["raised"] == kind, got
        for w in words:
            assert w in got["message"], (w, got["message"])
        assert got["calls"] == [], f"collectives ran before the error: {got['calls']}"



def test_not_initialized_names_torchrun():
    """In a process without a process group (this one): the error says how to launch."""
    from diphoma_compile.errors import BackendError
    assert not torch.distributed.is_initialized()
    torch.manual_seed(0)
    model = dist_checks.OddMLP()
    opt = dist_checks.OPTS["sgdm"](model.parameters())
    args = dist_checks.local(dist_checks.mlp_batches(WORLD)[0], 0, WORLD)
    with pytest.raises(BackendError, match="torch.distributed is not initialized") as e:
        dist_checks.build(dist_checks.mlp_step, model, opt, args, WORLD)
    assert "torchrun --nproc_per_node=4" in str(e.value)


def _cell(value: float | None, fmt: str) -> str:
    """A measured number, or n/a where the case did not measure it."""
    return f"{'n/a':>{int(fmt.split('.')[0])}}" if value is None else f"{value:{fmt}}"


def summary_lines(runs: list[dict], cases: dict[str, list[dict]]) -> list[str]:
    """Deviations and timings per case (rank 0), then seconds per check (slowest rank). The
    DDP columns are n/a for SGD cases: those compare with the single-device step alone."""
    lines = [f"{'case':20} {'loss dev':>9} {'param abs':>10} {'DDP':>10} {'state abs':>10} "
             f"{'DDP':>10} {'build s':>8} {'step ms':>8} {'DDP ms':>7}"]
    for name, per_rank in cases.items():
        r0 = per_rank[0]
        loss = max(abs(a - b) for a, b in zip(r0["losses"], r0["ref_losses"]))
        ddp_ms = None if r0["ddp_step_s"] is None else 1e3 * r0["ddp_step_s"]
        lines.append(" ".join([
            f"{name:20}", _cell(loss, "9.2e"), _cell(r0["param"]["abs"], "10.2e"),
            _cell(r0.get("ddp_param", {}).get("abs"), "10.2e"),
            _cell(r0["state"]["abs"], "10.2e"), _cell(r0.get("ddp_state", {}).get("abs"), "10.2e"),
            _cell(r0["build_s"], "8.2f"), _cell(1e3 * r0["step_s"], "8.1f"),
            _cell(ddp_ms, "7.1f")]))
    for opt_name, r0 in runs[0]["stem"].items():
        if "error" not in r0:
            loss = max(abs(a - b) for a, b in zip(r0["losses"], r0["ref_losses"]))
            lines.append(" ".join([
                f"{'stem-' + opt_name:20}", _cell(loss, "9.2e"), _cell(r0["param"]["abs"], "10.2e"),
                _cell(None, "10.2e"), _cell(r0["state"]["abs"], "10.2e"), _cell(None, "10.2e"),
                f"(buffers {r0['buffer']['abs']:.2e}; against "
                f"{'DDP' if opt_name == 'adamw' else 'one device'})"]))
    per_check = {name: max(r["seconds"][name] for r in runs) for name in runs[0]["seconds"]}
    lines.append("seconds per check (slowest rank): " +
                 ", ".join(f"{k} {v:.1f}" for k, v in per_check.items()) +
                 f"; all {sum(per_check.values()):.1f}")
    return lines


def test_summary(runs, cases, request):
    """The measured deviations and timings: every column a number or n/a, none NaN; printed
    only with -s (so that pytest -q shows dots alone)."""
    lines = summary_lines(runs, cases)
    table = "\n".join(lines)
    assert "nan" not in table.lower(), table
    stems = sum("error" not in r for r in runs[0]["stem"].values())
    assert len(lines) == len(cases) + stems + 2
    if request.config.getoption("capture") == "no":
        print("\n" + table)


def test_tensor_parallel_hugging_face_opt_matches_single_device(runs):
    """HF OPT at dp=1 x tp=4 (attention and MLP of both layers split): losses of three SGD
    steps within 1e-5, the gathered parameters within 1e-5 of the largest, every rank the
    same losses, and each rank holding under 0.40 of the parameter bytes."""
    r0 = runs[0]["tp_hf"]
    if not r0:
        pytest.skip("transformers is not installed")
    assert r0["pairs"] == 4
    for a, b in zip(r0["losses"], r0["ref_losses"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert r0["param_abs"] <= 1e-5 * r0["param_scale"]
    for r in runs:
        assert r["tp_hf"]["losses"] == r0["losses"]
        assert r["tp_hf"]["held"] <= 0.40 * r["tp_hf"]["whole"], r["tp_hf"]["held"]


def test_quantized_weight_differences_within_declared_error(runs):
    """quantize-weight-diff{bits=4, group=2048}: each step, every element of the parameter
    every rank computes with is within absmax/7 of its group of that step's difference from
    the exact weights (no accumulation over steps); the exact weights after step 1 are the
    single-device step's; all ranks hold the same parameters; the bytes sent are the plan's
    and below the unquantized plan's."""
    r0 = runs[0]["quantized_weights"]
    assert r0["quantized"] == ["fc1.weight", "fc2.weight"]
    for t, (excess, ratio) in enumerate(zip(r0["excess"], r0["ratio"])):
        assert excess <= 0.0, (t, excess)
        assert 0.3 < ratio <= 1.0 + 1e-5, (t, ratio)   # the bound is used, not loose
    assert r0["master_rel"] <= 1e-5
    for r in runs:
        res = r["quantized_weights"]
        assert res["param_sums"] == r0["param_sums"]
        assert res["counted"] == [res["plan"]] * len(res["counted"])
        # resuming from gather_comm_state() continues bit for bit; without it, not
        assert res["resumed_equal"] and not res["unloaded_equal"]
    assert r0["plan"] < 0.6 * r0["plain_plan"]


def test_quantized_gradients_within_declared_error(runs):
    """quantize-grads{bits=4, group=128, hadamard=32}: the averaged gradient of one step is
    within the declared error of the exact mean in the Hadamard domain (the mean over the
    senders of their group's absmax/7), every rank alike; bytes as planned, below plain."""
    r0 = runs[0]["quantized_grads"]
    assert r0["excess"] <= 0.0, r0
    assert 0.3 < r0["ratio"] <= 1.0 + 1e-5, r0
    assert r0["kinds"]["all_to_all"] == 4      # packed bytes + scales, for two weights
    for r in runs:
        res = r["quantized_grads"]
        assert res["counted"] == res["plan"] and res["excess"] == r0["excess"]
    assert r0["plan"] < 0.6 * r0["plain_plan"]


def test_two_hop_quantized_gradients_within_declared_error(runs):
    """quantize-grads{levels=2, local=2} on 2 nodes x 2 ranks: 8-bit inside each node,
    requantized to 4 bits across nodes; the averaged gradient is within the two hops'
    declared error of the exact mean (Hadamard domain), every rank alike; the exchanges run
    on the level groups (2 ranks each), two per weight per level; bytes as planned, the
    bytes across nodes a quarter of those inside."""
    r0 = runs[0]["quantized_grads_two_hop"]
    assert r0["excess"] <= 0.0, r0
    assert 0.05 < r0["ratio"] <= 1.0 + 1e-5, r0
    assert r0["sizes"] == {"dp__local2": 2, "dp__node2": 2}
    assert r0["levels"] == {"dp__local2": {"all_to_all": 4}, "dp__node2": {"all_to_all": 4}}
    for r in runs:
        res = r["quantized_grads_two_hop"]
        assert res["counted"] == res["plan"] and res["excess"] == r0["excess"]
    # across nodes, 4 bits of half the rows: a quarter of the 8-bit bytes inside a node
    across, inside = r0["level_bytes"]["dp__node2"], r0["level_bytes"]["dp__local2"]
    assert across < 0.3 * inside
    assert r0["plan"] < 0.7 * r0["plain_plan"]


def test_quantized_all_reduce_within_declared_error(runs):
    """quantize-grads{all-reduce=true} on plain data parallelism: each gradient's all-reduce
    as a quantized all-to-all and a 4-bit all-gather of the averaged pieces; the gradient
    every rank applies is within both stages' declared error of the exact mean, identical
    on every rank; bytes as planned, under 0.16x of the fp32 all-reduce's."""
    r0 = runs[0]["quantized_all_reduce"]
    assert r0["checked"] == 2 and r0["excess"] <= 0.0, r0
    assert 0.05 < r0["ratio"] <= 1.0 + 1e-5, r0
    assert r0["kinds"]["all_to_all"] == 4 and r0["kinds"]["all_gather"] == 4
    for r in runs:
        res = r["quantized_all_reduce"]
        assert res["counted"] == res["plan"] and res["param_sum"] == r0["param_sum"]
    assert r0["plan"] < 0.16 * r0["plain_plan"]


def test_sdp4bit_preset_runs_fused_and_scheduled(runs):
    """parallelize(compression="sdp4bit") with its buckets and async waits: the first loss
    (before any update) is the plain step's, the ranks agree, the bytes are as planned and
    at most 0.16x of the unquantized plan's; on {"node": 2, "dp": 2} the gradients take two
    hops (8-bit inside a node: more bytes in all, under 0.3x), the ranks agree."""
    r0 = runs[0]["sdp4bit_preset"]
    plain, q = r0["plain"], r0["sdp4bit"]
    assert q["losses"][0] == plain["losses"][0]
    for r in runs:
        res = r["sdp4bit_preset"]["sdp4bit"]
        assert res["counted"] == res["calls"] * res["plan"]
        assert res["param_sum"] == q["param_sum"] and res["losses"] == q["losses"]
    assert q["plan"] <= 0.16 * plain["plan"]
    two = r0["twohop"]
    assert two["hops"] == 2 and two["losses"][0] == plain["losses"][0]
    for r in runs:
        res = r["sdp4bit_preset"]["twohop"]
        assert res["counted"] == res["calls"] * res["plan"]
        assert res["param_sum"] == two["param_sum"] and res["losses"] == two["losses"]
    assert q["plan"] < two["plan"] < 0.3 * plain["plan"]


GPT2_CASES = [f"{m}-{o}" for m in dist_checks.TP_MESHES for o in ("sgdm", "adamw")]


@pytest.mark.parametrize("case", GPT2_CASES)
def test_tensor_parallel_gpt2_matches_one_device(runs, case):
    """HF GPT-2 (fused c_attn split in three groups of columns, tied embeddings kept whole)
    at dp=1 x tp=4 and dp=2 x tp=2: the losses of three steps within 1e-5; SGD+momentum's
    gathered parameters within 1e-5 of the largest; AdamW's no further from the single-
    device step than 4x where DDP on the same 4 ranks lands (Adam turns rounding noise in
    gradients that are zero in exact arithmetic, the key biases', into steps of up to lr,
    in any implementation that sums in another order); attention and MLP of both layers
    split, each rank holding its heads' third of c_attn, every rank the same losses."""
    r0 = runs[0]["tp_gpt2"]
    if not r0:
        pytest.skip("transformers is not installed")
    res = r0[case]
    tp = dist_checks.TP_MESHES[case.rsplit("-", 1)[0]]["tp"]
    assert res["pairs"] == 4
    for a, b in zip(res["losses"], res["ref_losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (res["losses"], res["ref_losses"])
    worst = max(res["param_abs"].values())
    if case.endswith("sgdm"):
        assert worst <= 1e-5 * res["param_scale"], res["param_abs"]
    else:
        ddp = r0["ddp-adamw"]
        assert ddp > 0 and worst <= 4 * ddp, (worst, ddp)
    for r in runs:
        got = r["tp_gpt2"][case]
        assert got["losses"] == res["losses"]
        assert got["c_attn"] == (32, 96 // tp)
        assert got["kinds"]["tp"] == {"all_reduce": 8 * got["calls"]}, got["kinds"]
        if tp == 4:
            assert got["held"] <= 0.40 * res["whole"], got["held"] / res["whole"]
        # between steps: the model's own forward refused, the whole state dict (its tied
        # embedding under both names) loaded as each rank's pieces
        assert got["eager"].startswith("DiphomaError: the module "), got["eager"]
        assert got["reloaded"] == 0.0, got["reloaded"]


@pytest.mark.parametrize("name", ["gpt", "mlp", "hf_gpt2"])
def test_shard_params_matches_the_whole_parameter_plan_bit_for_bit(runs, name):
    """parallelize(shard_params=True): every rank holds its flat quarter of each parameter
    between steps (1-D, FSDP2's convention), and ten steps give exactly the losses, the
    gathered parameters and the optimizer state of the default plan (the same math, the
    parameters gathered where read instead of after the update); against one device:
    losses within 1e-5, parameters within 1e-5 of the largest. The GPT example's tied
    embedding is held once and gathered under both its names; so is Hugging Face GPT-2's
    (SGD with momentum)."""
    if name not in runs[0]["shard_params"]:
        pytest.skip("transformers is not installed")
    r0 = runs[0]["shard_params"][name]
    for r in runs:
        res = r["shard_params"][name]
        assert res["same_params"] and res["same_state"]
        assert res["losses"] == res["whole_losses"] == r0["losses"]
        assert torch.equal(res["full"], r0["full"]), "ranks gather different models"
        assert all(len(s) == 1 for s in res["shapes"]), res["shapes"]
        assert res["held"] <= res["whole_held"] / 4 + 64, (res["held"], res["whole_held"])
        assert res["memory"]["grad_bytes"] == 0
        assert res["counted"] == res["calls"] * res["plan"], (res["counted"], res["plan"])
    for a, b in zip(r0["losses"], r0["ref_losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert r0["param_abs"] <= 1e-5 * r0["param_scale"]
    notes = r0["notes"]
    assert notes["whole"] == [] and notes["gathers"]["forward"] == len(notes["sharded"])
    assert notes["gathers"]["backward"] > 0


@pytest.mark.parametrize("name", ["gpt", "mlp", "hf_gpt2"])
def test_gather_at_next_forward_matches_the_default_plan_bit_for_bit(runs, name):
    """weight-update-sharding{gather=next-forward}: the new pieces are the parameters
    between steps (a quarter of the bytes per rank) and each is gathered once, before its
    first forward use in the next step; the same losses and parameters as the default."""
    if name not in runs[0]["shard_params"]:
        pytest.skip("transformers is not installed")
    for r in runs:
        res = r["shard_params"][name]
        nxt = res["next"]
        assert nxt["same_params"] and nxt["losses"] == res["whole_losses"]
        assert nxt["held"] == res["held"]
        assert nxt["notes"]["backward"] == "keep" and "backward" not in nxt["notes"]["gathers"]


PP_CASES = list(dist_checks.PP_CASES)


@pytest.mark.parametrize("case", PP_CASES)
def test_pipeline_matches_single_device(runs, case):
    """A tiny Hugging Face GPT-2 (tied embedding and LM head; one case a Llama, whose
    decomposed RMSNorm backward and rotary tables no longer tie its norms' weights across
    stages: only the embedding is tied; one a GPT-NeoX of 2 layers whose first stage holds
    the embedding alone, its gradient made on the second) cut into pipeline stages by
    parallelize's pp axis (interleaved: 8 stages of an 8-layer model on 4 ranks), against
    the single-device step on the global batch: losses within 1e-5 every step on every rank
    (each returns the global batch's loss); SGD+momentum parameters within 1e-5 of the
    largest; AdamW parameters no further than 4x DDP's distance from it, DDP measured in the
    same launch over the 4 ranks on the same global batches (Adam turns rounding noise of
    the microbatch sums into steps of up to lr, as it does DDP's)."""
    r0 = runs[0]["pp"]
    if not r0:
        pytest.skip("transformers is not installed")
    r0 = r0[case]
    assert len(r0["losses"]) == dist_checks.PP_STEPS
    for r in runs:
        for a, b in zip(r["pp"][case]["losses"], r0["ref_losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (r["pp"][case]["losses"], r0["ref_losses"])
        assert torch.equal(r["pp"][case]["full"], r0["full"]), "ranks gather different models"
    assert r0["keys_equal"]
    if "sgdm" in case or "radam" in case:   # RAdam's first 5 steps: momentum, unscaled
        bound = 1e-5 * r0["param_scale"]
    else:
        assert r0["ddp_param_abs"] > 0, "DDP landed exactly on the single-device step"
        bound = 4 * r0["ddp_param_abs"]
    assert r0["param_abs"] <= bound, (r0["param_abs"], bound)
    assert any(p.startswith("pipeline{axis=pp") for p in r0["passes"])
    if case.endswith("-neox"):      # untied: the embedding's gradient crosses instead
        assert r0["tied"] == {} and [r["pp"][case]["stage"] for r in runs] == [0, 1, 2, 3]
    else:
        tied = "model.embed_tokens.weight" if case.endswith("-llama") else \
            "transformer.wte.weight"
        assert r0["tied"] == {tied: [0, r0["nstages"] - 1]}
    for r in runs:
        res = r["pp"][case]
        if case.endswith("-inductor"):
            assert res["codegen"] == "inductor" and res["compile_s"] > 0, res["codegen"]
        else:
            assert res["codegen"] == "fx" and res["compile_s"] is None


def test_pipeline_four_stages_hold_under_two_fifths_of_the_parameters(runs):
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    for case in ("pp4-sgdm-1f1b", "pp4-adamw-1f1b", "pp4-sgdm-interleaved"):
        for r in runs:
            res = r["pp"][case]
            share = res["memory"]["param_bytes"] / res["whole"]
            assert share <= 0.40, (case, r["pp"][case]["stage"], share)


def test_pipeline_parameters_held_as_pieces_are_gathered_once_a_step(runs):
    """dp=2 x pp=2 with shard_params (the case's parity is checked with the others): each
    rank holds its stage's parameters as dp pieces, about a quarter of the model (its
    stage's half, the tied embedding on both stages, halved over dp), and gathers each once
    a step (the plan's all-gathers each run once; the bytes test matches them to what the
    rank sent). Under zbv rank 0 runs the first and the last stage, which both read the
    tied embedding: it gathers it once for both (it gathered it on each)."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    for case in ("dp2-pp2-adamw-1f1b-shard", "dp2-pp2-sgdm-zbv-shard"):
        for r in runs:
            res = r["pp"][case]
            share = res["memory"]["param_bytes"] / res["whole"]
            assert share <= 0.30, (case, res["stage"], share)
            assert res["gathers"] and {n for n, _ in res["gathers"]} == {1}, res["gathers"]
            read = [v for _, v in res["gathers"]]
            assert len(set(read)) == len(read), (case, sorted(read))
    zbv = [r["pp"]["dp2-pp2-sgdm-zbv-shard"] for r in runs]
    assert [r["stages"] for r in zbv] == [[0, 3], [1, 2], [0, 3], [1, 2]]
    assert any("wte" in v for _, v in zbv[0]["gathers"])


def test_pipeline_ranks_run_their_stage_of_the_schedule(runs):
    """Ranks are row-major: in dp=2 x pp=2 ranks 0, 2 run stage 0 and ranks 1, 3 stage 1;
    each runs the schedule's actions for its stage."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    assert [r["pp"]["dp2-pp2-radam-1f1b"]["stage"] for r in runs] == [0, 1, 0, 1]
    assert [r["pp"]["pp4-sgdm-1f1b"]["stage"] for r in runs] == [0, 1, 2, 3]
    last = [tuple(a) for a in runs[3]["pp"]["pp4-sgdm-1f1b"]["actions"]]
    assert last == [(k, m, 3) for m in range(dist_checks.PP_MICRO) for k in "FB"]
    first = [tuple(a) for a in runs[0]["pp"]["pp4-sgdm-gpipe"]["actions"]]
    assert first == [("F", m, 0) for m in range(4)] + [("B", m, 0) for m in range(4)]


def test_pipeline_interleaved_ranks_run_two_stages_each(runs):
    """Interleaved 1F1B over pp=4 with 8 stages: rank r runs stages r and r + 4, in the
    order torch's ScheduleInterleaved1F1B gives it (rank 3: the last stage's forwards and
    backwards alternate, F7 B7 F7 B7 ...)."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    res = [r["pp"]["pp4-sgdm-interleaved"] for r in runs]
    assert [r["stages"] for r in res] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(r["nstages"] == 8 for r in res)
    got = " ".join(f"{s}{k}{m}" for k, m, s in res[3]["actions"])
    assert got == "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3B0 3B1 3B2 3B3"


def test_pipeline_looped_bfs_runs_each_stage_breadth_first(runs):
    """Looped BFS over dp=2 x pp=2 (4 stages): ranks 0 and 2 run stages 0 and 2, ranks 1
    and 3 stages 1 and 3; each runs torch's ScheduleLoopedBFS order: every microbatch's
    forward on its first stage, then on its second, then the backwards, last stage and
    last microbatch first."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    res = [r["pp"]["dp2-pp2-sgdm-looped-bfs"] for r in runs]
    assert [r["stages"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    got = " ".join(f"{s}{k}{m}" for k, m, s in res[0]["actions"])
    assert got == "0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0", got


def test_pipeline_zero_bubble_splits_each_backward(runs):
    """zbv over pp=4 (8 stages in a V: rank r runs stages r and 7 - r, so the loss is made
    on rank 0) and interleaved-zb over dp=2 x pp=2: each rank runs torch's F/I/W action
    lists, every stage's backward is cut into an input-gradient part I (what the earlier
    stage waits for; on the first stage, the activation gradients down to the embedding)
    and a weight-gradient part W, both holding ops on every stage."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    zbv = [r["pp"]["pp4-sgdm-zbv"] for r in runs]
    assert [r["stages"] for r in zbv] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for r in zbv + [r["pp"]["dp2-pp2-adamw-interleaved-zb"] for r in runs]:
        kinds = {k for k, _, _ in r["actions"]}
        assert kinds == {"F", "I", "W"}, kinds
        for stage, (n_i, n_w) in r["split"].items():
            assert n_w > 0 and n_i > 0, (stage, n_i, n_w)
    got = " ".join(f"{s}{k}{m}" for k, m, s in zbv[3]["actions"])
    assert got == ("3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3I0 3W0 4I1 4W1 3I1 3W1 4I2 4W2 "
                   "3I2 3W2 4I3 4W3 3I3 3W3"), got


def test_pipeline_dualpipev_runs_torchs_order(runs):
    """DualPipeV over dp=2 x pp=2 (4 stages in a V: ranks 0 and 2 run stages 0 and 3):
    each rank runs torch's ScheduleDualPipeV order, its overlapped (F; B) pairs forward
    first and its whole backwards as the stage's I then W programs; parity is
    test_pipeline_matches_single_device's."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    res = [r["pp"]["dp2-pp2-sgdm-dualpipev"] for r in runs]
    assert [r["stages"] for r in res] == [[0, 3], [1, 2], [0, 3], [1, 2]]
    got = " ".join(f"{s}{k}{m}" for k, m, s in res[0]["actions"])
    assert got == ("0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3I1 3W1 3F2 0I0 0W0 3I2 3W2 3F3 0I1 0W1 "
                   "3I3 3W3 0I2 0W2 0I3 0W3"), got
    for r in res:
        assert all(n_i > 0 and n_w > 0 for n_i, n_w in r["split"].values()), r["split"]


def test_pipeline_global_gradient_clip_runs_in_rounds(runs):
    """clip_grad_norm_ under a pipeline (pp=4 1F1B, dp=2 x pp=2 interleaved): the update runs
    in rounds (norms to the stage that totals them, the factor back, then the updates), and
    the clip acted (the losses after the first step differ from the same case unclipped);
    parity with one device is test_pipeline_matches_single_device's."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    for case, plain in (("pp4-sgdm-1f1b-clip", "pp4-sgdm-1f1b"),
                        ("dp2-pp2-adamw-interleaved-clip", None)):
        for r in runs:
            assert r["pp"][case]["rounds"] == 3, (case, r["pp"][case]["rounds"])
        if plain is not None:
            a, b = runs[0]["pp"][case]["losses"], runs[0]["pp"][plain]["losses"]
            assert a[0] == b[0] and abs(a[1] - b[1]) > 1e-4, (a, b)


def test_a_pipeline_updates_and_returns_batchnorm_statistics(runs):
    """BatchNorm's running statistics, updated on the stage that holds the norm, come back
    from state_dict() on every rank equal to the single-device step's (they came from each
    rank's own, never-updated copy); the values made from a read-only buffer are computed
    on every stage that reads them, so only the activation crosses each of the 3 cuts."""
    for r in runs:
        got = r["pp_buffers"]
        assert got["keys_equal"]
        for a, b in zip(got["losses"], got["ref_losses"]):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (got["losses"], got["ref_losses"])
        assert got["abs"]["bn.num_batches_tracked"] == 0, got["abs"]
        assert max(got["abs"].values()) <= 1e-6, got["abs"]
        assert got["forward_sends"] == 3, got["forward_sends"]


def test_a_fine_tuned_model_with_frozen_layers_matches_under_each_plan(runs):
    """The first 4 of 8 layers frozen, over dp=4, dp=4 with shard_params and pp=4: losses
    within 1e-6 and the whole state dict within 1e-6 of the single-device step on every
    rank (the frozen weights unchanged, bit for bit); under pp the first stage holds more
    layers than the last, its frozen layers' backward being short."""
    for r in runs:
        for case, got in r["frozen"].items():
            if case == "gpt2-pp4":
                continue
            assert got["keys_equal"], case
            for a, b in zip(got["losses"], got["ref_losses"]):
                assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (case, got["losses"],
                                                               got["ref_losses"])
            assert max(got["abs"].values()) <= 1e-6, (case, got["abs"])
            assert all(got["abs"][f"{k}.{w}"] == 0 for k in (0, 2, 4, 6)
                       for w in ("weight", "bias")), (case, got["abs"])
        layers = r["frozen"]["pp4"]["layers"]
        assert len(layers[0]) > len(layers[-1]), layers


def test_a_hugging_face_gpt2_with_a_frozen_tied_embedding_pipelines(runs):
    """GPT-2 with its tied embedding and first block frozen over pp=4: losses and the state
    dict within 1e-6 of the single-device step on every rank, the frozen weights unchanged;
    the embedding is not a tied parameter whose new value is sent (it failed so: a KeyError
    on the rank sending it, the others waiting); each rank's measured peak within 5% of the
    plan's (they measured equal)."""
    for r in runs:
        if "gpt2-pp4" not in r["frozen"]:
            pytest.skip("transformers is not installed")
        got = r["frozen"]["gpt2-pp4"]
        assert got["keys_equal"] and got["tied"] == {}, got["tied"]
        for a, b in zip(got["losses"], got["ref_losses"]):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (got["losses"], got["ref_losses"])
        assert max(got["abs"].values()) <= 1e-6, got["abs"]
        assert all(got["abs"][k] == 0 for k in got["frozen"]), got["abs"]
        measured, planned = got["peak"]      # no gradient or state for the frozen ones
        assert abs(measured - planned) <= 0.05 * planned, got["peak"]


def test_a_pipeline_ranks_measured_peak_is_its_planned_one(runs):
    """Every pipeline case, one more step under measure_memory on every rank: the tensor
    memory the rank reaches (its stages' programs in its schedule's order, the microbatches
    it keeps, its sends held to the end of the step, the update written in place) is the
    plan's peak for its pp rank (report/pipeline_peak.py) within 5%, and within 8% where
    the cases also have a dp axis: those measure 1-2% above the plan in most runs, and up
    to 5.4% in some (a storage of 24-33 KB freed later in one run than in another, at the
    same program point; what holds it was not found). Not asserted under Inductor, whose
    fused kernels allocate other than the IR's ops."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    for case in dist_checks.PP_CASES:
        for rank, r in enumerate(runs):
            got = r["pp"][case]["peak"]
            assert got["held"] <= got["measured"]
            if case.endswith("-inductor"):
                continue
            tol = 0.08 if case.startswith("dp") else 0.05
            assert abs(got["measured"] - got["planned"]) <= tol * got["planned"], \
                (case, rank, got)

def test_pipeline_bytes_sent_are_the_plans_for_each_rank(runs):
    """Every pipeline case: the bytes each rank sent in its steps (its collectives and its
    sends to other stages, ring model) are the plan's for its pp rank, each collective
    counted as often as its program runs (M times in a forward or backward, once in an
    update or a count's T), a send to another stage of the same rank (zbv's tied
    embedding) as none. Before, the plan counted each collective once and summed every
    stage's (a dp=2 x pp=2 GPT whose ranks send 5.66 and 5.61 KB a step: 9.74 KB). Under
    Inductor too: its programs count their collectives per call (codegen.InductorProgram);
    before, only the trace counted them (3 steps, 195,840 bytes on rank 0 against the
    plan's 85,632 a step)."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    for case in dist_checks.PP_CASES:
        for rank, r in enumerate(runs):
            got = r["pp"][case]["sent"]
            assert got["planned"] > 0
            assert got["counted"] == got["steps"] * got["planned"], (case, rank, got)


def test_pipeline_calls_made_are_the_plans_for_each_rank(runs):
    """Every pipeline case: the calls each rank made to move data in its steps (its
    collectives, its sends to other ranks) are the plan's for its pp rank
    (``Plan.comm_calls_per_rank``, which the text prints for the fullest rank), each
    collective as often as its program runs."""
    if not runs[0]["pp"]:
        pytest.skip("transformers is not installed")
    for case in dist_checks.PP_CASES:
        for rank, r in enumerate(runs):
            got = r["pp"][case]["calls"]
            assert got["planned"] > 0
            assert got["counted"] == got["steps"] * got["planned"], (case, rank, got)


@pytest.mark.parametrize("case", ["wide/default", "wide/shard", "wide/next", "gpt/default",
                                  "gpt/shard", "gpt/next"])
def test_the_measured_peak_is_the_planned_one(runs, case):
    """Every storage the running program makes, counted from its making to its freeing
    (measure_memory), reaches the plan's liveness peak within 8% on every rank: the runtime
    frees what the plan lets die (gradients once packed, gathered weights unpacked straight
    into the parameters), and the plan counts what the runtime holds besides the IR's values
    (packed send buffers, unpacked copies, the receive buffer of gloo's reduce-scatter, an
    all_to_all)."""
    for r in runs:
        got = r["measured_peak"][case]
        assert abs(got["measured"] - got["planned"]) <= 0.08 * got["planned"], (case, got)
        assert got["held"] <= got["measured"]


def test_adafactor_matches_one_device(runs):
    """torch.optim.Adafactor as people use it: traced (its host min/max of the step count
    and the learning rate stay symbolic), planned (its norms' partial sums bucketed without
    a cycle) and run on 4 ranks, equal to the single-device step to rounding."""
    r0 = runs[0]["adafactor"]
    for a, b in zip(r0["losses"], r0["ref_losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (r0["losses"], r0["ref_losses"])
    assert r0["param_abs"] <= 1e-5, r0["param_abs"]
    assert max(r0["state_abs"].values()) <= 1e-6, r0["state_abs"]
    assert len(r0["state_abs"]) == 15          # step, row, column moments; bias variances
    assert all(r0["placements"][f"{n}.bias.variance"] == "dp: F" for n in ("fc1", "fc2", "fc3"))
    for r in runs[1:]:
        assert r["adafactor"]["losses"] == r0["losses"]


@pytest.mark.parametrize("name", ["radam", "asgd"])
def test_step_count_optimizers_match_one_device(runs, name):
    """RAdam and ASGD (refused until 2026-12-05: their eager step() branches on the step
    count) under the default plan on 4 ranks, past the step where that branch turns:
    equal to the single-device step to rounding, their moments sharded."""
    r0 = runs[0]["step_count_optimizers"][name]
    for a, b in zip(r0["losses"], r0["ref_losses"]):
        assert abs(a - b) <= 1e-6 * abs(b), (r0["losses"], r0["ref_losses"])
    assert r0["param_abs"] <= 1e-6, r0["param_abs"]
    assert max(r0["state_abs"].values()) <= 1e-6, r0["state_abs"]
    assert r0["state_abs"]["fc1.weight.step"] == 0.0
    assert r0["sharded"] == {"radam": 12, "asgd": 6}[name], r0    # moments / ax of 6 tensors
    for r in runs[1:]:
        assert r["step_count_optimizers"][name]["losses"] == r0["losses"]


def test_a_measured_device_model_is_the_same_on_every_rank(runs):
    """Each rank measured its own CPU at the same time as the others; all plan on the
    slowest rank's rates and rank 0's link (a plan that differed between ranks could cut a
    pipeline in different places and hang), with figures a CPU and a loopback reach, not
    the base model's link."""
    from diphoma_compile.ir.device_model import device_model
    r0 = runs[0]["measured_model"]
    assert r0["name"] == r0["costed_on"] == "measured-cpu-gloo"
    flops, mem, link_bw, latency = r0["figures"]
    assert 1e9 < flops < 1e14 and 1e9 < mem < 1e13
    assert 1e6 < link_bw < 1e12 and 0 < latency < 0.1
    assert (link_bw, latency) != (device_model("cpu-gloo").link.bytes_per_s,
                                  device_model("cpu-gloo").link.latency_s)
    for r in runs:
        assert r["measured_model"]["figures"] == r0["figures"]
        assert r["measured_model"]["losses"] == r0["losses"]
    for a, b in zip(r0["losses"], r0["ref_losses"]):
        assert abs(a - b) <= 1e-5
    assert r0["param_abs"] <= 1e-6


def test_means_over_counts_that_differ_by_rank_match_the_single_device_step(runs):
    """Padding labelled -100 left unevenly by rank (Hugging Face GPT-2), a class-weighted
    cross-entropy with one rank's targets all ignored and a clamped masked mean (an MLP):
    each rank divides by the count summed over the ranks, so losses and parameters are the
    single-device step's; DDP's average of per-rank means lands far from it (the data can
    tell the two apart). AdamW turns rounding in gradients near zero into steps of up to
    its learning rate: its parameters are held to 1e-3 of a distance DDP's is 50x. With
    one sequence per rank (``gpt2-sgdm-1row``) the count is found on a trace at more rows
    per rank (nothing was judged at one, and DDP's per-rank means ran)."""
    r0 = runs[0]["counted_means"]
    assert r0, "no case ran"
    for name, r in r0.items():
        assert len(r["counted"]) == (3 if name.startswith("mlp") else 1), (name, r["counted"])
        assert r["listed"] == [], (name, r["listed"])         # no warning, nothing left
        for a, b in zip(r["got"], r["want"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (name, r["got"], r["want"])
        assert r["ddp"] > 1e-2, (name, r["ddp"])
        bound = 1e-6 if "sgdm" in name or name.startswith("mlp") else 1e-3
        assert r["param"]["abs"] <= bound and r["param"]["abs"] <= r["ddp"] / 50, (name, r)
    for r in runs[1:]:
        assert {k: v["got"] for k, v in r["counted_means"].items()} == \
            {k: v["got"] for k, v in r0.items()}


def test_pipeline_state_dict_and_optimizer_state_hold_every_parameter(runs):
    """dp=2 x pp=2 with a parameter no stage reads: every rank's state_dict() and
    gathered optimizer state are the single-device step's."""
    for r in runs:
        got = r["pp_state"]
        for a, b in zip(got["losses"], got["ref_losses"], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), got
        assert got["keys_equal"] and max(got["abs"].values()) <= 1e-5, got["abs"]
        assert got["abs"]["pooler.weight"] == 0.0, got["abs"]
        assert got["state"]["keys"] == 2 * 16 and got["state"]["rel"] <= 1e-4, got["state"]
        assert got["state"]["steps_equal"], got["state"]


def test_pipeline_ranks_given_different_rows_are_refused(runs):
    """dp=2 x pp=2 fed as a world-sized DistributedSampler feeds it (each rank its own
    rows): the first stage's inputs met the last stage's targets of other examples, with
    no word. Refused on every rank on the first call; inputs that differ alone (an
    augmentation drawn per process; the targets agree) are not."""
    for r in runs:
        msg = r["pp_state"]["world_rows"]
        assert msg is not None and msg.startswith("MeshError: the ranks of one pipeline "
                                                  "pass different batches"), msg
        assert "DistributedSampler(dataset, num_replicas=<dp size>" in msg, msg
        assert r["pp_state"]["augmented"] is None, r["pp_state"]["augmented"]
        noise = r["pp_state"]["noise_per_rank"]
        assert noise is not None and "(%eps differ across pp ranks 0, 1, which read them)" \
            in noise, noise


def test_what_the_ranks_must_agree_on_is_checked_on_the_first_call(runs):
    """A count passed as a 0-d tensor, each rank's of its own share, is refused (the
    global one matches the single-device step); dropout under tensor parallelism with a
    seed per rank is refused on every rank, and with a seed per data-parallel index every
    rank gathers the same model."""
    for r in runs:
        got = r["agreement"]
        assert str(got["local_count"]).startswith("MeshError: the step takes %n as the "
                                                  "same on every rank"), got["local_count"]
        assert "dist.all_reduce(n)" in got["local_count"]
        assert got["global_count"] == pytest.approx(runs[0]["agreement"]["ref"], rel=1e-6)
        assert str(got["seed_per_rank"]).startswith(
            "MeshError: the ranks along mesh axis 'tp' draw different random numbers"), \
            got["seed_per_rank"]
        assert torch.equal(got["seed_per_row"], runs[0]["agreement"]["seed_per_row"])
