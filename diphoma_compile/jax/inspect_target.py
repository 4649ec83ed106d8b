"""What ``diphoma inspect`` plans for a JAX file: a flax.linen module's parameters and the
optax state as shapes only (``jax.eval_shape``: nothing is allocated), the global batch as
``ShapeDtypeStruct``s, a loss chosen from the module's output, and the step
``step(params, opt_state, batch)`` that the JAX frontend traces at each device's share.
Or the file's own step with its example inputs, also evaluated as shapes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ..inspect.load import (Candidate, construct, evaluate, example_args,
                            inputs_fn_error, user_error)
from ..inspect.optimizer import choose_optimizer
from ..inspect.loss import LossChoice, choose, expr_loss, get
from ..inspect.spec import InputDescription, InspectError, Target, describe_inputs, local_shape, \
    bind_inputs

OPTIMIZERS: dict[str, tuple[str, Callable[[], Any]]] = {
    "adamw": ("optax.adamw(1e-3)", lambda: optax.adamw(1e-3)),
    "adam": ("optax.adam(1e-3)", lambda: optax.adam(1e-3)),
    "sgd": ("optax.sgd(1e-2)", lambda: optax.sgd(1e-2)),
    "momentum": ("optax.sgd(1e-2, momentum=0.9)", lambda: optax.sgd(1e-2, momentum=0.9)),
}


def _struct(spec: InputDescription) -> jax.ShapeDtypeStruct:
    # without jax_enable_x64 an int64 input is an int32 one, as jnp.asarray would make it
    return jax.ShapeDtypeStruct(spec.shape, jax.dtypes.canonicalize_dtype(spec.dtype))


def _is_float(x: Any) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and hasattr(x, "shape") and jnp.issubdtype(dt, jnp.floating)


def _loss_fn(choice: LossChoice, module: ModuleType) -> Callable:
    if choice.kind == "expr":
        return expr_loss(choice.expr or "", {**vars(module), "jax": jax, "jnp": jnp,
                                            "optax": optax})
    if choice.kind == "ce":
        def ce(out: Any, batch: dict[str, Any]) -> Any:
            return optax.softmax_cross_entropy_with_integer_labels(
                get(out, choice.path), batch["labels"]).mean()
        return ce
    if choice.kind == "mean":
        return lambda out, batch: jnp.mean(get(out, choice.path))
    return lambda out, batch: get(out, choice.path)


def _shapes(fn: Callable, args: list, module: ModuleType, what: str) -> Any:
    """``jax.eval_shape(fn, *args)``; the user's error, with its line, when it raises."""
    try:
        return jax.eval_shape(fn, *args)
    except Exception as e:
        raise user_error(e, Path(module.__file__ or "").resolve(), what) from e


def _optimizer(how: str, module: ModuleType) -> tuple[Any, str]:
    return choose_optimizer(how, OPTIMIZERS, (), module, {"optax": optax},
                            optax.GradientTransformation, "an optax GradientTransformation",
                            "such as 'optax.sgd(0.1)'")


def model_target(cand: Candidate | None, module: ModuleType, label: str, init: str | None,
                 specs: list[InputDescription], loss: str, optimizer: str, n: int,
                 axis: str) -> Target:
    """The training step of a flax.linen module (a class, a factory or ``--init``)."""
    import flax.linen as linen
    model = evaluate(init, module, "--init") if init is not None else construct(cand, module)
    if not isinstance(model, linen.Module):
        raise InspectError(f"{init or cand.name + '()'} gave a {type(model).__name__}, not a "
                           "flax.linen Module",
                           hint="flax.nnx modules: write a step and example_inputs() in the "
                                "file and name the step")
    label += "" if not label.endswith(":") else type(model).__name__
    call = bind_inputs(specs, model.__call__, type(model).__name__)
    names = list(call.names)
    given = {f"batch/{nm}": str(s) for nm, s in zip(names, specs)}
    specs = [InputDescription(nm, s.dtype, s.shape, s.high) for nm, s in zip(names, specs)]
    glob = [_struct(s) for s in specs]
    local = dict(zip(names, (_struct(s.local(n, axis)) for s in specs)))

    def init_vars(xs: dict) -> Any:
        args, kwargs = call.args(xs)
        return model.init(jax.random.key(0), *args, **kwargs)
    variables = _shapes(init_vars, [local], module, f"{type(model).__name__}.init")
    params = variables.get("params", {})
    others = sorted(k for k in variables if k != "params")
    if others:
        raise InspectError(f"{type(model).__name__} keeps state besides its parameters "
                           f"({', '.join(others)}), which inspect's step does not update",
                           hint="write a step that returns it in opt_state, with "
                                "example_inputs(), and name the step")

    def apply(p: Any, xs: dict) -> Any:
        args, kwargs = call.args(xs)
        return model.apply({"params": p}, *args, **kwargs)
    out = _shapes(apply, [params, local], module, f"{type(model).__name__}.apply")
    choice = choose(out, loss, _is_float)
    if choice.kind == "ce":
        if "labels" in names:
            raise InspectError("an input is called 'labels', which cross-entropy's labels "
                               "are called too", hint="rename the input or pass --loss")
        lab = InputDescription("labels", "int32", (choice.label_shape[0] * n,
                                            *choice.label_shape[1:]), choice.classes)
        specs, names, glob = [*specs, lab], [*names, "labels"], [*glob, _struct(lab)]
    tx, opt_text = _optimizer(optimizer, module)
    loss_fn = _loss_fn(choice, module)

    def train_step(params, opt_state, batch):
        def loss_of(p):
            return loss_fn(apply(p, batch), batch)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    opt_state = jax.eval_shape(tx.init, params)
    context = {"model": f"{label} (flax.linen, shapes from jax.eval_shape)",
               "inputs": describe_inputs(specs, n), "loss": choice.describe(),
               "optimizer": opt_text}
    if init is not None:
        context["init"] = init
    return Target("jax", train_step, (params, opt_state, dict(zip(names, glob))), context,
                  given)


def step_target(cand: Candidate, label: str, n: int, axis: str) -> Target:
    """The file's own ``step(params, opt_state, batch, ...)`` with the arguments its
    example-inputs function makes, as shapes (``jax.eval_shape``) where it can."""
    assert cand.inputs_fn is not None
    try:
        args = jax.eval_shape(cand.inputs_fn)
    except Exception:    # non-array leaves (a function, a config): call it for real
        try:
            args = cand.inputs_fn()
        except Exception as e:      # its own error, from its own line (not a traceback)
            raise inputs_fn_error(e, cand.inputs_fn) from e
    args = example_args(args, cand.inputs_fn)
    shapes = []
    if len(args) > 2:
        for path, x in jax.tree_util.tree_flatten_with_path(args[2])[0]:
            key = "/".join(["batch", jax.tree_util.keystr(path, simple=True, separator="/")]
                           ).rstrip("/")
            local_shape(tuple(getattr(x, "shape", ())), n, axis, key)
            shapes.append(f"{key}={x.dtype}{list(x.shape)}")
    context = {"model": f"{label} (jax step)",
               "inputs": ", ".join(shapes) + (" (global batch)" if n > 1 else "")}
    return Target("jax", cand.obj, args, context)
