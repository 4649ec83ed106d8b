"""The PyTorch frontend's entry point: a training step in, an IR graph out.

Failures inside tracing (data-dependent Python control flow, ops fake tensors cannot run)
become FrontendErrors that name the construct and the line of the user's code."""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import DiphomaError, FrontendError, user_line
from ..ir.analysis import graph_cost
from ..ir.core import Graph
from ..ir.verify import verify
from .capture import capture
from .codegen import check_codegen, default_codegen
from .effects import INTERNAL_PATHS
from .importer import import_captured
from .state import Captured

log = logging.getLogger("diphoma_compile")


def explain(exc: Exception) -> FrontendError:
    """A FrontendError for an exception raised while tracing, naming the user's line."""
    where = user_line(exc, INTERNAL_PATHS)
    at = f" at {where}" if where else ""
    name = type(exc).__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    data_dependent = ("DataDependent" in name or "GuardOnDataDependent" in name
                      or "data-dependent" in text.lower() or "data dependent" in text.lower())
    if data_dependent:
        return FrontendError(
            f"the step branches or reads a value that depends on tensor data{at} ({text})",
            hint=_torch_reader_hint(exc) or
            "Python control flow on tensor values cannot be traced: use torch.where, "
            "or move the decision out of the step")
    if "convert all Tensors to FakeTensors" in text:
        return FrontendError(
            f"the step uses a tensor that is neither an argument of the step nor a parameter, "
            f"buffer or optimizer state of the modules and optimizers it uses (a tensor from "
            f"its closure or globals){at}",
            hint="pass the tensor to the step as an argument, or keep it in a module passed "
                 "to the step (a parameter or register_buffer; EMA weights in "
                 "copy.deepcopy(model)), whose tensors are traced state")
    if "DynamicOutputShape" in name:
        return FrontendError(f"an op's output shape depends on tensor data{at} ({text})",
                             hint="an op whose result's size follows its inputs' values "
                                  "(nonzero, unique, masked_select; ctc_loss sizes its work "
                                  "by the largest target length) cannot be traced with "
                                  "static shapes: compute it outside the step, or with ops "
                                  "whose sizes follow their inputs' shapes")
    if "UnsupportedOperator" in name or "no fake impl" in text.lower():
        return FrontendError(f"op {text} has no mapping: it cannot run on fake tensors{at}",
                             hint="register a fake (meta) implementation for custom ops "
                                  "(torch.library.register_fake)")
    op = _failing_op(exc)
    if op is not None and "_linalg_check_errors" in op:
        return FrontendError(
            f"the step calls a torch.linalg function that checks its result on the host{at} "
            "(aten._linalg_check_errors raises for a matrix that is singular or not "
            "positive-definite), which a traced program cannot do",
            hint="use its _ex form, which returns the error code as a tensor instead of "
                 "raising: torch.linalg.cholesky_ex, inv_ex, solve_ex, ldl_factor_ex, "
                 "lu_factor_ex (take [0], the result; check info outside the step if you "
                 "need to)")
    if op is not None:
        return FrontendError(
            f"tracing the step failed{at}, in {op}: {name}: {text}",
            hint=f"{op}'s shape and dtype rules (its fake kernel, which tracing runs) refused "
                 "these inputs: check the shapes and dtypes the step is given (inspect: "
                 "--input); if the eager step runs, its kernel for this device is less "
                 "strict: use another implementation of the layer that calls it (Hugging "
                 "Face mixture-of-experts: experts_implementation=\"batched_mm\"), or cast "
                 "its inputs as the message asks; the chained exception has the traceback")
    return FrontendError(f"tracing the step failed{at}: {name}: {text}",
                         hint="see the chained exception for the full traceback")


