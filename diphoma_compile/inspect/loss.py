"""The loss ``diphoma inspect`` trains with, chosen from the model's output (framework-neutral:
the output is looked at through its shapes, the frameworks supply the math).

``auto``: the model's own loss when its output carries one (an attribute or key ``loss``, or
a scalar among the tuple it returns); otherwise cross-entropy over the last dimension of the
first floating tensor of the output, against integer labels (an extra batch input), when it
has two or more dimensions; otherwise its mean. ``output``, ``ce`` and ``mean`` force one of
these; anything else is a Python expression of ``out`` and the inputs by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .spec import InspectError

KEYWORDS = ("auto", "output", "ce", "mean")


@dataclass(frozen=True)
class LossChoice:
    """How the step gets its loss from the model's output."""

    kind: str                          # own, ce, mean, expr
    path: tuple[tuple[str, Any], ...]  # steps from the output to the tensor: attr/key/index
    classes: int | None = None         # ce: size of the last dimension
    label_shape: tuple[int, ...] | None = None   # ce: the labels' (local) shape
    expr: str | None = None

    @property
    def where(self) -> str:
        """``output``, ``output[1]``, ``output.loss``, ``output['loss']``."""
        text = "output"
        for how, k in self.path:
            text += f".{k}" if how == "attr" else f"[{k!r}]" if how == "key" else f"[{k}]"
        return text

    def describe(self, labels: str = "labels") -> str:
        """A line for the report."""
        if self.kind == "own":
            return f"the model's own loss ({self.where})"
        if self.kind == "ce":
            return (f"cross-entropy over the last dimension of {self.where} "
                    f"({self.classes} classes) against {labels}")
        if self.kind == "mean":
            return f"mean of {self.where}"
        return f"{self.expr} (--loss)"


def get(out: Any, path: tuple[tuple[str, Any], ...]) -> Any:
    """Follow ``path`` into the model's output."""
    for how, k in path:
        out = getattr(out, k) if how == "attr" else out[k]
    return out


def _own_loss(out: Any, is_float: Callable[[Any], bool]) -> tuple | None:
    """The path to a loss the output carries: .loss, ['loss'], or a scalar in a tuple."""
    if is_float(getattr(out, "loss", None)):
        return (("attr", "loss"),)
    if isinstance(out, Mapping) and is_float(out.get("loss")):
        return (("key", "loss"),)
    if isinstance(out, (tuple, list)):
        for i, x in enumerate(out):
            if is_float(x) and len(x.shape) == 0:
                return (("index", i),)
    if is_float(out) and len(out.shape) == 0:
        return ()
    return None


def _first_tensor(out: Any, is_float: Callable[[Any], bool]) -> tuple | None:
    """The path to the first floating tensor: the output, .logits, or a tuple element."""
    if is_float(out):
        return ()
    if is_float(getattr(out, "logits", None)):
        return (("attr", "logits"),)
    if isinstance(out, Mapping):
        for k, v in out.items():
            if is_float(v):
                return (("key", k),)
    if isinstance(out, (tuple, list)):
        for i, x in enumerate(out):
            if is_float(x):
                return (("index", i),)
    return None


def choose(out: Any, how: str, is_float: Callable[[Any], bool]) -> LossChoice:
    """The loss for an output (of the probe: shapes only) and the ``--loss`` setting."""
    if how not in KEYWORDS:
        return LossChoice("expr", (), expr=how)
    if how in ("auto", "output"):
        own = _own_loss(out, is_float)
        if own is not None:
            return LossChoice("own", own)
        if how == "output":
            raise InspectError(f"the model's output ({_kind(out)}) carries no loss (no .loss, "
                               "no 'loss' entry, no scalar)",
                               hint="give the inputs the model needs to compute its loss "
                                    "(e.g. targets), or use --loss ce|mean|EXPR")
    path = _first_tensor(out, is_float)
    if path is None:
        raise InspectError(f"the model's output ({_kind(out)}) has no floating tensor to take "
                           "a loss of", hint="pass --loss EXPR (a Python expression of out)")
    t = get(out, path)
    if how == "ce" or (how == "auto" and len(t.shape) >= 2):
        if len(t.shape) < 2:
            raise InspectError(f"--loss ce needs an output of at least 2 dimensions (batch, "
                               f"classes); {LossChoice('ce', path).where} has shape "
                               f"{tuple(t.shape)}")
        return LossChoice("ce", path, int(t.shape[-1]), tuple(t.shape[:-1]))
    return LossChoice("mean", path)


def _kind(out: Any) -> str:
    shape = getattr(out, "shape", None)
    if shape is not None:
        return f"a tensor of shape {tuple(shape)}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}: " + ", ".join(_kind(x) for x in out)
    return "None" if out is None else f"a {type(out).__name__}"


def expr_loss(expr: str, scope: dict[str, Any]) -> Callable[[Any, dict[str, Any]], Any]:
    """A loss function from a ``--loss`` expression of ``out`` and the inputs by name."""
    try:
        code = compile(expr, "<inspect --loss>", "eval")
    except SyntaxError as e:
        raise InspectError(f"--loss {expr!r} does not parse: {e.msg}",
                           hint="one of auto, output, ce, mean, or a Python expression of "
                                "out and the inputs, e.g. --loss 'out.logits.mean()'") from None

    def loss(out: Any, inputs: dict[str, Any]) -> Any:
        try:
            return eval(code, {**scope, **inputs, "out": out})  # noqa: S307 - the user's own
        except NameError as e:
            raise InspectError(f"--loss {expr!r}: {e}",
                               hint="the expression reads out (the model's output), the "
                                    "inputs by name (" + ", ".join(inputs) + ") and the "
                                    "file's own names") from None
    return loss
