"""Aten ops that return several values, with any subset of them kept.

The importer keeps only the results a call returns as tensors (``outs`` lists their
positions): convolution_backward of a bias-free conv on the images returns
``(None, grad_weight, None)`` and becomes an opaque op with one result and ``outs=[1]``.
The backend must still index the call's tuple. Checked three ways: a torchvision-style
ResNet stem trained against eager (on one device, and data-parallel on a one-device mesh
in this process; tests/distributed runs it on 4 ranks); traced steps that make eager ask
for each kind of partial result; and, for every multi-result aten op the frontend meets,
an IR graph per non-empty subset of its results, built and run against the aten call."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import BackendError  # noqa: E402
from diphoma_compile.ir import (Attrs, Graph, Input, InputKind, InputRole, Op, Output,  # noqa: E402
                                OutputKind, OutputRole, TensorType, Value, parse,
                                print_graph, verify)
from diphoma_compile.mesh import Mesh  # noqa: E402
from diphoma_compile.passes import PassContext, Pipeline  # noqa: E402
from diphoma_compile.passes.defaults import default_passes  # noqa: E402
from diphoma_compile.torch.build import build_module  # noqa: E402
from diphoma_compile.torch.collectives import Comm  # noqa: E402
from diphoma_compile.torch.ops import ir_dtype  # noqa: E402
from diphoma_compile.torch.runtime import TorchStep  # noqa: E402
from diphoma_compile.torch.trace import trace_torch  # noqa: E402

from models import ResNetStem, classify_step, image_batches  # noqa: E402

aten = torch.ops.aten

STEM_OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


def assert_same(tag: str, a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (tag, a.dtype, b.dtype, a.shape, b.shape)
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{tag} differs from eager, max abs diff {diff:.3g}")


def assert_trained_alike(tag: str, model, opt, ref, ref_opt) -> None:
    """Parameters, buffers and optimizer state equal, bit for bit."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(f"{tag} param {name}", p, q)
        for key, v in ref_opt.state[q].items():
            assert_same(f"{tag} state {name}.{key}", opt.state[p][key], v)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert_same(f"{tag} buffer {name}", b, c)


def kept_results(graph: Graph) -> set[tuple[str, tuple[int, ...]]]:
    """(target, outs) of every opaque op that keeps some of its call's results."""
    return {(str(op.attrs["target"]), tuple(op.attrs["outs"])) for op in graph.ops
            if op.name == "opaque" and "outs" in op.attrs}


STEM_GRAD = ("aten.convolution_backward.default", (1,))   # only the stem weight's gradient


# ------------------------------------------------------------------ the ResNet stem

@pytest.mark.parametrize("opt_name", list(STEM_OPTIMIZERS))
def test_resnet_stem_matches_eager(opt_name):
    torch.manual_seed(0)
    model = ResNetStem()
    ref = copy.deepcopy(model)
    opt, ref_opt = (STEM_OPTIMIZERS[opt_name](m.parameters()) for m in (model, ref))
    data = image_batches(3)
    assert STEM_GRAD in kept_results(diphoma_compile.trace(classify_step, model, opt, data[0]))
    step = diphoma_compile.compile(classify_step, model, opt, data[0])
    for i, batch in enumerate(data):
        assert_same(f"step {i} loss", step(model, opt, batch), classify_step(ref, ref_opt, batch))
        assert_trained_alike(f"step {i}", model, opt, ref, ref_opt)


def test_resnet_stem_data_parallel_graph_verifies():
    torch.manual_seed(0)
    model = ResNetStem()
    opt = STEM_OPTIMIZERS["adamw"](model.parameters())
    graph = diphoma_compile.trace(classify_step, model, opt, image_batches(1)[0])
    dist = Pipeline.from_spec(default_passes("dp", layout="flat")).run(
        graph.replace(mesh=Mesh({"dp": 2})), PassContext())
    verify(dist)
    assert STEM_GRAD in kept_results(dist)
    assert any(op.name == "reduce_scatter" for op in dist.ops)
    build_module(dist, {"dp": Comm("dp", 2, 0)})   # the per-rank program builds