# torch's own code that reads a tensor's value on the host, by file: what to do instead
_READERS = {
    "batchnorm.py": "a BatchNorm with momentum=None (a cumulative average) divides by "
                    "num_batches_tracked read as a Python number: give it a momentum "
                    "(0.1, the default)",
    "clip_grad.py": "clip_grad_norm_(error_if_nonfinite=True) reads the norm on the host to "
                    "raise: leave it out and check the norm it returns outside the step",
    "swa_utils.py": "torch.optim.swa_utils.AveragedModel.update_parameters() branches on its "
                    "n_averaged count (its first call copies the weights): keep the average "
                    "in a copy.deepcopy(model) passed to the step and update it there, "
                    "with torch.no_grad(): for e, p in zip(ema.parameters(), "
                    "model.parameters()): e.lerp_(p, 1 - decay); or call update_parameters "
                    "outside the step",
}


def _torch_reader_hint(exc: BaseException) -> str | None:
    """What to do where torch's own code read a tensor's value: an optimizer whose step()
    branches on a value of its state (RAdam and ASGD, which branch on their step count,
    are traced in their capturable form instead: ``capture.counts_on_host``), a
    BatchNorm's cumulative average, a clip that raises on a non-finite norm."""
    for fs in reversed(traceback.extract_tb(exc.__traceback__)):
        path = fs.filename.replace(os.sep, "/")
        if "/torch/" in path and os.path.basename(path) in _READERS:
            return _READERS[os.path.basename(path)]
        if "/torch/optim/" in path and not path.endswith("/optimizer.py"):
            name = os.path.basename(path)[:-3]
            return (f"torch.optim's {name} step() branches on a value of its state (its "
                    "step count) unless capturable: its update cannot be traced as one "
                    "program; SGD, Adam, AdamW, Adadelta, Adagrad, Adamax, NAdam, RAdam, "
                    "ASGD, RMSprop and Rprop can (once they have state)")
    return None


def _failing_op(exc: BaseException) -> str | None:
    """The aten op being dispatched where ``exc`` was raised (innermost), if any."""
    from torch._ops import OpOverload
    found = None
    tb = exc.__traceback__
    while tb is not None:
        func = tb.tb_frame.f_locals.get("func")
        if isinstance(func, OpOverload):
            found = str(func)
        tb = tb.tb_next
    return found


def trace_torch(step_fn: Callable, *example_args: Any, codegen: str | None = None
                ) -> tuple[Graph, Captured]:
    """Trace a PyTorch training step; return its IR graph and the capture a runtime binds.
    ``codegen`` names the code generator the program is for (None: fx; "auto": the
    default for the step's size and device, ``codegen.default_codegen``): Inductor's is
    traced with the optimizers' tensor math."""
    check_codegen(codegen)
    graph, cap = _trace(step_fn, example_args, codegen if codegen not in (None, "auto")
                        else "fx")
    if codegen == "auto":
        # the default depends on the step's size: traced again, for Inductor, when it
        # is big enough (tracing takes seconds where compiling takes a minute)
        chosen = default_codegen(cap.device, graph_cost(graph)[0].flops)
        if chosen != "fx":
            try:
                graph, cap = _trace(step_fn, example_args, chosen)
            except DiphomaError as e:
                # a step Inductor's trace cannot take runs on the reference program
                log.info("diphoma_compile: the step stays on the fx code generator: %s", e)
    return graph, cap


class _ShapeRuleTraceback(logging.Filter):
    """Drops FakeTensor's log of an op's shape rules refusing its inputs (a traceback of
    some twenty lines on stderr): the error the trace raises names the op and the user's
    line (``explain``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "failed while attempting to run meta for %s"


@contextlib.contextmanager
def quiet_shape_rules() -> Iterator[None]:
    """While tracing: no FakeTensor traceback on stderr for an op refusing its inputs."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = _ShapeRuleTraceback()
    fake_log.addFilter(quiet)
    try:
        yield
    finally:
        fake_log.removeFilter(quiet)


def _trace(step_fn: Callable, example_args: tuple, codegen: str) -> tuple[Graph, Captured]:
    try:
        with quiet_shape_rules():
            cap = capture(step_fn, *example_args, codegen=codegen)
    except DiphomaError as e:
        raise _for_inductor(e, codegen) from e
    except Exception as e:  # torch raises many types while tracing; name the user's line
        raise _for_inductor(explain(e), codegen) from e
    graph = import_captured(cap)
    return verify(graph), cap


