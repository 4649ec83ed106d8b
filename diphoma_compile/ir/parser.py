"""Reads the text form back into a Graph; errors name the line and column."""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from ..errors import DiphomaError, IRError, IRParseError
from ..mesh import Mesh
from .core import (AttrValue, Attrs, Graph, Input, InputKind, InputRole, Op, Output, OutputKind,
                   OutputRole, Phase, Region, Value)
from .types import REPLICATE, VARYING, DType, FlatShard, Partial, Placement, Shard, TensorType

_STRING = r'"(?:[^"\\\n]|\\.)*"'
_TOKEN = re.compile(rf"""
  (?P<ws>[ \t\r]+)
| (?P<comment>\#[^\n]*)
| (?P<nl>\n)
| (?P<sigil>[%@^])(?:(?P<bare>[A-Za-z0-9_][A-Za-z0-9_.\-/]*)|(?P<quoted>{_STRING}))
| (?P<string>{_STRING})
| (?P<number>-(?:inf|nan)\b|-?\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)
| (?P<word>[A-Za-z_][A-Za-z0-9_.\-]*)
| (?P<punct>[()\[\]{{}},:=])
""", re.VERBOSE)

_SIGIL_KIND = {"%": "value", "@": "graph", "^": "region"}
_META = {"phase", "stage", "mb", "loc"}


class Token(NamedTuple):
    """One lexical token with its position (a tuple: tokens are many and must be cheap)."""

    kind: str  # value graph region string number word punct nl eof
    text: str
    line: int
    col: int
    value: object = None


def _string(quoted: str, line: int, col: int, source_line: str) -> str:
    """The value of a JSON-quoted string token; IRParseError when it is not valid JSON."""
    try:
        return json.loads(quoted)
    except json.JSONDecodeError as e:
        why = e.msg.removesuffix(" at").lower()
        raise IRParseError(f"bad string {quoted}: {why}", line=line, col=col + e.pos,
                           source_line=source_line,
                           hint='strings use JSON escapes: \\" \\\\ \\n \\t \\uXXXX') from None


def tokenize(text: str) -> list[Token]:
    """Split IR text into tokens; IRParseError at the first character that fits no token."""
    lines = text.split("\n")
    toks: list[Token] = []
    pos, line, line_start = 0, 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        col = pos - line_start + 1
        if m is None:
            if text[pos] == '"' or (text[pos] in "%@^" and text[pos + 1:pos + 2] == '"'):
                raise IRParseError("unterminated string", line=line, col=col,
                                   source_line=lines[line - 1],
                                   hint='close the string with " on the same line')
            raise IRParseError(f"unexpected character {text[pos]!r}", line=line, col=col,
                               source_line=lines[line - 1])
        kind = m.lastgroup
        tok_text = m.group(0)
        if kind == "comment" and tok_text.startswith("# diphoma-ir ") and \
                tok_text.strip() != "# diphoma-ir v1":
            raise IRParseError(f"unsupported format line {tok_text.strip()!r}", line=line,
                               col=col, source_line=lines[line - 1],
                               hint="this reader knows '# diphoma-ir v1'")
        if kind in ("bare", "quoted", "sigil"):
            sig = m.group("sigil")
            if m.group("bare") is not None:
                name = m.group("bare")
            else:
                name = _string(m.group("quoted"), line, col + 1, lines[line - 1])
            toks.append(Token(_SIGIL_KIND[sig], tok_text, line, col, name))
        elif kind == "string":
            toks.append(Token("string", tok_text, line, col,
                              _string(tok_text, line, col, lines[line - 1])))
        elif kind == "number":
            is_float = any(c in tok_text for c in ".eEin")
            toks.append(Token("number", tok_text, line, col,
                              float(tok_text) if is_float else int(tok_text)))
        elif kind in ("word", "punct"):
            toks.append(Token(kind, tok_text, line, col, tok_text))
        elif kind == "nl":
            toks.append(Token("nl", "\\n", line, col))
            line += 1
            line_start = m.end()
        pos = m.end()
    toks.append(Token("eof", "end of text", line, pos - line_start + 1))
    return toks