@pytest.mark.parametrize("opt_name", list(STEM_OPTIMIZERS))
def test_resnet_stem_data_parallel_program_on_one_device(opt_name):
    """The per-rank program with its collectives, on a one-device mesh (a collective over
    one rank is the identity, an average divides by 1): eager's step, bit for bit. Before
    the fix the stem's gradient reached its all_reduce as a tuple."""
    torch.manual_seed(0)
    model = ResNetStem()
    ref = copy.deepcopy(model)
    opt, ref_opt = (STEM_OPTIMIZERS[opt_name](m.parameters()) for m in (model, ref))
    data = image_batches(3)
    graph, cap = trace_torch(classify_step, model, opt, data[0])
    dist = Pipeline.from_spec("dce,data-parallel{axis=dp},dce").run(
        graph.replace(mesh=Mesh({"dp": 1})), PassContext())
    assert any(op.name == "all_reduce" for op in dist.ops)
    step = TorchStep(dist, cap, build_module(dist, {"dp": Comm("dp", 1, 0)}))
    for i, batch in enumerate(data):
        assert_same(f"step {i} loss", step(model, opt, batch), classify_step(ref, ref_opt, batch))
        assert_trained_alike(f"step {i}", model, opt, ref, ref_opt)


# ------------------------------------------------------------------ traced partial results

class OneParam(nn.Module):
    """A single bias-free linear layer: clip_grad_norm_ (foreach) takes the norms of a list
    of one gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5, bias=False)

    def forward(self, x):
        return self.fc(x.flatten(1)[:, :8])


class Mid(nn.Module):
    """A bias-free conv inside the network (its input needs a gradient), and a conv with a
    bias on the images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        h = self.conv2(torch.relu(self.conv1(x)))
        return self.fc(h.mean((2, 3)))


class Norms(nn.Module):
    """LayerNorms without affine or without bias, BatchNorm without affine, a split into
    one piece and an unbind over a dimension of one."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, affine=False)
        self.ln_plain = nn.LayerNorm(4, elementwise_affine=False)
        self.ln_nobias = nn.LayerNorm(4, bias=False)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        h = self.bn(self.conv(x)).mean((2, 3))           # (batch, 4)
        h = self.ln_nobias(self.ln_plain(h))
        (whole,) = h.split(4, dim=1)
        (row,) = h[None].unbind(0)
        return self.fc(whole + row)


def clip_foreach_step(model, opt, batch):
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad()
    return loss


TRACED = {
    "conv-mid": (Mid, classify_step, {("aten.convolution_backward.default", (0, 1)),
                                      ("aten.convolution_backward.default", (1, 2))}),
    "norms": (Norms, classify_step, {("aten.native_layer_norm_backward.default", (0,)),
                                     ("aten.native_layer_norm_backward.default", (0, 1)),
                                     ("aten.native_batch_norm_backward.default", (0,)),
                                     ("aten.split.Tensor", (0,)), ("aten.unbind.int", (0,))}),
    "clip-one-param": (OneParam, clip_foreach_step, {("aten._foreach_norm.Scalar", (0,))}),
}


@pytest.mark.parametrize("case", list(TRACED))
def test_traced_partial_results_match_eager(case):
    make, step_fn, expected = TRACED[case]
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    data = image_batches(2, size=8)
    kept = kept_results(diphoma_compile.trace(step_fn, model, opt, data[0]))
    assert expected <= kept, sorted(kept)
    step = diphoma_compile.compile(step_fn, model, opt, data[0])
    for i, batch in enumerate(data):
        assert_same(f"step {i} loss", step(model, opt, batch), step_fn(ref, ref_opt, batch))
        assert_trained_alike(f"step {i}", model, opt, ref, ref_opt)


# ------------------------------------------------------------------ every op, every subset

@dataclass(frozen=True)
class T:
    """The k-th tensor operand in a case's arguments."""

    k: int


