"""Pass infrastructure and the dce/cse passes: goldens, contracts, specs, plugins, errors."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from diphoma_compile.errors import PassError, PassSpecError
from diphoma_compile.ir import Graph, parse, print_graph, verify
from diphoma_compile.passes import (Pass, PassContext, PassFailure, Pipeline, available_passes,
                                    get_pass, parse_spec, register_pass, unregister_pass)
from diphoma_compile.passes import base as pass_base

EXAMPLE = Path(__file__).parents[2] / "examples" / "mlp_sgd_step.ir"


def run(spec: str, text: str, ctx: PassContext | None = None) -> Graph:
    return Pipeline.from_spec(spec).run(verify(parse(text)), ctx)


# ------------------------------------------------------------------ goldens

@pytest.mark.parametrize("case", ["dce", "cse"])
def test_pass_golden(case, ir_case, golden):
    golden(f"{case}.ir", print_graph(run(case, ir_case(case))))


def test_example_dce_cse_golden(golden):
    golden("mlp_sgd_step.dce-cse.ir", print_graph(run("dce,cse", EXAMPLE.read_text())))


def test_dce_removes_dead_and_keeps_effects(ir_case):
    g = run("dce", ir_case("dce"))
    names = {v.name for op in g.walk() for v in op.results}
    assert {"dead1", "dead2", "dead_inner", "dead_call"}.isdisjoint(names)
    assert any(op.name == "send" for op in g.ops)
    assert "unused_in" in {i.name for i in g.inputs}


def test_cse_merges_and_renames(ir_case):
    g = run("cse", ir_case("cse"))
    names = {v.name for op in g.walk() for v in op.results}
    assert {"c2", "m2", "t2", "d2", "cc", "mm", "r4"}.isdisjoint(names)
    # kept apart: other attrs, other result types, other stages, unseeded draws
    assert {"s1", "s2", "h1", "h2", "st0", "st1", "r1", "r2", "r3"} <= names
    assert [o.name for o in g.outputs][:2] == ["total", "d1"]


@pytest.mark.parametrize("spec", ["dce", "cse"])
def test_pass_is_idempotent_and_unchanged_is_identity(spec, ir_case):
    once = run(spec, ir_case(spec))
    p = get_pass(spec)()
    assert p(once, PassContext()) is once


def test_passes_do_not_mutate_input():
    g = verify(parse(EXAMPLE.read_text()))
    before = print_graph(g)
    Pipeline.from_spec("dce,cse").run(g)
    assert print_graph(g) == before


def test_header_lists_passes_and_records(ir_case):
    ctx = PassContext()
    g = run("dce,cse,dce", ir_case("dce"), ctx)
    assert g.passes == ("dce", "cse", "dce")
    assert "passes[dce, cse, dce]" in print_graph(g)
    assert [r.spec for r in ctx.records] == ["dce", "cse", "dce"]
    assert [r.changed for r in ctx.records] == [True, False, False]
    assert all(r.seconds >= 0 and r.verify_seconds >= 0 for r in ctx.records)


# ------------------------------------------------------------------ spec strings

@dataclass(frozen=True)
class _Opts(Pass):
    """A pass with typed options, for spec parsing tests."""

    name = "test-opts"
    bucket_mb: float = 25.0
    axis: str = "dp"
    count: int = 1
    enabled: bool = True

    def __call__(self, graph, ctx):
        ctx.decisions[self.name] = self
        return graph


@pytest.fixture
def opts_pass():
    register_pass(_Opts)
    yield _Opts
    unregister_pass(_Opts.name)


def test_spec_options_are_typed(opts_pass):
    (p,) = parse_spec("test-opts{bucket-mb=12.5, axis=tp, count=3, enabled=false}")
    assert p == _Opts(bucket_mb=12.5, axis="tp", count=3, enabled=False)
    assert p.spec() == "test-opts{bucket-mb=12.5, axis=tp, count=3, enabled=false}"
    assert parse_spec(" dce , test-opts ,cse ")[1] == _Opts()
    assert Pipeline.from_spec(p.spec()).passes == (p,)


@pytest.mark.parametrize("spec, words", [
    ("nope", "unknown pass 'nope'"),
    ("dce,,cse", "expected a pass name"),
    ("dce,", "trailing ','"),
    ("test-opts{count=x}", "should be int"),
    ("test-opts{colour=red}", "has no option 'colour'"),
    ("test-opts{count=1, count=2}", "given twice"),
    ("test-opts{count=1", "unclosed"),
    ("test-opts{count}", "expected option=value"),
    ("dce cse", "expected ','"),
    ("test-opts{enabled=maybe}", "should be bool"),
])
def test_bad_specs(opts_pass, spec, words):
    with pytest.raises(PassSpecError) as e:
        parse_spec(spec)
    assert words in str(e.value)


def test_unknown_pass_lists_known():
    with pytest.raises(PassSpecError) as e:
        get_pass("dead-code")
    assert "dce" in str(e.value) and "cse" in str(e.value)


def test_register_rejects_non_frozen_and_duplicates():
    class Loose(Pass):  # a subclass that is not itself a frozen dataclass
        name = "loose"
    with pytest.raises(PassSpecError, match="frozen dataclass"):
        register_pass(Loose)

    @dataclass(frozen=True)
    class Other(Pass):
        name = "dce"
    with pytest.raises(PassSpecError, match="two passes are named 'dce'"):
        register_pass(Other)


# ------------------------------------------------------------------ plugins

PLUGIN_SRC = '''
from dataclasses import dataclass

from diphoma_compile.ir import Op, Output, OutputKind, Value
from diphoma_compile.passes import Pass


@dataclass(frozen=True)
class NegateLoss(Pass):
    """Negates the loss output ``times`` times (a toy plugin)."""

    name = "negate-loss"
    times: int = 1

    def __call__(self, graph, ctx):
        fresh, types = graph.fresh_names(), graph.value_types()
        ops, outs = list(graph.ops), []
        for o in graph.outputs:
            if o.role.kind is OutputKind.loss:
                name = o.name
                for _ in range(self.times):
                    new = fresh("neg_loss")
                    ops.append(Op("neg", (name,), (Value(new, types[o.name]),)))
                    name = new
                o = Output(name, o.role)
            outs.append(o)
        return graph.replace(ops=tuple(ops), outputs=tuple(outs))
'''


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """A package on sys.path that declares a pass in the entry-point group, like an install."""
    (tmp_path / "diphoma_toy_plugin.py").write_text(PLUGIN_SRC)
    dist = tmp_path / "diphoma_toy_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: diphoma-toy-plugin\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{pass_base.ENTRY_POINT_GROUP}]\nnegate-loss = diphoma_toy_plugin:NegateLoss\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(pass_base, "_PLUGINS_LOADED", False)
    yield
    unregister_pass("negate-loss")
    sys.modules.pop("diphoma_toy_plugin", None)


def test_entry_point_plugin_runs_by_name(plugin_dist):
    g = run("dce,negate-loss{times=2}", EXAMPLE.read_text())
    assert g.passes == ("dce", "negate-loss{times=2}")
    assert [op.name for op in g.ops[-2:]] == ["neg", "neg"]
    assert g.outputs[0].name == "neg_loss.1"
    assert "negate-loss" in available_passes()


def test_broken_plugin_is_reported(tmp_path, monkeypatch):
    dist = tmp_path / "broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{pass_base.ENTRY_POINT_GROUP}]\nbroken = no_such_module_xyz:Pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(pass_base, "_PLUGINS_LOADED", False)
    with pytest.raises(PassSpecError, match="plugin pass 'broken'.*failed to load"):
        parse_spec("not-registered")


def test_registry_api_plugin_runs_by_name(opts_pass, ir_case):
    ctx = PassContext()
    run("test-opts{count=7}", ir_case("dce"), ctx)
    assert ctx.decisions["test-opts"].count == 7


# ------------------------------------------------------------------ pipeline failures and dumps

@dataclass(frozen=True)
class _Breaker(Pass):
    """Leaves a use of an undefined value behind."""

    name = "test-breaker"

    def __call__(self, graph, ctx):
        op = graph.ops[0]
        return graph.replace(ops=(op.replace(inputs=("ghost",) + op.inputs[1:]),)
                             + graph.ops[1:])


@dataclass(frozen=True)
class _Refuser(Pass):
    """Fails on purpose, naming an op."""

    name = "test-refuser"

    def __call__(self, graph, ctx):
        raise PassFailure("cannot shard this op", op=graph.ops[1], hint="try another axis")


@dataclass(frozen=True)
class _Buggy(Pass):
    name = "test-buggy"

    def __call__(self, graph, ctx):
        return {}["missing"]


@pytest.fixture
def bad_passes():
    for c in (_Breaker, _Refuser, _Buggy):
        register_pass(c)
    yield
    for c in (_Breaker, _Refuser, _Buggy):
        unregister_pass(c.name)


def test_verify_failure_names_pass_before_and_op(bad_passes):
    with pytest.raises(PassError) as e:
        run("dce,cse,test-breaker", EXAMPLE.read_text())
    msg = str(e.value)
    assert "pass 'test-breaker' left a graph that does not verify" in msg
    assert "passes run before it: dce, cse" in msg
    assert ">> %h: f32[32,16] = dot(%ghost, %fc1.weight)" in msg
    assert "uses %ghost before it is defined" in msg
    assert e.value.pass_name == "test-breaker" and e.value.before == ("dce", "cse")


def test_pass_failure_names_op(bad_passes):
    with pytest.raises(PassError) as e:
        run("dce,test-refuser", EXAMPLE.read_text())
    msg = str(e.value)
    assert "pass 'test-refuser' failed (passes run before it: dce)" in msg
    assert "cannot shard this op" in msg and "try another axis" in msg
    assert "at op: %b1: f32[32,16] = broadcast_in_dim(%fc1.bias)" in msg


def test_bug_in_pass_is_labelled(bad_passes):
    with pytest.raises(PassError, match="KeyError; this is a bug in the pass"):
        run("test-buggy", EXAMPLE.read_text())


def test_unverified_input_is_rejected_before_passes():
    bad = EXAMPLE.read_text().replace("%a: f32[32,16] = relu(%h1)", "%a: f32[32,16] = relu(%h9)")
    with pytest.raises(PassError, match="does not verify, before any pass ran"):
        Pipeline.from_spec("dce").run(parse(bad))


def test_dump_after_to_stream_and_dir(tmp_path, ir_case):
    chunks: list[str] = []
    run("dce,cse", ir_case("dce"), PassContext(dump_after=frozenset({"cse"}),
                                               dump_stream=chunks.append))
    assert len(chunks) == 1 and chunks[0].startswith("# IR after cse\n")
    assert parse(chunks[0]).passes == ("dce", "cse")  # a dump reads back
    run("dce,cse", ir_case("dce"), PassContext(dump_after="all", dump_dir=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00-dce.ir", "01-cse.ir"]


def test_golden_mismatch_prints_diff(tmp_path):
    from diphoma_compile.testing.golden import GoldenMismatch, check_golden
    f = tmp_path / "x.ir"
    with pytest.raises(GoldenMismatch, match="does not exist"):
        check_golden(f, "a\n")
    check_golden(f, "a\nb\n", update=True)
    check_golden(f, "a\nb\n")
    with pytest.raises(GoldenMismatch) as e:
        check_golden(f, "a\nc\n")
    assert "-b\n+c" in str(e.value) and "--update-golden" in str(e.value)


def test_update_golden_flag_rewrites(tmp_path):
    """Runs pytest on a throwaway test with --update-golden, then without it."""
    import subprocess
    conftest = Path(__file__).parents[1] / "conftest.py"
    (tmp_path / "conftest.py").write_text(conftest.read_text().replace(
        'Path(__file__).parent / "golden"', f'Path({str(tmp_path / "g")!r})'))
    (tmp_path / "test_x.py").write_text(textwrap.dedent('''
        def test_g(golden):
            golden("t.ir", "hello\\n")
    '''))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == 1 and "does not exist" in first.stdout
    second = subprocess.run(cmd + ["--update-golden"], capture_output=True, text=True,
                            cwd=tmp_path)
    assert second.returncode == 0, second.stdout
    assert (tmp_path / "g" / "t.ir").read_text() == "hello\n"
    third = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert third.returncode == 0, third.stdout


def test_a_pass_that_writes_plain_notes_still_reaches_the_plan():
    """Passes written before typed records put a dict in ``ctx.notes``: the plan keeps it
    as its JSON form (text and JSON reports do not fail on it)."""
    from diphoma_compile.report.plan import build_plan

    @dataclass(frozen=True)
    class OldStyle(Pass):
        name = "old-style-notes"

        def __call__(self, graph, ctx):
            ctx.notes[self.name] = {"looked_at": len(graph.ops)}
            return graph
    register_pass(OldStyle)
    try:
        ctx = PassContext()
        g = run("old-style-notes", EXAMPLE.read_text(), ctx)
        plan = build_plan(g, ctx.decisions)
        assert plan.notes["old-style-notes"] == {"looked_at": len(g.ops)}
        assert '"old-style-notes"' in plan.to_json() and plan.to_text()
    finally:
        unregister_pass("old-style-notes")