def _for_inductor(err: DiphomaError, codegen: str) -> DiphomaError:
    """``err``, saying so when the trace for Inductor failed where the fx one may not: its
    optimizer hyperparameters are tensors, which the optimizer's code may branch on (SGD's
    ``momentum != 0`` under a OneCycleLR that cycles momentum)."""
    if codegen != "inductor":
        return err
    return FrontendError(f"tracing the step for codegen='inductor' failed (its optimizer "
                         f"hyperparameters are traced as tensors): {err}",
                         hint="run it with codegen='fx'")


def is_torch_step(args: tuple) -> bool:
    """True when the example arguments hold torch modules, optimizers or tensors."""
    def torchy(x: Any) -> bool:
        return isinstance(x, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor))
    leaves = torch.utils._pytree.tree_leaves(args, is_leaf=lambda x: isinstance(
        x, (torch.nn.Module, torch.optim.Optimizer)))
    return any(torchy(x) for x in leaves)


def first_tensor(args: tuple) -> torch.Tensor | None:
    """The first tensor among the arguments: a module's first parameter or buffer, an
    optimizer's first parameter, or a tensor."""
    leaves = torch.utils._pytree.tree_leaves(args, is_leaf=lambda x: isinstance(
        x, (torch.nn.Module, torch.optim.Optimizer)))
    for x in leaves:
        if isinstance(x, torch.nn.Module):
            x = next(iter(x.parameters()), next(iter(x.buffers()), None))
        elif isinstance(x, torch.optim.Optimizer):
            x = next((p for g in x.param_groups for p in g["params"]), None)
        if isinstance(x, torch.Tensor):
            return x
    return None


def microbatch_args(args: tuple, microbatches: int) -> tuple:
    """``args`` with every tensor cut to its first 1/M rows (one microbatch, to trace);
    MeshError when a tensor's rows do not divide into M, when it has none (a 0-d tensor),
    or when its rows are not a whole multiple of the batch's (``batch_rows.py``): every
    tensor argument is cut along dim 0, so one that is not rows per example (a per-class
    weight) would be cut with the batch, and each microbatch computed with a slice of it,
    without a word where it broadcasts."""
    from torch.utils import _pytree as pytree

    from ..batch_rows import check_batch_rows
    from ..errors import MeshError

    leaves, spec = pytree.tree_flatten_with_path(list(args))

    def batch(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)
    tensors = [(f"argument {pytree.keystr(path[:1]).strip('[]')}" +
                pytree.keystr(path[1:]), x) for path, x in leaves if batch(x)]
    for name, x in tensors:
        if x.dim() == 0:
            raise MeshError(f"step {name} is a 0-d tensor; under a pipeline every tensor "
                            f"argument is the batch, cut into {microbatches} microbatches "
                            "along its first dimension",
                            hint="pass it as a Python number, or keep it in the model (a "
                                 "buffer) or the optimizer")
    check_batch_rows([(name, x.shape[0]) for name, x in tensors],
                     f"{microbatches} microbatches (under a pipeline every tensor argument is "
                     "the batch)", "keep such a tensor in the model (register_buffer) or make "
                     "it inside the step", noun="step")

    def cut(x: Any) -> Any:
        if not batch(x):
            return x
        rows = x.shape[0]
        if rows == 0 or rows % microbatches:
            raise MeshError(f"a batch tensor of shape {tuple(x.shape)} cannot be cut into "
                            f"{microbatches} equal microbatches along its first dimension",
                            hint=f"pass a local batch whose rows divide by {microbatches}, "
                                 "or choose microbatches= that divides them")
        return x[: rows // microbatches]
    return tuple(pytree.tree_unflatten([cut(x) for _, x in leaves], spec))


def repeated_args(args: tuple, times: int) -> tuple:
    """``args`` with every tensor's rows repeated ``times`` times (a share of one row as
    that many copies of it): the step traced so, the batch analysis tells its rows
    apart."""
    from torch.utils import _pytree as pytree

    def repeat(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, torch.nn.Parameter) or \
                x.dim() == 0:
            return x
        return torch.cat([x] * times)
    return tuple(pytree.tree_map(repeat, list(args)))