@dataclass
class Case:
    """One multi-result aten call: its operands (made from a generator), its arguments with
    ``T(k)`` for operand k, and, for a backward that is told which results to compute,
    the position of its ``output_mask``."""

    target: str
    operands: Callable[[torch.Generator], list[torch.Tensor]]
    args: tuple
    kwargs: dict = field(default_factory=dict)
    mask: int | None = None
    seeded: bool = False     # draws from the global generator: seed before each call


def _r(*shape):
    return lambda g: torch.randn(*shape, generator=g)


def _ops(*makers):
    return lambda g: [m(g) for m in makers]


def _int(high, *shape):
    return lambda g: torch.randint(0, high, shape, generator=g)


def _pos(*shape):
    return lambda g: torch.rand(*shape, generator=g) + 0.5


def _grid(g):
    return torch.rand(2, 3, 3, 2, generator=g) * 2 - 1


def _bn_stats(g):
    return [torch.randn(2, 3, 4, 4, generator=g), torch.rand(3, generator=g) + 0.5,
            torch.randn(3, generator=g), torch.randn(3, generator=g),
            torch.rand(3, generator=g) + 0.5]


def _ln_saved(g):
    x = torch.randn(2, 3, 4, generator=g)
    _, mean, rstd = aten.native_layer_norm(x, [4], None, None, 1e-5)
    return [torch.randn(2, 3, 4, generator=g), x, mean, rstd, torch.randn(4, generator=g),
            torch.randn(4, generator=g)]


def _gn_saved(g):
    x = torch.randn(2, 4, 3, generator=g)
    _, mean, rstd = aten.native_group_norm(x, None, None, 2, 4, 3, 2, 1e-5)
    return [torch.randn(2, 4, 3, generator=g), x, mean, rstd, torch.randn(4, generator=g)]


def _bn_saved(g):
    x = torch.randn(2, 3, 4, 4, generator=g)
    _, mean, invstd = aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    return [torch.randn(2, 3, 4, 4, generator=g), x, torch.rand(3, generator=g) + 0.5,
            torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5, mean, invstd]


def _sdpa_saved(g):
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    return [torch.randn(1, 2, 4, 8, generator=g), q, k, v, out, lse]


def _wn_saved(g):
    v, gain = torch.randn(4, 3, generator=g), torch.rand(4, 1, generator=g) + 0.5
    _, norms = aten._weight_norm_interface(v, gain, 0)
    return [torch.randn(4, 3, generator=g), v, gain, norms]


CONV_ARGS = (T(0), T(1), T(2), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)

