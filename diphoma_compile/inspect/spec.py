"""The small languages of ``diphoma inspect``: input descriptions (``int64[8,128]<50257``,
``x=f32[32,3,32,32]``) and meshes (``dp=64``), and the global-to-local batch split."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import DiphomaError, MeshError
from ..mesh import DATA_AXIS_NAMES, PIPELINE_AXIS_NAMES, TENSOR_AXIS_NAMES, Mesh, data_axis

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
class InputDescription:
    """One model input: its name (or None: taken from the model), dtype, global shape and,
    for integers, the exclusive upper bound of its values (token ids, class labels)."""

    name: str | None
    dtype: str
    shape: tuple[int, ...]
    high: int | None = None

    def local(self, n: int, axis: str) -> InputDescription:
        """This input as one of ``n`` devices sees it: dim 0 divided by ``n``."""
        return InputDescription(self.name, self.dtype, local_shape(self.shape, n, axis,
                                                            self.name or "input"), self.high)

    def __str__(self) -> str:
        shape = ",".join(map(str, self.shape))
        high = f"<{self.high}" if self.high is not None else ""
        return f"{self.name + '=' if self.name else ''}{self.dtype}[{shape}]{high}"


def parse_input(text: str) -> InputDescription:
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
    return InputDescription(m["name"], dtype, tuple(int(d) for d in dims), high)


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


def inspect_axis(mesh: Mesh, axis: str | None) -> str:
    """The axis the batch is split over: ``--axis``, else the one named dp, data or batch.

    Stricter than ``data_axis`` for a mesh of one axis: data parallelism is the only pass
    that partitions, so an axis called tp, say, would otherwise be planned as a data axis
    without a word. Other axes of a mesh of several stay in the plan, reported as idle."""
    if axis is None and len(mesh.names) == 1 and mesh.names[0] in TENSOR_AXIS_NAMES:
        name, size = mesh.axes[0]
        raise MeshError(f"--mesh {name}={size}: tensor parallelism needs a data axis beside "
                        "it (each device of the tp axis gets the same batch)",
                        hint=f"give it a data axis of size 1: --mesh dp=1,{name}={size}")
    if axis is None and len(mesh.names) == 1 and mesh.names[0] in PIPELINE_AXIS_NAMES:
        return mesh.names[0]       # pipeline stages alone: the batch is not split
    if axis is None and len(mesh.names) == 1 and mesh.names[0] not in DATA_AXIS_NAMES:
        name, size = mesh.axes[0]
        raise MeshError(f"--mesh {name}={size}: no pass partitions over axis {name!r} yet "
                        f"(data parallelism runs over an axis named "
                        f"{', '.join(DATA_AXIS_NAMES[:-1])} or {DATA_AXIS_NAMES[-1]})",
                        hint=f"name it dp (--mesh dp={size}), or pass --axis {name} to split "
                             "the batch over it")
    try:
        return data_axis(mesh, axis)
    except MeshError as e:
        hint = e.hint
        if axis is None:
            hint = "pass --axis NAME to say which axis the batch is split over"
        raise MeshError(e.message.replace("the mesh has", "--mesh has"), hint=hint) from None


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
    batch of one rank; jax: the global batch), lines for the report's header, and the
    graph input each ``--input`` becomes (its name in the traced graph -> the description)."""

    framework: str                  # torch or jax
    step: object
    args: tuple
    context: dict[str, str]
    inputs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class InputBinding:
    """How the inputs reach the model: their names, which go in by position and which by
    keyword (a named input the call accepts); the rest only the loss sees."""

    names: tuple[str, ...]
    positional: tuple[str, ...]
    keyword: tuple[str, ...]

    def args(self, batch: dict) -> tuple[list, dict]:
        """The call's positional and keyword arguments from inputs by name."""
        return [batch[k] for k in self.positional], {k: batch[k] for k in self.keyword}


def bind_inputs(specs: list[InputDescription], fn: object, what: str) -> InputBinding:
    """Match the inputs to ``fn``'s parameters: an unnamed input takes the next positional
    parameter (and its name), a named one goes by keyword when ``fn`` accepts it; an
    InspectError when a required parameter is left out or given twice."""
    import inspect
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    P = inspect.Parameter
    pos = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind is P.VAR_POSITIONAL for p in params) or not params
    by_name = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    var_kw = any(p.kind is P.VAR_KEYWORD for p in params)
    sig = f"{what}({', '.join(p.name for p in params)})"
    names: list[str] = []
    positional: list[str] = []
    keyword: list[str] = []
    for i, s in enumerate(specs):
        if s.name is None:
            k = len(positional)
            name = pos[k] if k < len(pos) else f"input{i}"
            if k < len(pos) or var_pos:
                positional.append(name)
        else:
            name = s.name
            if name in by_name or var_kw:
                keyword.append(name)
        if name in names or name in ("model", "opt", "params", "opt_state"):
            raise InspectError(f"two inputs (or an input and the step) are both called {name!r}",
                               hint="name the inputs: --input NAME=DTYPE[...]")
        names.append(name)
    covered = set(keyword) | set(pos[:len(positional)])
    twice = [k for k in keyword if k in pos[:len(positional)]]
    if twice:
        raise InspectError(f"{sig}: {twice[0]} is given by position and by name",
                           hint="name every input, or put the unnamed ones first")
    missing = [p.name for p in params if p.default is P.empty and p.name not in covered
               and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    if missing:
        raise InspectError(f"{sig} needs {', '.join(missing)}, which --input does not "
                           "describe", hint="describe each input with --input, e.g. "
                           "--input 'int64[8,128]<50257' or --input 'x=f32[32,3,32,32]'")
    return InputBinding(tuple(names), tuple(positional), tuple(keyword))


def describe_inputs(specs: list[InputDescription], n: int) -> str:
    """``idx=int64[64,128]<50257 (global batch; 8 per device)``."""
    parts = [str(s) for s in specs]
    per = specs[0].shape[0] // n if specs and specs[0].shape else None
    tail = f" (global batch; {per} per device)" if per is not None and n > 1 else ""
    return ", ".join(parts) + tail