class _Parser:
    def __init__(self, text: str) -> None:
        self.lines = text.split("\n")
        self.toks = tokenize(text)
        self.i = 0

    # -------------------------------------------------------------- token helpers
    @property
    def tok(self) -> Token:
        return self.toks[self.i]

    def error(self, msg: str, tok: Token | None = None, hint: str | None = None) -> IRParseError:
        tok = tok or self.tok
        src = self.lines[tok.line - 1] if tok.line - 1 < len(self.lines) else ""
        return IRParseError(msg, line=tok.line, col=tok.col, source_line=src, hint=hint)

    def next(self) -> Token:
        tok = self.tok
        self.i += 1
        return tok

    def at(self, kind: str, text: str | None = None) -> bool:
        t = self.tok
        return t.kind == kind and (text is None or t.text == text)

    def accept(self, kind: str, text: str | None = None) -> Token | None:
        return self.next() if self.at(kind, text) else None

    def expect(self, kind: str, text: str | None = None, what: str | None = None) -> Token:
        if self.at(kind, text):
            return self.next()
        want = what or (repr(text) if text else kind)
        got = "end of line" if self.tok.kind == "nl" else repr(self.tok.text)
        raise self.error(f"expected {want}, found {got}")

    def skip_nl(self) -> None:
        while self.at("nl"):
            self.i += 1

    def end_line(self) -> None:
        if not self.at("eof"):
            self.expect("nl", what="end of line")
        self.skip_nl()

    def int_(self, what: str) -> int:
        tok = self.expect("number", what=what)
        if not isinstance(tok.value, int):
            raise self.error(f"expected {what} (an int), found {tok.text}", tok)
        return tok.value

    def comma_list(self, close: str, item, allow_nl: bool = False) -> list:
        items = []
        if allow_nl:
            self.skip_nl()
        while not self.at("punct", close):
            items.append(item())
            if allow_nl:
                self.skip_nl()
            if not self.accept("punct", ","):
                break
            if allow_nl:
                self.skip_nl()
        self.expect("punct", close)
        return items

    # -------------------------------------------------------------- values and types
    def attr_value(self) -> AttrValue:
        tok = self.tok
        if tok.kind in ("number", "string"):
            self.next()
            return tok.value
        if tok.kind == "word":
            self.next()
            return {"true": True, "false": False, "none": None, "inf": float("inf"),
                    "nan": float("nan")}.get(tok.text, tok.text)
        if self.accept("punct", "["):
            return tuple(self.comma_list("]", self.attr_value))
        raise self.error(f"expected an attribute value, found {tok.text!r}")

    def attrs(self) -> Attrs:
        items: dict[str, AttrValue] = {}
        self.expect("punct", "{")

        def item() -> None:
            key = self.expect("word", what="an attribute name")
            if key.text in items:
                raise self.error(f"attribute {key.text!r} is given twice", key)
            self.expect("punct", "=")
            items[key.text] = self.attr_value()
        self.comma_list("}", item)
        return Attrs(items)

    def placement(self) -> Placement:
        tok = self.expect("word", what="a placement (R, S(dim), S(dim,groups), F, Fx, V or P(op))")
        if tok.text == "R":
            return REPLICATE
        if tok.text in ("F", "Fx"):
            return FlatShard(dirty=tok.text == "Fx")
        if tok.text == "V":
            return VARYING
        if tok.text in ("S", "P"):
            self.expect("punct", "(")
            if tok.text == "S":
                dim = self.int_("a dimension")
                groups = 1
                if self.accept("punct", ","):
                    groups = self.int_("a number of groups")
                    if groups < 1:
                        raise self.error(f"a shard's groups must be >= 1, found {groups}",
                                         tok)
                p: Placement = Shard(dim, groups)
            else:
                op = self.expect("word", what="a reduction (sum, avg, max, min)")
                try:
                    p = Partial(op.text)
                except IRError as e:
                    raise self.error(e.message, op) from None
            self.expect("punct", ")")
            return p
        raise self.error(f"unknown placement {tok.text!r}",
                         tok, hint="placements are R, S(dim), F, Fx, V and P(sum|avg|max|min)")

    def type_(self) -> TensorType:
        tok = self.expect("word", what="a type such as f32[4,8]")
        try:
            dtype = DType.parse(tok.text)
        except IRError as e:
            raise self.error(e.message, tok, hint=e.hint) from None
        self.expect("punct", "[")
        shape = self.comma_list("]", lambda: self.int_("a dimension size"))
        placements: dict[str, Placement] = {}
        if self.at("punct", "{"):
            self.next()

            def item() -> None:
                axis = self.expect("word", what="a mesh axis name")
                if axis.text in placements:
                    raise self.error(f"axis {axis.text!r} is placed twice", axis)
                self.expect("punct", ":")
                placements[axis.text] = self.placement()
            self.comma_list("}", item)
        try:
            return TensorType(tuple(shape), dtype, tuple(placements.items()))
        except IRError as e:
            raise self.error(e.message, tok) from None

    def value_decl(self) -> Value:
        name = self.expect("value", what="a value name such as %x")
        self.expect("punct", ":")
        return Value(name.value, self.type_())

    # -------------------------------------------------------------- graph pieces
    def input_(self) -> Input:
        value = self.value_decl()
        if not self.at("word"):
            return Input(value)
        tok = self.next()
        try:
            kind = InputKind(tok.text)
        except ValueError:
            raise self.error(f"unknown input role {tok.text!r}", tok,
                             hint="roles: " + ", ".join(k.value for k in InputKind)) from None
        of = slot = None
        if self.accept("punct", "("):
            fields: dict[str, object] = {}

            def item() -> None:
                key = self.expect("word", what="of or slot")
                if key.text not in ("of", "slot") or key.text in fields:
                    raise self.error(f"unexpected role field {key.text!r}", key)
                self.expect("punct", "=")
                fields[key.text] = (self.expect("value").value if key.text == "of"
                                    else self.attr_value())
            self.comma_list(")", item)
            of, slot = fields.get("of"), fields.get("slot")
        try:
            return Input(value, InputRole(kind, of, slot))
        except IRError as e:
            raise self.error(e.message, tok) from None

    def output(self) -> Output:
        name = self.expect("value", what="an output value name").value
        if not self.at("word"):
            return Output(name)
        tok = self.next()
        if tok.text == "replaces":
            self.expect("punct", "(")
            target = self.expect("value", what="the replaced input").value
            self.expect("punct", ")")
            return Output(name, OutputRole(OutputKind.replaces, target))
        if tok.text in ("loss", "metric", "other"):
            return Output(name, OutputRole(OutputKind(tok.text)))
        raise self.error(f"unknown output role {tok.text!r}", tok,
                         hint="roles: loss, metric, replaces(%input)")

    def op(self) -> Op:
        results: list[Value] = []
        if self.at("value"):
            results = [self.value_decl()]
            while self.accept("punct", ","):
                results.append(self.value_decl())
            self.expect("punct", "=")
        name = self.expect("word", what="an op name")
        self.expect("punct", "(")
        inputs = self.comma_list(")", lambda: self.expect("value").value)
        attrs = self.attrs() if self.at("punct", "{") else Attrs()
        meta: dict[str, object] = {}
        while self.at("word") and self.tok.text in _META:
            key = self.next()
            if key.text in meta:
                raise self.error(f"{key.text} is given twice", key)
            self.expect("punct", "=")
            if key.text == "phase":
                ph = self.expect("word", what="forward, backward or update")
                try:
                    meta["phase"] = Phase(ph.text)
                except ValueError:
                    raise self.error(f"unknown phase {ph.text!r}", ph,
                                     hint="phases: forward, backward, update") from None
            elif key.text == "loc":
                meta["loc"] = self.expect("string", what="a quoted location").value
            else:
                meta[key.text] = self.int_(key.text)
        regions: list[Region] = []
        if self.accept("punct", "("):
            self.end_line()
            while self.at("region"):
                regions.append(self.region())
            self.expect("punct", ")", what="')' closing the regions or a region ^name")
        if not self.at("eof"):
            self.expect("nl", what="end of line")
        self.skip_nl()
        return Op(name.text, tuple(inputs), tuple(results), attrs, tuple(regions),
                  meta.get("phase"), meta.get("stage"), meta.get("mb"), meta.get("loc"))

    def ops_until(self, terminator: str) -> list[Op]:
        ops = []
        self.skip_nl()
        while not self.at("word", terminator):
            if self.at("eof") or self.at("punct", "}"):
                raise self.error(f"expected an op or '{terminator}', found {self.tok.text!r}")
            ops.append(self.op())
        return ops

    def region(self) -> Region:
        name = self.expect("region").value
        self.expect("punct", "(")
        args = self.comma_list(")", self.value_decl)
        self.expect("punct", "{")
        self.end_line()
        ops = self.ops_until("yield")
        self.next()
        yields = []
        if self.at("value"):
            yields.append(self.next().value)
            while self.accept("punct", ","):
                yields.append(self.expect("value").value)
        self.end_line()
        self.expect("punct", "}")
        self.end_line()
        return Region(name, tuple(args), tuple(ops), tuple(yields))

    def mesh(self) -> Mesh:
        start = self.tok
        self.expect("punct", "[")
        axes: list[tuple[str, int]] = []

        def item() -> None:
            axis = self.expect("word", what="a mesh axis name")
            self.expect("punct", "=")
            axes.append((axis.text, self.int_("an axis size")))
        self.comma_list("]", item)
        try:
            return Mesh(tuple(axes))
        except DiphomaError as e:
            raise self.error(e.message, start, hint=e.hint) from None

    def graph(self) -> Graph:
        self.skip_nl()
        self.expect("word", "graph", what="'graph'")
        name = self.expect("graph", what="a graph name such as @step").value
        mesh, passes = Mesh(), ()
        if self.accept("word", "mesh"):
            mesh = self.mesh()
        if self.accept("word", "passes"):
            self.expect("punct", "[")
            passes = tuple(str(p) for p in self.comma_list("]", self.attr_value))
        self.expect("punct", "(")
        inputs = self.comma_list(")", self.input_, allow_nl=True)
        self.expect("punct", "{")
        self.end_line()
        ops = self.ops_until("return")
        self.next()
        self.expect("punct", "(")
        outputs = self.comma_list(")", self.output, allow_nl=True)
        self.end_line()
        self.expect("punct", "}")
        self.skip_nl()
        if not self.at("eof"):
            raise self.error(f"unexpected text after the graph: {self.tok.text!r}")
        return Graph(name, tuple(inputs), tuple(ops), tuple(outputs), mesh, passes)


def parse(text: str) -> Graph:
    """Parse the text form of one graph; IRParseError names the line and column."""
    return _Parser(text).graph()