# Every multi-result aten op the frontend meets (in the traces of tests/torch, timm- and
# torchvision-style CNNs, transformers, and torch's norms, pools, losses and reductions):
# the forward ops and the backward ops autograd calls, on CPU. Single-result ones (the
# pools' backward, embedding_dense_backward) are not here: nothing to choose from; nor is
# _fused_rms_norm_backward, which has no CPU kernel (RMSNorm's backward decomposes there).
CASES: dict[str, Case] = {
    "convolution_backward": Case(
        "aten.convolution_backward.default",
        _ops(_r(2, 4, 5, 5), _r(2, 3, 5, 5), _r(4, 3, 3, 3)),
        CONV_ARGS[:3] + ([4],) + CONV_ARGS[4:] + ([True, True, True],), mask=10),
    "native_layer_norm": Case("aten.native_layer_norm.default",
                              _ops(_r(2, 3, 4), _r(4), _r(4)), (T(0), [4], T(1), T(2), 1e-5)),
    "native_layer_norm_backward": Case(
        "aten.native_layer_norm_backward.default", _ln_saved,
        (T(0), T(1), [4], T(2), T(3), T(4), T(5), [True, True, True]), mask=7),
    "native_batch_norm": Case("aten.native_batch_norm.default", _bn_stats,
                              (T(0), T(1), T(2), T(3), T(4), True, 0.1, 1e-5)),
    "_native_batch_norm_legit": Case("aten._native_batch_norm_legit.default", _bn_stats,
                                     (T(0), T(1), T(2), T(3), T(4), True, 0.1, 1e-5)),
    "_native_batch_norm_legit.no_stats": Case(
        "aten._native_batch_norm_legit.no_stats", _bn_stats,
        (T(0), T(1), T(2), True, 0.1, 1e-5)),
    "_native_batch_norm_legit_functional": Case(
        "aten._native_batch_norm_legit_functional.default", _bn_stats,
        (T(0), T(1), T(2), T(3), T(4), True, 0.1, 1e-5)),
    "_native_batch_norm_legit_no_training": Case(
        "aten._native_batch_norm_legit_no_training.default", _bn_stats,
        (T(0), T(1), T(2), T(3), T(4), 0.1, 1e-5)),
    "native_batch_norm_backward": Case(
        "aten.native_batch_norm_backward.default", _bn_saved,
        (T(0), T(1), T(2), T(3), T(4), T(5), T(6), True, 1e-5, [True, True, True]), mask=9),
    "native_group_norm": Case("aten.native_group_norm.default", _ops(_r(2, 4, 3), _r(4), _r(4)),
                              (T(0), T(1), T(2), 2, 4, 3, 2, 1e-5)),
    "native_group_norm_backward": Case(
        "aten.native_group_norm_backward.default", _gn_saved,
        (T(0), T(1), T(2), T(3), T(4), 2, 4, 3, 2, [True, True, True]), mask=9),
    "_fused_rms_norm": Case("aten._fused_rms_norm.default", _ops(_r(2, 3, 4), _r(4)),
                            (T(0), [4], T(1), 1e-5)),
    "native_dropout": Case("aten.native_dropout.default", _ops(_r(4, 6)), (T(0), 0.3, True),
                           seeded=True),
    "max_pool2d_with_indices": Case("aten.max_pool2d_with_indices.default",
                                    _ops(_r(2, 3, 6, 6)), (T(0), [3, 3], [2, 2], [1, 1])),
    "max_pool3d_with_indices": Case("aten.max_pool3d_with_indices.default",
                                    _ops(_r(1, 2, 4, 4, 4)), (T(0), [2, 2, 2], [2, 2, 2])),
    "adaptive_max_pool2d": Case("aten.adaptive_max_pool2d.default", _ops(_r(2, 3, 5, 5)),
                                (T(0), [2, 2])),
    "nll_loss_forward": Case("aten.nll_loss_forward.default", _ops(_r(4, 5), _int(5, 4)),
                             (T(0), T(1), None, 1, -100)),
    "nll_loss2d_forward": Case("aten.nll_loss2d_forward.default",
                               _ops(_r(2, 5, 3, 3), _int(5, 2, 3, 3)),
                               (T(0), T(1), None, 1, -100)),
    "_scaled_dot_product_flash_attention_for_cpu": Case(
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        _ops(_r(1, 2, 4, 8), _r(1, 2, 4, 8), _r(1, 2, 4, 8)), (T(0), T(1), T(2), 0.0, True),
        seeded=True),
    "_scaled_dot_product_flash_attention_for_cpu_backward": Case(
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default", _sdpa_saved,
        (T(0), T(1), T(2), T(3), T(4), T(5), 0.0, True)),
    "log_sigmoid_forward": Case("aten.log_sigmoid_forward.default", _ops(_r(3, 4)), (T(0),)),
    "_weight_norm_interface": Case("aten._weight_norm_interface.default",
                                   _ops(_r(4, 3), _pos(4, 1)), (T(0), T(1), 0)),
    "_weight_norm_interface_backward": Case("aten._weight_norm_interface_backward.default",
                                            _wn_saved, (T(0), T(1), T(2), T(3), 0)),
    "_prelu_kernel_backward": Case("aten._prelu_kernel_backward.default",
                                   _ops(_r(2, 3, 4), _r(2, 3, 4), _r(1)), (T(0), T(1), T(2))),
    "_embedding_bag": Case("aten._embedding_bag.default",
                           _ops(_r(10, 4), _int(10, 6), lambda g: torch.tensor([0, 2, 5])),
                           (T(0), T(1), T(2), False, 1)),
    "split": Case("aten.split.Tensor", _ops(_r(7, 3)), (T(0), 3)),
    "split_with_sizes": Case("aten.split_with_sizes.default", _ops(_r(7, 3)),
                             (T(0), [2, 4, 1])),
    "unsafe_split": Case("aten.unsafe_split.Tensor", _ops(_r(3, 7)), (T(0), 3, 1)),
    "unbind": Case("aten.unbind.int", _ops(_r(3, 4)), (T(0),)),
    "topk": Case("aten.topk.default", _ops(_r(3, 6)), (T(0), 2)),
    "sort": Case("aten.sort.default", _ops(_r(3, 6)), (T(0),)),
    "sort.stable": Case("aten.sort.stable", _ops(_r(3, 6)), (T(0),),
                        {"stable": True, "descending": True}),
    "var_mean": Case("aten.var_mean.correction", _ops(_r(3, 6)), (T(0), [1]),
                     {"correction": 0, "keepdim": True}),
    "std_mean": Case("aten.std_mean.correction", _ops(_r(3, 6)), (T(0), [0])),
    "max.dim": Case("aten.max.dim", _ops(_r(3, 6)), (T(0), 1)),
    "min.dim": Case("aten.min.dim", _ops(_r(3, 6)), (T(0), 0, True)),
    "kthvalue": Case("aten.kthvalue.default", _ops(_r(3, 6)), (T(0), 2)),
    "median.dim": Case("aten.median.dim", _ops(_r(3, 6)), (T(0), 1)),
    "mode": Case("aten.mode.default", _ops(_int(3, 3, 6)), (T(0),)),
    "cummax": Case("aten.cummax.default", _ops(_r(3, 6)), (T(0), 1)),
    "cummin": Case("aten.cummin.default", _ops(_r(3, 6)), (T(0), 0)),
    "aminmax": Case("aten.aminmax.default", _ops(_r(3, 6)), (T(0),), {"dim": 1}),
    "_foreach_norm": Case("aten._foreach_norm.Scalar", _ops(_r(3), _r(2, 2), _r(4)),
                          ([T(0), T(1), T(2)], 2)),
    "grid_sampler_2d_backward": Case(
        "aten.grid_sampler_2d_backward.default",
        _ops(_r(2, 1, 3, 3), _r(2, 1, 4, 4), _grid), (T(0), T(1), T(2), 0, 0, False, [True, True]),
        mask=6),
}


