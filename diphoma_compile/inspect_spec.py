"""The small languages of ``diphoma inspect``: input descriptions (``int64[8,128]<50257``,
``x=f32[32,3,32,32]``) and meshes (``dp=64``), and the global-to-local batch split."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import DiphomaError, MeshError
from .mesh import Mesh

# accepted spellings -> canonical numpy-style name (torch and jax both know these)
DTYPES = {
    "f64": "float64", "float64": "float64", "double": "float64",
    "f32": "float32", "float32": "float32", "float": "float32",
    "f16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "i64": "int64", "int64": "int64", "long": "int64",
    "i32": "int32", "int32": "int32", "int": "int32",
    "i16": "int16", "int16": "int16",
    "i8": "int8", "int8": "int8",
    "u8": "uint8", "uint8": "uint8",
    "bool": "bool",
}
_SPEC = re.compile(r"""\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*=\s*)?
                       (?P<dtype>[A-Za-z0-9_]+)\s*
                       \[(?P<dims>[^\]]*)\]\s*
                       (?:<\s*(?P<high>\d+)\s*)?\Z""", re.X)


class InspectError(DiphomaError):
    """Bad use of ``diphoma inspect``: a file, name, expression or description it cannot use."""


@dataclass(frozen=True)
class InputSpec:
    """One model input: its name (or None: taken from the model), dtype, global shape and,
    for integers, the exclusive upper bound of its values (token ids, class labels)."""

    name: str | None
    dtype: str
    shape: tuple[int, ...]
    high: int | None = None

    def local(self, n: int, axis: str) -> InputSpec:
        """This input as one of ``n`` devices sees it: dim 0 divided by ``n``."""
        return InputSpec(self.name, self.dtype, local_shape(self.shape, n, axis,
                                                            self.name or "input"), self.high)

    def __str__(self) -> str:
        shape = ",".join(map(str, self.shape))
        high = f"<{self.high}" if self.high is not None else ""
        return f"{self.name + '=' if self.name else ''}{self.dtype}[{shape}]{high}"


def parse_input(text: str) -> InputSpec:
    """``[name=]dtype[d0,d1,...][<high]``; InspectError saying what is wrong otherwise."""
    form = "write it as DTYPE[D0,D1,...], e.g. 'int64[8,128]<50257' or 'x=f32[32,3,32,32]'"
    m = _SPEC.match(text)
    if m is None:
        raise InspectError(f"--input {text!r} does not parse", hint=form)
    dtype = DTYPES.get(m["dtype"].lower())
    if dtype is None:
        raise InspectError(f"--input {text!r}: unknown dtype {m['dtype']!r}",
                           hint="one of " + ", ".join(sorted(set(DTYPES))))
    dims = [d.strip() for d in m["dims"].split(",")] if m["dims"].strip() else []
    if not all(re.fullmatch(r"\d+", d) for d in dims):
        raise InspectError(f"--input {text!r}: the shape [{m['dims']}] is not a list of "
                           "non-negative integers", hint=form)
    high = int(m["high"]) if m["high"] else None
    if high is not None and not (dtype.startswith(("int", "uint"))):
        raise InspectError(f"--input {text!r}: '<{high}' bounds integer inputs only "
                           f"(this one is {dtype})")
    if high is not None and high < 1:
        raise InspectError(f"--input {text!r}: the bound must be at least 1")
    return InputSpec(m["name"], dtype, tuple(int(d) for d in dims), high)


def parse_mesh(text: str) -> Mesh:
    """``dp=64`` or ``dp=8,tp=2`` -> Mesh; MeshError otherwise."""
    axes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, size = part.partition("=")
        if not eq or not size.strip().isdigit():
            raise MeshError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE",
                            hint="for example --mesh dp=64")
        axes.append((name.strip(), int(size)))
    if not axes:
        raise MeshError(f"--mesh {text!r} names no axis", hint="for example --mesh dp=64")
    return Mesh(tuple(axes))


def local_shape(shape: tuple[int, ...], n: int, axis: str, what: str) -> tuple[int, ...]:
    """``shape`` with dim 0 divided among ``n`` devices; InspectError when it does not
    divide (the global batch must split evenly)."""
    if not shape:
        raise InspectError(f"{what} is a scalar, but the batch is split along its first "
                           f"dimension over axis {axis!r}")
    if shape[0] % n:
        raise InspectError(f"{what} has a global batch of {shape[0]}, which does not divide "
                           f"among the {n} devices of axis {axis!r}",
                           hint=f"describe a global batch that is a multiple of {n}")
    return (shape[0] // n, *shape[1:])


@dataclass
class Target:
    """What inspect hands to the planner: a step, its example arguments (torch: the local
    batch of one rank; jax: the global batch) and lines for the report's header."""

    framework: str                  # torch or jax
    step: object
    args: tuple
    context: dict[str, str]


def unique_names(specs: list[InputSpec], defaults: list[str]) -> list[str]:
    """A distinct identifier per input: its own name, else the model's parameter name at
    that position, else ``input<i>``."""
    names: list[str] = []
    for i, s in enumerate(specs):
        n = s.name or (defaults[i] if i < len(defaults) else f"input{i}")
        if n in names or n in ("model", "opt", "params", "opt_state"):
            raise InspectError(f"two inputs (or an input and the step) are both called {n!r}",
                               hint="name the inputs: --input NAME=DTYPE[...]")
        names.append(n)
    return names


def describe_inputs(specs: list[InputSpec], n: int) -> str:
    """``idx=int64[64,128]<50257 (global batch; 8 per device)``."""
    parts = [str(s) for s in specs]
    per = specs[0].shape[0] // n if specs and specs[0].shape else None
    tail = f" (global batch; {per} per device)" if per is not None and n > 1 else ""
    return ", ".join(parts) + tail
