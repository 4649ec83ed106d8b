"""What ``diphoma inspect`` plans for a PyTorch file: the model built on the meta device (no
memory for its parameters), meta inputs at one rank's share of the global batch, a loss
chosen from the model's output, an optimizer, and the training step that ties them up. Or
the file's own step with its example inputs."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ..errors import DiphomaError
from ..inspect.load import (Candidate, construct, evaluate, example_args,
                            inputs_fn_error)
from ..inspect.loss import LossChoice, choose, expr_loss, get
from ..inspect.optimizer import choose_optimizer
from ..inspect.spec import (InputBinding, InputDescription, InspectError, Target, bind_inputs,
                            describe_inputs, local_shape)

# the multi-tensor (foreach) kernels: what these optimizers run by default on GPUs, and a
# shorter trace than the per-tensor loop; the math and the plan are the same
OPTIMIZERS: dict[str, tuple[str, Callable]] = {
    "adamw": ("AdamW(lr=0.001)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
    "adam": ("Adam(lr=0.001)", lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)),
    "sgd": ("SGD(lr=0.01)", lambda ps: torch.optim.SGD(ps, lr=1e-2, foreach=True)),
    "momentum": ("SGD(lr=0.01, momentum=0.9)",
                 lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True)),
}


def on_meta(make: Callable[[], Any], what: str) -> tuple[Any, bool]:
    """``make()`` under ``torch.device("meta")``: parameters without memory. A constructor
    that cannot run there (it reads values back, say) is run again for real, with a note;
    its own error is shown when that fails too."""
    try:
        with torch.device("meta"):
            return make(), True
    except Exception as meta_error:
        out = make()
        print(f"note: {what} does not build on the meta device ({type(meta_error).__name__}: "
              f"{str(meta_error).splitlines()[0] if str(meta_error) else ''}); it was built "
              "with real memory", file=sys.stderr)
        return out, False


def _meta(spec: InputDescription) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device="meta")


def _fake(fake: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:    # as the tracer does: a meta tensor stands for a CPU one
        with fake:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return fake.from_tensor(t)


def probe(model: torch.nn.Module, xs: list[torch.Tensor], kw: dict[str, torch.Tensor]) -> Any:
    """The model's output for these inputs, computed on meta tensors when the model and the
    inputs are all on the meta device and its forward runs there, else on fake tensors
    (shapes only); a FrontendError naming the construct when the forward cannot run that
    way."""
    from .trace import explain, quiet_shape_rules
    state = [*model.named_parameters(), *model.named_buffers()]
    if all(t.is_meta for t in [*(t for _, t in state), *xs, *kw.values()]):
        # meta kernels are called straight from C++, with no Python dispatch in between:
        # several times faster than fake tensors. A forward that makes CPU tensors of its
        # own (torch.arange(t)) or reads a value fails here and is run on fake tensors,
        # where a meta tensor stands for a CPU one. Buffers it rebinds are put back.
        try:
            with _reparametrize_module(model, dict(state), tie_weights=True), \
                    torch.no_grad():
                return model(*xs, **kw)
        except Exception:
            pass
    fake = FakeTensorMode()
    tensors = {n: _fake(fake, t.detach()) for n, t in state}
    try:
        with _reparametrize_module(model, tensors, tie_weights=True), fake, torch.no_grad(), \
                quiet_shape_rules():
            return model(*[_fake(fake, x) for x in xs],
                         **{k: _fake(fake, x) for k, x in kw.items()})
    except DiphomaError:
        raise
    except Exception as e:
        raise explain(e) from e


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _loss_fn(choice: LossChoice, module: ModuleType) -> Callable:
    if choice.kind == "expr":
        return expr_loss(choice.expr or "", {**vars(module), "torch": torch, "F": F})
    if choice.kind == "ce":
        def ce(out: Any, inputs: dict[str, Any]) -> torch.Tensor:
            t = get(out, choice.path)
            return F.cross_entropy(t.reshape(-1, t.shape[-1]), inputs["labels"].reshape(-1))
        return ce
    if choice.kind == "mean":
        return lambda out, inputs: get(out, choice.path).float().mean()
    return lambda out, inputs: get(out, choice.path)


def make_step(call: InputBinding, names: list[str], loss_fn: Callable) -> Callable:
    """``train_step(model, opt, *inputs)``: forward as ``call`` says, the loss, backward,
    the optimizer step, zero_grad; its signature names the inputs (the IR names batch
    inputs after them)."""
    def train_step(model, opt, *batch):
        inputs = dict(zip(names, batch))
        args, kwargs = call.args(inputs)
        out = model(*args, **kwargs)
        loss = loss_fn(out, inputs)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InspectError(f"the loss is {shape}, not a scalar tensor",
                               hint="reduce it (e.g. .mean()) in --loss")
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    P = inspect.Parameter
    train_step.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [P(n, P.POSITIONAL_ONLY) for n in ("model", "opt", *names)])
    return train_step


def _optimizer(how: str, model: torch.nn.Module, module: ModuleType) -> tuple[Any, str]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise InspectError("the model has no trainable parameters")
    return choose_optimizer(how, OPTIMIZERS, (params,), module,
                            {"params": params, "model": model, "torch": torch},
                            torch.optim.Optimizer, "a torch.optim.Optimizer",
                            "of params, e.g. 'torch.optim.SGD(params, lr=0.1)'")


def model_target(cand: Candidate | None, module: ModuleType, label: str, init: str | None,
                 specs: list[InputDescription], loss: str, optimizer: str, n: int,
                 axis: str) -> Target:
    """The training step of a model class (or factory, or ``--init`` expression)."""
    if init is not None:
        model, meta = on_meta(lambda: evaluate(init, module, "--init"), label)
    else:
        assert cand is not None
        model, meta = on_meta(lambda: construct(cand, module), label)
    if not isinstance(model, torch.nn.Module):
        raise InspectError(f"{init or cand.name + '()'} gave a {type(model).__name__}, "
                           "not an nn.Module")
    label += "" if not label.endswith(":") else type(model).__name__
    call = bind_inputs(specs, model.forward, f"{type(model).__name__}.forward")
    names = list(call.names)
    given = {nm: str(s) for nm, s in zip(names, specs)}
    specs = [InputDescription(nm, s.dtype, s.shape, s.high) for nm, s in zip(names, specs)]
    xs = [_meta(s.local(n, axis)) for s in specs]
    args, kwargs = call.args(dict(zip(names, xs)))
    choice = choose(probe(model, args, kwargs), loss, _is_float)
    if choice.kind == "ce":
        if "labels" in names:
            raise InspectError("an input is called 'labels', which cross-entropy's labels "
                               "are called too", hint="rename the input or pass --loss")
        lab = InputDescription("labels", "int64", (choice.label_shape[0] * n,
                                            *choice.label_shape[1:]), choice.classes)
        specs, names = [*specs, lab], [*names, "labels"]
        xs.append(_meta(lab.local(n, axis)))
    opt, opt_text = _optimizer(optimizer, model, module)
    step = make_step(call, names, _loss_fn(choice, module))
    context = {
        "model": f"{label} (torch{', built on the meta device' if meta else ''})",
        "inputs": describe_inputs(specs, n),
        "loss": choice.describe(),
        "optimizer": opt_text,
    }
    if init is not None:
        context["init"] = init
    return Target("torch", step, (model, opt, *xs), context, given)


def step_target(cand: Candidate, label: str, n: int, axis: str) -> Target:
    """The file's own step with the arguments its example-inputs function makes (on the
    meta device); batch tensors are the global batch, and each rank traces its share."""
    assert cand.inputs_fn is not None
    try:
        args, meta = on_meta(cand.inputs_fn, f"{cand.inputs_fn.__name__}()")
    except Exception as e:       # its own error, from its own line (not a traceback)
        raise inputs_fn_error(e, cand.inputs_fn) from e
    args = example_args(args, cand.inputs_fn)
    state = (torch.nn.Module, torch.optim.Optimizer)
    leaves, spec = pytree.tree_flatten_with_path(args, is_leaf=lambda x: isinstance(x, state))
    try:
        arg_names = list(inspect.signature(cand.obj).parameters)
    except (TypeError, ValueError):
        arg_names = []
    out, shapes = [], []
    for path, x in leaves:
        if isinstance(x, torch.Tensor):
            i = getattr(path[0], "idx", -1) if path else -1
            head = arg_names[i] if 0 <= i < len(arg_names) else f"arg{i}"
            rest = pytree.keystr(path[1:]).replace("['", ".").replace("']", "")
            what = head + rest
            shapes.append(f"{what}={str(x.dtype).removeprefix('torch.')}{list(x.shape)}")
            x = x[: local_shape(tuple(x.shape), n, axis, what)[0]]
        out.append(x)
    context = {"model": f"{label} (torch step{', built on the meta device' if meta else ''})",
               "inputs": ", ".join(shapes) + (" (global batch)" if n > 1 else "")}
    return Target("torch", cand.obj, tuple(pytree.tree_unflatten(out, spec)), context)