def _fill(v: Any, operands: list, as_ir: bool) -> Any:
    """The arguments with their operands: tensors for the eager call, "%k" for the IR."""
    if isinstance(v, T):
        return f"%{v.k}" if as_ir else operands[v.k]
    if isinstance(v, (list, tuple)):
        return type(v)(_fill(x, operands, as_ir) for x in v)
    return v


def _result_count(case: Case) -> int:
    operands = case.operands(torch.Generator().manual_seed(0))
    return len(_call(case, operands, None))


def _call(case: Case, operands: list, subset: tuple[int, ...] | None) -> Any:
    """The eager call; a masked backward is told to compute just ``subset``."""
    args = list(_fill(case.args, [t.clone() for t in operands], False))
    if case.mask is not None and subset is not None:
        args[case.mask] = [i in subset for i in range(len(args[case.mask]))]
    if case.seeded:
        torch.manual_seed(1)
    _, op, overload = case.target.split(".")
    return getattr(getattr(aten, op), overload)(*args, **_fill(case.kwargs, operands, False))


def subset_graph(case: Case, operands: list, subset: tuple[int, ...], expected: list) -> Graph:
    """One opaque op keeping the results at ``subset``, as the importer writes it, through
    the IR's text form."""
    ins = [Input(Value(f"x{k}", TensorType(tuple(t.shape), ir_dtype(t.dtype))),
                 InputRole(InputKind.batch)) for k, t in enumerate(operands)]
    args = _fill(case.args, operands, True)
    if case.mask is not None:
        args = list(args)
        args[case.mask] = tuple(i in subset for i in range(len(args[case.mask])))
    attrs = {"target": case.target, "args": args, "outs": subset,
             **{f"kw_{k}": v for k, v in case.kwargs.items()}}
    results = [Value(f"r{i}", TensorType(tuple(t.shape), ir_dtype(t.dtype)))
               for i, t in zip(subset, expected)]
    op = Op("opaque", tuple(i.name for i in ins), tuple(results), Attrs(attrs))
    outs = [Output(v.name, OutputRole(OutputKind.other)) for v in results]
    graph = Graph("subset", tuple(ins), (op,), tuple(outs))
    return parse(print_graph(graph))


