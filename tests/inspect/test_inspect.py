"""``diphoma inspect`` on model files written without it in mind (tests/inspect_models: a
nanoGPT-style model.py, a ResNet CNN, a flax MLP, a torch and a JAX step with example
inputs): per-device optimizer state falls as 1/N for dp=1, 8 and 1024; goldens of the text
and JSON reports; bad use fails with a message and exit status 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from diphoma_compile.cli import main
from diphoma_compile.errors import IRVerifyError

MODELS = Path(__file__).parents[1] / "inspect_models"
GPT = str(MODELS / "gpt" / "model.py")
TINY_GPT = "GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))"
ONE_LAYER = "GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32))"


def inspect(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``diphoma inspect`` in this process: (exit status, stdout, stderr). The tests
    check the IR after every pass (the command checks only the final graph by default)."""
    rc = main(["inspect", *argv, "--verify-passes"])
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(capsys, *argv: str) -> dict:
    rc, out, err = inspect(capsys, *argv, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


def check_one_over_n(plans: dict[int, dict]) -> None:
    """Optimizer state per device is the whole state / N, up to one element of padding per
    sharded tensor and the state kept whole (step counts, tensors no dimension divides)."""
    whole = plans[1]["memory"]["opt_state"]
    assert whole == plans[1]["memory"]["single_device_opt_state"]
    for n, p in plans.items():
        states = [t for t in p["tensors"] if t["role"] == "opt_state"]
        kept = sum(t["bytes_per_device"] for t in states if t["placement"] == "R")
        slack = sum(4 for t in states if t["placement"] != "R")
        per = p["memory"]["opt_state"]
        assert p["memory"]["single_device_opt_state"] == whole
        assert per <= (whole - kept) / n + slack + kept, (n, per)
        if n > 1:
            assert kept <= 0.02 * whole      # nearly everything is sharded
            assert per * n >= whole - kept   # and the pieces cover the state
        assert p["param_count"] == plans[1]["param_count"]


# ------------------------------------------------------------------ models as written

def test_gpt_model_file_state_falls_as_one_over_n(capsys):
    inputs = ["--input", "int64[1024,16]<64", "--input", "int64[1024,16]<64"]
    plans = {n: plan_json(capsys, GPT, "--init", ONE_LAYER, *inputs, "--mesh", f"dp={n}")
             for n in (1, 8, 1024)}
    check_one_over_n(plans)
    p = plans[8]
    assert p["context"]["loss"] == "the model's own loss (output[1])"
    assert p["context"]["inputs"].startswith("idx=int64[1024,16]<64, targets=int64[1024,16]<64")
    assert "128 per device" in p["context"]["inputs"]
    batch = {t["name"]: t for t in p["tensors"] if t["role"] == "batch"}
    assert batch["idx"]["shape"] == [128, 16] and batch["idx"]["placement"] == "dp: V"
    # the embedding and the head are one tied parameter
    assert not any(t["name"].startswith("lm_head") for t in p["tensors"])
    assert p["memory"]["activations"] * 8 == pytest.approx(
        plans[1]["memory"]["activations"], rel=0.01)


def test_hugging_face_model_uses_its_own_loss(capsys):
    pytest.importorskip("transformers")
    plans = {n: plan_json(capsys, str(MODELS / "hf_gpt2.py"), "--init",
                          "GPT2LMHeadModel(config)", "--input", "input_ids=int64[16,32]<1000",
                          "--input", "labels=int64[16,32]<1000", "--mesh", f"dp={n}")
             for n in (1, 8)}
    check_one_over_n(plans)
    ctx = plans[8]["context"]
    assert ctx["loss"] == "the model's own loss (output.loss)"
    assert ctx["model"].startswith("hf_gpt2.py:GPT2LMHeadModel (torch, built on the meta")
    assert plans[8]["param_count"] == 1000 * 64 + 64 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 128
    # GPT-2's dropout (0.1) draws per process, as under DDP: the plan says where
    assert plans[8]["notes"]["data-parallel"]["random_per_device"]


def test_cnn_file_defaults_to_cross_entropy(capsys):
    plans = {n: plan_json(capsys, str(MODELS / "cnn.py"), "--input", "f32[1024,3,8,8]",
                          "--optimizer", "momentum", "--mesh", f"dp={n}")
             for n in (1, 8, 1024)}
    check_one_over_n(plans)
    ctx = plans[8]["context"]
    assert ctx["model"] == "cnn.py:ResNet (torch, built on the meta device)"
    assert ctx["loss"].startswith("cross-entropy over the last dimension of output (10 classes)")
    assert "labels=int64[1024]<10" in ctx["inputs"]
    assert ctx["optimizer"] == "SGD(lr=0.01, momentum=0.9)"
    assert "init" not in ctx
    assert any(t["role"] == "buffer" and "running_mean" in t["name"]
               for t in plans[8]["tensors"])


def test_flax_file_state_falls_as_one_over_n(capsys):
    pytest.importorskip("flax")
    plans = {n: plan_json(capsys, str(MODELS / "flax_mlp.py"), "--input", "f32[1024,28,28,1]",
                          "--mesh", f"dp={n}") for n in (1, 8, 1024)}
    check_one_over_n(plans)
    ctx = plans[8]["context"]
    assert ctx["model"].startswith("flax_mlp.py:Classifier (flax.linen")
    assert ctx["optimizer"] == "optax.adamw(1e-3)" and "labels=int32[1024]<10" in ctx["inputs"]
    assert "init" not in ctx      # built as Classifier(): no --init to report
    assert plans[8]["param_count"] == 784 * 1024 + 1024 * 1024 + 1024 * 10 + 10 + 6 * 1024


def test_steps_with_example_inputs(capsys):
    rc, out, err = inspect(capsys, str(MODELS / "torch_step.py"), "--mesh", "dp=4")
    assert rc == 0, err
    assert "model: torch_step.py:train_step (torch step" in out
    assert "inputs: batch.x=float32[64, 32], batch.y=float32[64] (global batch)" in out
    assert "momentum_buffer" in out and "batch.x" in out and "f32[16, 32]" in out
    pytest.importorskip("optax")
    p = plan_json(capsys, str(MODELS / "jax_step.py"), "--mesh", "dp=4")
    assert p["context"]["model"] == "jax_step.py:step (jax step)"
    shapes = {t["name"]: t["shape"] for t in p["tensors"]}
    assert shapes["batch/x"] == [32, 64] and p["memory"]["opt_state"] * 4 == \
        p["memory"]["single_device_opt_state"]


def test_a_model_too_big_for_this_machine_is_planned_on_meta(capsys):
    """40 billion parameters (160 GB in float32, 480 GB with AdamW's moments)."""
    p = plan_json(capsys, str(MODELS / "several.py"), "--init", "nn.Linear(200_000, 200_000)",
                  "--input", "f32[64,200000]", "--mesh", "dp=64")
    assert p["param_count"] == 200_000 * 200_001
    assert p["memory"]["single_device_opt_state"] > 300e9
    assert p["memory"]["opt_state"] < p["memory"]["single_device_opt_state"] / 63


# ------------------------------------------------------------------ the reports

def test_golden_text_and_json_reports(capsys, golden):
    argv = [GPT, "--init", TINY_GPT, "--input", "int64[8,16]<64", "--input", "int64[8,16]<64",
            "--mesh", "dp=4"]
    rc, text, err = inspect(capsys, *argv)
    assert rc == 0, err
    golden("inspect_gpt.txt", text)
    rc, js, err = inspect(capsys, *argv, "--format", "json")
    assert rc == 0, err
    golden("inspect_gpt.json", js)
    data = json.loads(js)
    assert data["schema"] == 3
    # the text groups the two layers; the JSON lists every tensor
    assert "transformer.h.#.attn.c_attn.weight (x2)" in text
    assert {"transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight"} <= \
        {t["name"] for t in data["tensors"]}
    total = sum(c["bytes_per_device"] for c in data["collectives"])
    assert data["comm_bytes_per_step"] == total
    m = data["memory"]
    assert 0 < m["activations"] < m["single_device_activations"]


def test_passes_dump_and_out(capsys, tmp_path):
    out_file = tmp_path / "plan.txt"
    rc, out, err = inspect(capsys, str(MODELS / "several.py:Small"), "--input", "f32[8,16]",
                           "--mesh", "dp=2", "--passes", "dce,data-parallel",
                           "--dump-ir-after", "trace,data-parallel", "--out", str(out_file))
    assert rc == 0, err
    assert out.startswith("# IR after trace\n# diphoma-ir v1\n")
    assert "# IR after data-parallel\n" in out and "all_reduce" in out
    report = out_file.read_text()
    assert "passes: dce, data-parallel{axis=dp, counts=global}" in report
    assert "reduce_scatter" not in report        # no weight-update sharding asked for


def test_dumping_after_a_pass_that_did_not_run_says_so(capsys):
    """--dump-ir-after with a name no pass has printed nothing and said nothing (a
    reviewer's probe); it is an error listing the passes that ran."""
    rc, out, err = inspect(capsys, str(MODELS / "several.py:Small"), "--input", "f32[8,16]",
                           "--mesh", "dp=2", "--dump-ir-after", "nope")
    assert rc == 2
    assert "--dump-ir-after nope: no pass of that name ran (these did: " in err
    assert "data-parallel" in err


def test_by_default_only_the_final_graph_is_checked(capsys, monkeypatch):
    argv = ["inspect", str(MODELS / "several.py:Small"), "--input", "f32[8,16]",
            "--mesh", "dp=2", "--timings"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "# verify (final graph): " in err
    assert "#   pass dce: " in err and "s verify)" not in err
    assert main([*argv, "--verify-passes"]) == 0
    err = capsys.readouterr().err
    assert "# verify (final graph)" not in err and "s verify)" in err
    # a final graph that does not verify is an error that says how to find the pass

    def broken(graph):
        raise IRVerifyError("%9 is used before it is defined")
    monkeypatch.setattr(sys.modules["diphoma_compile.ir.verify"], "verify", broken)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the graph after the passes does not verify" in err and "--verify-passes" in err


# ------------------------------------------------------------------ bad use

@pytest.mark.parametrize("argv, words", [
    ([str(MODELS / "missing.py")], ["no such file: ", "missing.py"]),
    ([GPT + ":GTP"], ["model.py has no 'GTP'", "GPT ", "did you mean GPT?"]),
    ([GPT], ["GPT(config) needs arguments", "--init 'GPT(GPTConfig())'"]),
    ([GPT, "--init", "GPT(GPTConfig(n_head=5))", "--input", "int64[8,16]<64"],
     ["--init 'GPT(GPTConfig(n_head=5))' raised AssertionError",
      "at model.py:", "assert config.n_embd % config.n_head == 0"]),
    ([GPT, "--init", "GPT(GPTConfig(", "--input", "int64[8,16]<64"], ["does not parse"]),
    ([GPT, "--init", TINY_GPT, "--input", "int64[8,16<64"],
     ["--input 'int64[8,16<64' does not parse", "DTYPE[D0,D1,...]"]),
    ([GPT, "--init", TINY_GPT, "--input", "q8[8,16]"], ["unknown dtype 'q8'"]),
    ([GPT, "--init", TINY_GPT, "--input", "f32[8,16]<3"], ["bounds integer inputs only"]),
    ([GPT, "--init", TINY_GPT],
     ["GPT.forward(idx, targets) needs idx, which --input does not describe"]),
    ([GPT, "--init", TINY_GPT, "--input", "int64[12,16]<64"],
     ["idx has a global batch of 12, which does not divide among the 8 devices"]),
    ([GPT, "--init", TINY_GPT, "--input", "int64[8,16]<64", "--mesh", "dp"],
     ["--mesh 'dp': 'dp' is not AXIS=SIZE"]),
    ([str(MODELS / "several.py"), "--input", "f32[8,16]"],
     ["defines several things to plan", "Small", "Gated", "NeedsArgs(width, depth)"]),
    ([str(MODELS / "several.py:Gated"), "--input", "f32[8,16]"],
     ["depends on tensor data", "several.py:23: if y.sum() > 0:"]),
    ([str(MODELS / "several.py:Small"), "--input", "f32[8,16]", "--optimizer", "3"],
     ["--optimizer '3' gave a int, not a torch.optim.Optimizer"]),
    ([str(MODELS / "flax_mlp.py"), "--input", "f32[16,28,28,1]", "--optimizer", "3"],
     ["--optimizer '3' gave a int, not an optax GradientTransformation",
      "one of adamw, adam, sgd, momentum, or an expression such as 'optax.sgd(0.1)'"]),
    ([str(MODELS / "several.py:Small"), "--input", "f32[8,16]", "--loss", "out"],
     ["the loss is (1, 16), not a scalar tensor"]),
    # a name the --loss expression reads that is not there, a misspelt optimizer, an
    # optimizer expression that does not parse: each says so (a review, 2026-12-07, found
    # "tracing the step failed: NameError", a bare NameError, and a hint about --init)
    ([str(MODELS / "several.py:Small"), "--input", "f32[8,16]", "--loss", "(out - y).mean()"],
     ["--loss '(out - y).mean()': name 'y' is not defined", "the inputs by name (x)"]),
    ([str(MODELS / "several.py:Small"), "--input", "f32[8,16]", "--optimizer", "adamx"],
     ["--optimizer 'adamx' is not one of adamw, adam, sgd, momentum", "did you mean adam"]),
    ([str(MODELS / "several.py:Small"), "--input", "f32[8,16]", "--optimizer",
      "torch.optim.SGD(params, lr=0.1"],
     ["does not parse", "e.g. --optimizer 'torch.optim.SGD(params, lr=0.1)'"]),
    # a class named ...Args is the model here, not its config: no NeedsArgs(NeedsArgs())
    ([str(MODELS / "several.py:NeedsArgs"), "--input", "f32[8,16]"],
     ["NeedsArgs(width, depth) needs arguments",
      "--init 'NeedsArgs(width=..., depth=...)'"]),
    # the config class the __init__ annotation names, though the file only imports it
    ([str(MODELS / "pkgmodel" / "models" / "modeling_tiny.py:TinyLM"), "--input",
      "int64[8,16]<64"], ["TinyLM(config: pkgmodel.config.TinyConfig) needs arguments",
                          "--init 'TinyLM(TinyConfig())'"]),
    # a tensor axis alone: not data parallelism under another name, and no batch axis
    ([str(MODELS / "several.py:Small"), "--input", "f32[8,16]", "--mesh", "tp=4"],
     ["--mesh tp=4: tensor parallelism needs a data axis beside it",
      "--mesh dp=1,tp=4"]),
    # no pass partitions over an axis called ep yet (pp: the pipeline pass)
    ([str(MODELS / "several.py:Small"), "--input", "f32[8,16]", "--mesh", "ep=4"],
     ["--mesh ep=4: no pass partitions over axis 'ep' yet",
      "name it dp (--mesh dp=4), or pass --axis ep to split the batch over it"]),
    ([str(MODELS / "several.py:Small"), "--input", "f32[8,16]", "--mesh", "a=2,b=2"],
     ["cannot tell which of the mesh axes a, b is the data axis", "pass --axis NAME"]),
    ([str(MODELS / "loose" / "relative.py")],
     ["running relative.py raised ImportError: attempted relative import",
      "imports relative to a package, but loose/ has no __init__.py",
      "module path instead (package.module:NAME"]),
    (["pkgmodel.models.modeling_nope:TinyLM"],
     ["no such file or module: pkgmodel.models.modeling_nope"]),
])
def test_bad_use_fails_with_a_message(capsys, argv, words):
    rc, out, err = inspect(capsys, *argv)
    assert rc == 2 and not out
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_exit_status_of_the_command():
    r = subprocess.run([sys.executable, "-m", "diphoma_compile", "inspect",
                        str(MODELS / "missing.py")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: no such file")


def test_nothing_needs_memory_or_devices_for_a_wide_mesh(capsys):
    """A mesh far larger than the machine: planning reads only shapes."""
    p = plan_json(capsys, str(MODELS / "several.py:Small"), "--input", "f32[65536,16]",
                  "--mesh", "dp=65536", "--optimizer", "momentum")
    assert p["mesh"] == {"dp": 65536} and p["context"]["optimizer"].startswith("SGD")
    assert math.isclose(p["memory"]["activations"] * 65536,
                        p["memory"]["single_device_activations"], rel_tol=0.01)


def test_a_mesh_axis_no_pass_uses_is_reported_as_idle(capsys):
    """ep=2 (no pass partitions over it yet): the plan says so instead of staying silent."""
    argv = [GPT, "--init", ONE_LAYER, "--input", "int64[8,16]<64", "--input", "int64[8,16]<64"]
    rc, out, _ = inspect(capsys, *argv, "--mesh", "dp=4,ep=2")
    assert rc == 0
    assert "unused mesh axes: ep=2: no pass in this pipeline partitions over them" in out
    p = plan_json(capsys, *argv, "--mesh", "dp=4,ep=2")
    assert p["notes"]["idle_axes"] == {"ep": 2}
    single = plan_json(capsys, *argv, "--mesh", "dp=4")
    assert "idle_axes" not in single["notes"]
    assert p["memory"] == single["memory"]       # the same work on each tp device


def test_a_tensor_axis_plans_megatrons_pairs(capsys):
    """dp=2,tp=2: attention (its fused query/key/value projection split in three groups of
    columns, S(1,3)) and the MLP split over tp, two all-reduces per pair and step."""
    argv = [GPT, "--init", ONE_LAYER, "--input", "int64[8,16]<64", "--input", "int64[8,16]<64"]
    p = plan_json(capsys, *argv, "--mesh", "dp=2,tp=2")
    tp = p["notes"]["tensor-parallel"]
    assert tp["pairs"] == [{"column": ["transformer.h.0.attn.c_attn.weight"],
                            "row": "transformer.h.0.attn.c_proj.weight"},
                           {"column": ["transformer.h.0.mlp.c_fc.weight"],
                            "row": "transformer.h.0.mlp.c_proj.weight"}]
    assert [c["kind"] for c in tp["collectives"]] == ["all_reduce"] * 4
    placement = {t["name"]: t["placement"] for t in p["tensors"]}
    assert placement["transformer.h.0.attn.c_attn.weight"] == "tp: S(0,3)"
    assert "idle_axes" not in p["notes"]
    rc, out, _ = inspect(capsys, *argv, "--mesh", "dp=2,tp=2")
    assert "tensor parallel over tp=2: 2 layer pair(s)" in out
    assert "cannot run this plan" not in out     # the torch runtime runs tensor parallelism


def test_a_single_axis_not_named_for_data_needs_axis(capsys):
    """--axis tp says the batch is split over tp; a mesh of several axes keeps its other
    axes, reported idle (test above), as parallelize does."""
    p = plan_json(capsys, str(MODELS / "several.py:Small"), "--input", "f32[8,16]",
                  "--mesh", "tp=4", "--axis", "tp")
    assert p["passes"][1] == "data-parallel{axis=tp, counts=global}" and p["mesh"] == {"tp": 4}
    for name in ("dp", "data", "batch"):
        p = plan_json(capsys, str(MODELS / "several.py:Small"), "--input", "f32[8,16]",
                      "--mesh", f"{name}=4")
        assert p["passes"][1] == f"data-parallel{{axis={name}, counts=global}}"


# ------------------------------------------------------------------ files in packages

LLAMA = ("LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, "
         "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))")


def test_transformers_modeling_file_by_path_and_by_module(capsys):
    """transformers' modeling files import relative to their package: inspect imports them
    as transformers.models.llama.modeling_llama, whether given as a file or a module."""
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama
    argv = ["--init", LLAMA, "--input", "int64[8,16]<64", "--mesh", "dp=4"]
    by_path = plan_json(capsys, modeling_llama.__file__ + ":LlamaForCausalLM", *argv)
    by_module = plan_json(capsys, "transformers.models.llama.modeling_llama:LlamaForCausalLM",
                          *argv)
    assert by_path["context"]["model"].startswith("modeling_llama.py:LlamaForCausalLM (torch")
    assert by_module["context"]["model"].startswith(
        "transformers.models.llama.modeling_llama:LlamaForCausalLM (torch")
    for p in (by_path, by_module):
        names = {t["name"] for t in p["tensors"]}
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= names
        assert p["memory"]["opt_state"] * 4 == pytest.approx(
            p["memory"]["single_device_opt_state"], rel=0.01)
    # 64x32 embedding and head, q/o 32x32, k/v 16x32 (one kv head), mlp 3x 64x32, 3 norms
    assert by_path["param_count"] == by_module["param_count"] == \
        2 * 64 * 32 + 2 * 32 * 32 + 2 * 16 * 32 + 3 * 64 * 32 + 3 * 32


def test_a_file_in_a_package_with_relative_imports(capsys, monkeypatch):
    tiny = MODELS / "pkgmodel" / "models" / "modeling_tiny.py"
    argv = ["--init", "TinyLM(TinyConfig(depth=3))", "--input", "int64[8,16]<64",
            "--mesh", "dp=2"]
    p = plan_json(capsys, f"{tiny}:TinyLM", *argv)
    assert p["context"]["model"].startswith("modeling_tiny.py:TinyLM (torch")
    assert "blocks.2.fc.weight" in {t["name"] for t in p["tensors"]}
    # the module path, from the folder that holds the package (as python -m would)
    monkeypatch.setattr(sys, "path", [x for x in sys.path if x not in ("", str(MODELS))])
    for name in [m for m in sys.modules if m.split(".")[0] == "pkgmodel"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.chdir(MODELS)
    q = plan_json(capsys, "pkgmodel.models.modeling_tiny:TinyLM", *argv)
    assert q["tensors"] == p["tensors"] and q["param_count"] == p["param_count"]
    assert sys.modules["pkgmodel"].__file__ == str(MODELS / "pkgmodel" / "__init__.py")
    # a file of the package that imports its siblings by bare name runs from its folder
    s = plan_json(capsys, str(MODELS / "pkgmodel" / "models" / "script_style.py:Stack"),
                  "--input", "f32[8,16]", "--mesh", "dp=2")
    assert "blocks.1.fc.weight" in {t["name"] for t in s["tensors"]}


# ------------------------------------------------------------------ small things

def test_an_input_the_model_never_reads_is_warned_about(capsys):
    small = str(MODELS / "several.py:Small")
    rc, _, err = inspect(capsys, small, "--input", "f32[8,16]", "--input", "y=f32[8,4]",
                         "--mesh", "dp=2")
    assert rc == 0
    assert "warning: --input y=float32[8,4] is read neither by the model nor by the loss" in err
    rc, _, err = inspect(capsys, small, "--input", "f32[8,16]", "--input", "f32[8,4]",
                         "--mesh", "dp=2")
    assert rc == 0 and "warning: --input float32[8,4] (called input1) is read neither" in err
    # read by the loss: no warning
    rc, _, err = inspect(capsys, small, "--input", "f32[8,16]", "--input", "y=f32[8,16]",
                         "--loss", "F.mse_loss(out, y)", "--mesh", "dp=2")
    assert rc == 0 and "warning" not in err
    pytest.importorskip("flax")
    rc, _, err = inspect(capsys, str(MODELS / "flax_mlp.py"), "--input", "f32[8,28,28,1]",
                         "--input", "y=f32[8,4]", "--mesh", "dp=2")
    assert rc == 0 and "warning: --input y=float32[8,4] is read neither" in err


def test_collectives_name_the_tensors_they_move(capsys):
    """The text shows parameter names, not IR values; each member of a bucket is named
    as the same collective unfused names it."""
    step = str(MODELS / "torch_step.py")
    rc, text, err = inspect(capsys, step, "--mesh", "dp=4")
    assert rc == 0, err
    table = text.split("\ncollectives (")[1].split("\n\n")[0]
    assert " tensor " in table.splitlines()[1]
    assert "(+2)" in table and "sumsq" not in table
    fused = plan_json(capsys, step, "--mesh", "dp=4")
    alone = plan_json(capsys, step, "--mesh", "dp=4", "--passes",
                      "dce,data-parallel,weight-update-sharding")
    params = {t["name"] for t in alone["tensors"] if t["role"] == "param"}
    for kind, what in (("reduce_scatter", "gradient of "), ("all_gather", "new value of ")):
        one = [c for c in alone["collectives"] if c["kind"] == kind]
        assert [c["belongs_to"] for c in one] == [[c["serves"].removeprefix(what)]
                                                  for c in one]
        bucket, = [c for c in fused["collectives"] if c["kind"] == kind]
        assert bucket["belongs_to"] == [c["belongs_to"][0] for c in one]
    # a gradient norm's partial sums belong to the parameters whose gradients they square
    sums = [c for c in alone["collectives"] if c["serves"].startswith("scalar sum")]
    assert sums and all(c["belongs_to"][0] in params for c in sums)
    assert len({c["belongs_to"][0] for c in sums}) == len(sums)


def test_shard_params_and_microbatches_plan_as_parallelize_does(capsys):
    """--shard-params and --microbatches: the parameters held as pieces over dp, gathered
    once a step on each pipeline stage; refused beside --passes, and without a pp axis."""
    args = (GPT, "--init", TINY_GPT, "--input", "int64[8,16]<64", "--input", "int64[8,16]<64")
    rc, out, err = inspect(capsys, *args, "--mesh", "dp=2,pp=2", "--shard-params",
                           "--microbatches", "4")
    assert rc == 0, err
    assert "shard-params{axis=dp, backward=regather}" in out
    assert "microbatches=4, schedule=1f1b" in out and "4 microbatch(es)" in out
    assert "gathered once a step on each pipeline stage that reads them (once" in out
    assert "calls a step (sends included, receives not)" in out
    rc, out, err = inspect(capsys, *args, "--mesh", "dp=2", "--shard-params", "--passes",
                           "dce")
    assert rc != 0 and "--shard-params picks the default passes" in err
    rc, out, err = inspect(capsys, *args, "--mesh", "dp=2", "--microbatches", "4")
    assert rc != 0 and "microbatches=4 is for pipeline parallelism" in err
    # a schedule the runtime refuses is refused in the plan too (1F1B planned at M = 1 on
    # two ranks with a 50% bubble, then refused by the run: a review, 2026-12-07)
    rc, out, err = inspect(capsys, *args, "--mesh", "pp=2", "--microbatches", "1")
    assert rc == 2 and "1F1B schedule refuses 1 microbatches on 2 ranks" in err, err


@pytest.mark.parametrize("mesh, grid", [("pp=2", ["all: 0 1"]),
                                        ("dp=2,pp=2", ["dp=0: 0 1", "dp=1: 2 3"])])
def test_pipeline_plan_shows_stages_schedule_and_rank_grid(capsys, mesh, grid):
    """--mesh with a pp axis plans pipeline stages: each stage's layers, parameters and
    flops, the schedule and its bubble, and which ranks run which stage (row-major)."""
    rc, out, err = inspect(capsys, GPT, "--init", TINY_GPT, "--input", "int64[8,16]<64",
                           "--input", "int64[8,16]<64", "--mesh", mesh)
    assert rc == 0, err
    assert "pipeline{axis=pp, stages=auto, microbatches=2, schedule=1f1b, balance=time, " \
           "device-model=h100-nccl, gather=step}" in out
    assert "pipeline over pp=2: schedule 1f1b, 2 microbatch(es), bubble 33.3%" in out
    head = next(line for line in out.splitlines() if line.strip().startswith("stage "))
    assert head.split() == ["stage", "layers", "params", "param", "bytes", "flops/microbatch",
                            "saved/microbatch", "balanced", "on:", "h100-nccl", "time"]
    rows = out.split(head, 1)[1].strip("\n").splitlines()[:2]
    assert rows[0].split()[0] == "0" and "transformer.h.0" in rows[0]
    assert rows[1].split()[0] == "1" and "transformer.ln_f" in rows[1]
    assert "tied: transformer.wte.weight held on stages 0, 1" in out
    # the peak is the fullest rank's, with every rank's (report/pipeline_peak.py)
    peak = next(line for line in out.splitlines() if line.strip().startswith("peak "))
    assert "the fullest pipeline rank" in peak and "by pp rank: " in peak
    assert len(peak.split("by pp rank: ")[1].split(", ")) == 2
    for line in grid:
        assert f"    {line}\n" in out
    plan = plan_json(capsys, GPT, "--init", TINY_GPT, "--input", "int64[8,16]<64",
                     "--input", "int64[8,16]<64", "--mesh", mesh)
    stages = plan["notes"]["pipeline"]["stages"]
    assert [s["index"] for s in stages] == [0, 1] and all(s["flops"] > 0 for s in stages)
    # balanced on their time per microbatch on the plan's device model: within 2x here
    assert plan["notes"]["pipeline"]["device_model"] == "h100-nccl"
    times = [s["balanced"] for s in stages]
    assert min(times) > 0 and max(times) < 2 * min(times), times
    # memory per device is the fuller stage's, not the whole model's (it was the whole
    # model's: a pipeline's point is that no device holds it)
    mem = plan["memory"]
    assert mem["params"] == max(s["param_bytes"] for s in stages) < mem["single_device_params"]
    # each stage's saved activations per microbatch; a rank keeps up to P - r of them (1F1B)
    assert all(s["activation_bytes"] > 0 for s in stages)
    assert mem["activations"] == max(2 * stages[0]["activation_bytes"],
                                     stages[1]["activation_bytes"])
    assert mem["opt_state"] < mem["single_device_opt_state"]
    # a rank's peak: at least what it holds, and the step's is the fullest rank's
    assert len(mem["peak_per_rank"]) == 2 and mem["peak"] == max(mem["peak_per_rank"])
    assert mem["peak"] > mem["params"] + mem["opt_state"]
    assert mem["peak_at"].startswith("rank ")


FOUR_LAYERS = "GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=2, n_embd=32))"


def test_plot_draws_the_pipeline_schedule(capsys, tmp_path):
    """--plot FILE writes a picture of the schedule (ranks x time) laid out from the
    schedule's action lists and the stages' flops; --schedule interleaved plans 4 stages of
    a 4-layer model on pp=2, two per rank."""
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "schedule.png"
    rc, out, err = inspect(capsys, GPT, "--init", FOUR_LAYERS, "--input", "int64[8,16]<64",
                           "--input", "int64[8,16]<64", "--mesh", "pp=2",
                           "--schedule", "interleaved", "--plot", str(out_png))
    assert rc == 0, err
    assert "pipeline over pp=2: 4 stages, schedule interleaved" in out
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("schedule, heading, ranks", [
    ("interleaved", "(stage s on pp s mod 2)", ["0", "1", "0", "1"]),
    ("zbv", "(stages r and 3 - r on pp r, a V)", ["0", "1", "1", "0"])])
def test_the_rank_grid_says_where_each_stage_runs(capsys, schedule, heading, ranks):
    """With several stages per rank the stage table has a rank column and the grid's
    heading names the placement: round robin, or zbv's V (it said "s mod P" for zbv too)."""
    rc, out, err = inspect(capsys, GPT, "--init", FOUR_LAYERS, "--input", "int64[8,16]<64",
                           "--input", "int64[8,16]<64", "--mesh", "pp=2",
                           "--schedule", schedule)
    assert rc == 0, err
    assert f"rank grid (row-major over pp): ranks of pp 0..1 {heading}" in out
    head = next(line for line in out.splitlines() if line.strip().startswith("stage "))
    rows = out.split(head, 1)[1].strip("\n").splitlines()[:4]
    assert [row.split()[-1] for row in rows] == ranks


def test_plot_draws_a_flax_models_zero_bubble_schedule(capsys, tmp_path):
    """A JAX model's schedule is laid out from the orders the JAX runtime runs (written
    out, no torch needed): zbv's 4 stages on pp=2 (it was refused: the JAX framework gave
    orders for GPipe and 1F1B only)."""
    pytest.importorskip("flax")
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "schedule.png"
    rc, out, err = inspect(capsys, str(MODELS / "flax_mlp.py"), "--input", "f32[16,28,28,1]",
                           "--mesh", "pp=2", "--schedule", "zbv", "--plot", str(out_png))
    assert rc == 0, err
    assert "pipeline over pp=2: 4 stages, schedule zbv" in out
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_without_matplotlib_says_to_install_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib fails
    out_png = tmp_path / "schedule.png"
    rc, out, err = inspect(capsys, GPT, "--init", TINY_GPT, "--input", "int64[8,16]<64",
                           "--input", "int64[8,16]<64", "--mesh", "pp=2",
                           "--plot", str(out_png))
    assert rc != 0
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err
    assert not out_png.exists()


def test_plot_without_a_pipeline_is_refused(capsys, tmp_path):
    rc, out, err = inspect(capsys, GPT, "--init", TINY_GPT, "--input", "int64[8,16]<64",
                           "--input", "int64[8,16]<64", "--mesh", "dp=2",
                           "--plot", str(tmp_path / "s.png"))
    assert rc != 0 and "this plan has none" in err


def test_layer_groups_fold_torch_and_flax_names():
    from diphoma_compile.report.text import _layer_groups
    assert _layer_groups(("transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc",
                          "transformer.h.1.ln_1", "transformer.wte")) == \
        "transformer.h.0, transformer.h.1, transformer.wte"
    assert _layer_groups(("params/Block_0/Dense_0/kernel", "params/Block_0/LayerNorm_1/scale",
                          "params/Embed_0/embedding", "params/LayerNorm_0/scale",
                          "params/head/kernel")) == "Block_0, Embed_0, LayerNorm_0, head"


def test_a_wrong_input_shape_prints_the_error_without_torchs_traceback(tmp_path):
    """An --input the model refuses (9 features where it takes 8): the error named the op
    and the line, after twenty lines of FakeTensor's own logged traceback on stderr. (A
    process of its own: torch's log handlers write to the stderr they found at import.)"""
    model = tmp_path / "mlp.py"
    model.write_text("import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n"
                     "    def __init__(self):\n        super().__init__()\n"
                     "        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)\n\n"
                     "    def forward(self, x):\n"
                     "        return self.b(torch.relu(self.a(x)))\n")
    r = subprocess.run([sys.executable, "-m", "diphoma_compile", "inspect", str(model),
                        "--input", "f32[8,9]"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "error: tracing the step failed" in r.stderr, r.stderr
    assert "fake_tensor.py" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "--input" in r.stderr


def test_example_inputs_that_return_nothing_are_named(tmp_path, capsys):
    """An example_inputs() that forgot its return: the error said no PyTorch module was
    among the example arguments, not which function gave none."""
    model = tmp_path / "steps.py"
    model.write_text("import torch\n\n\ndef train_step(model, opt, x):\n"
                     "    loss = model(x).sum()\n    loss.backward()\n    opt.step()\n"
                     "    return loss\n\n\ndef example_inputs():\n"
                     "    model = torch.nn.Linear(4, 2)\n"
                     "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    rc, out, err = inspect(capsys, f"{model}:train_step")
    assert rc == 2 and "example_inputs() returned None, not the step's example arguments" \
        in err, err


def test_example_inputs_that_raise_are_named_with_their_line(tmp_path, capsys):
    """An example_inputs() that raises (its data missing): a raw traceback and status 1
    before (a review's probe, 2026-12-07); now the error, its line, status 2."""
    model = tmp_path / "steps.py"
    model.write_text("import torch\n\n\ndef train_step(model, opt, x):\n"
                     "    loss = model(x).sum()\n    loss.backward()\n    opt.step()\n"
                     "    return loss\n\n\ndef example_inputs():\n"
                     "    raise RuntimeError('dataset not found')\n")
    rc, out, err = inspect(capsys, f"{model}:train_step")
    assert rc == 2 and "example_inputs() raised RuntimeError: dataset not found" in err, err
    assert "steps.py:12" in err, err
