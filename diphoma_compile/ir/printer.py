"""The canonical text form of a graph: deterministic, and read back by parser.parse."""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING

from .roles import InputKind, OutputKind

if TYPE_CHECKING:   # the IR's classes, for annotations only: core imports this module
    from .core import AttrValue, Graph, Input, Op, Output, Region, Value
    from .types import TensorType

FORMAT_LINE = "# diphoma-ir v1"
BARE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]*\Z")
BARE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
KEYWORDS = frozenset({"true", "false", "none", "inf", "nan"})


def format_name(name: str, sigil: str = "%") -> str:
    """``%name``, quoted as ``%"..."`` when the name has characters a bare name cannot."""
    return sigil + (name if BARE_NAME.match(name) else json.dumps(name))


def format_attr(v: AttrValue) -> str:
    """An attribute value as text: none, true/false, ints, floats by repr, strings, lists."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return v if BARE_WORD.match(v) and v not in KEYWORDS else json.dumps(v)
    return "[" + ", ".join(format_attr(x) for x in v) + "]"


def format_type(t: TensorType) -> str:
    """``f32[4,8] {dp: S(0)}``; the placement block only when some axis is not replicated."""
    return str(t)


def _value(v: Value) -> str:
    return f"{format_name(v.name)}: {format_type(v.type)}"


def _input(i: Input) -> str:
    text = _value(i.value)
    role = i.role
    if role.kind is InputKind.other and role.of is None and role.slot is None:
        return text  # the default role; spelled out when it carries a slot
    text += " " + role.kind.value
    fields = []
    if role.of is not None:
        fields.append(f"of={format_name(role.of)}")
    if role.slot is not None:
        fields.append(f"slot={format_attr(role.slot)}")
    return text + (f"({', '.join(fields)})" if fields else "")


def _output(o: Output) -> str:
    text = format_name(o.name)
    if o.role.kind is OutputKind.other:
        return text
    if o.role.kind is OutputKind.replaces:
        return f"{text} replaces({format_name(o.role.target)})"
    return f"{text} {o.role.kind.value}"


def format_op_head(op: Op) -> str:
    """One op's line without its regions."""
    head = ""
    if op.results:
        head = ", ".join(_value(v) for v in op.results) + " = "
    head += f"{op.name}(" + ", ".join(format_name(n) for n in op.inputs) + ")"
    if op.attrs:
        head += " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in op.attrs.items()) + "}"
    if op.phase is not None:
        head += f" phase={op.phase.value}"
    if op.stage is not None:
        head += f" stage={op.stage}"
    if op.microbatch is not None:
        head += f" mb={op.microbatch}"
    if op.loc is not None:
        head += f" loc={json.dumps(op.loc)}"
    return head


def _ops(ops: tuple[Op, ...], indent: str, lines: list[str]) -> None:
    for op in ops:
        head = indent + format_op_head(op)
        if not op.regions:
            lines.append(head)
            continue
        lines.append(head + " (")
        for r in op.regions:
            _region(r, indent + "  ", lines)
        lines.append(indent + ")")


def _region(r: Region, indent: str, lines: list[str]) -> None:
    args = ", ".join(_value(a) for a in r.args)
    lines.append(f"{indent}{format_name(r.name, '^')}({args}) {{")
    _ops(r.ops, indent + "  ", lines)
    lines.append(f"{indent}  yield " + ", ".join(format_name(y) for y in r.yields))
    lines.append(indent + "}")


def print_graph(g: Graph) -> str:
    """The canonical text of ``g``; ``parse(print_graph(g)) == g``."""
    head = f"graph {format_name(g.name, '@')}"
    if g.mesh:
        head += " " + str(g.mesh)
    if g.passes:
        head += " passes[" + ", ".join(format_attr(p) for p in g.passes) + "]"
    lines = [FORMAT_LINE]
    if g.inputs:
        lines.append(head + " (")
        lines.extend(f"  {_input(i)}," for i in g.inputs)
        lines.append(") {")
    else:
        lines.append(head + " () {")
    _ops(g.ops, "  ", lines)
    if g.outputs:
        lines.append("  return (")
        lines.extend(f"    {_output(o)}," for o in g.outputs)
        lines.append("  )")
    else:
        lines.append("  return ()")
    lines.append("}")
    return "\n".join(lines) + "\n"


_LOC = re.compile(r' loc="(?:[^"\\]|\\.)*"$', re.M)
# a device argument's index (torch.arange(n, device=x.device) on rank r's GPU: cuda:r)
_DEVICE_INDEX = re.compile(r'("device:[a-z_]+):\d+"')


def program_digest(g: Graph) -> int:
    """A 63-bit hash of ``g``'s canonical text less its source locations and the index of
    a device it names: two processes that built the same program from the same step get
    the same number, wherever the step's files lie and whichever GPU each uses."""
    text = _DEVICE_INDEX.sub(r'\1"', _LOC.sub("", print_graph(g)))
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") >> 1