def _subsets(n: int) -> list[tuple[int, ...]]:
    return [s for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]


SUBSETS = [pytest.param(name, s, id=f"{name}-{'.'.join(map(str, s))}")
           for name, case in CASES.items() for s in _subsets(_result_count(case))]


@pytest.mark.parametrize(("name", "subset"), SUBSETS)
def test_every_subset_of_results_runs_as_eager(name, subset):
    case = CASES[name]
    operands = case.operands(torch.Generator().manual_seed(0))
    got_all = _call(case, operands, subset)
    expected = [got_all[i] for i in subset]
    graph = subset_graph(case, operands, subset, expected)
    gm = build_module(graph)
    if case.seeded:
        torch.manual_seed(1)
    got = gm(*[t.clone() for t in operands])
    assert len(got) == len(subset)
    for i, a, b in zip(subset, got, expected):
        assert_same(f"{case.target} result {i}", a, b)


def test_every_case_returns_several_values():
    """The table holds what it says: calls returning a tuple or a list of tensors."""
    for name, case in CASES.items():
        out = _call(case, case.operands(torch.Generator().manual_seed(0)), None)
        assert isinstance(out, (tuple, list)) and len(out) >= 2, name
        assert all(isinstance(t, torch.Tensor) for t in out), name


# ------------------------------------------------------------------ malformed outs

F32_3 = TensorType((3,), ir_dtype(torch.float32))
F32_3x6 = TensorType((3, 6), ir_dtype(torch.float32))


def _one_op_graph(target: str, results: list[TensorType], outs: tuple | None) -> Graph:
    """One opaque call ``target(x, 1)`` on an f32[3, 6] input."""
    attrs: dict[str, Any] = {"target": target, "args": ("%0", 1)}
    if outs is not None:
        attrs["outs"] = outs
    vals = tuple(Value(f"r{i}", t) for i, t in enumerate(results))
    return Graph("bad", (Input(Value("x", F32_3x6), InputRole(InputKind.batch)),),
                 (Op("opaque", ("x",), vals, Attrs(attrs)),),
                 tuple(Output(v.name, OutputRole(OutputKind.other)) for v in vals))


@pytest.mark.parametrize(("target", "n", "outs", "words"), [
    ("aten.max.dim", 1, (0, 1), "has 1 results but its outs attribute lists the positions"),
    ("aten.max.dim", 2, (1, 1), "lists the positions [1, 1]"),
    ("aten.amax.default", 1, (0,), "returns one tensor"),
    ("aten.amax.default", 2, None, "returns one tensor, but the op has 2 results"),
])
def test_outs_that_do_not_fit_the_call_are_refused(target, n, outs, words):
    with pytest.raises(BackendError) as e:
        build_module(_one_op_graph(target, [F32_3] * n, outs))
    assert words in str(e.value), str(e.value)
    assert e.value.hint


def test_without_outs_a_tuple_call_is_indexed_in_order():
    """Hand-written IR may leave outs out: a call returning a tuple is read in order."""
    x = torch.randn(3, 6)
    gm = build_module(_one_op_graph("aten.max.dim", [F32_3], None))
    (values,) = gm(x)
    assert_same("max values", values, x.max(1).values)
