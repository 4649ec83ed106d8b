"""The Pipeline: passes run in order, the graph verified after each, dumped and timed; a
failure names the pass, the passes before it and the op."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import DiphomaError, IRVerifyError, PassError
from ..ir.core import Graph, Op
from ..ir.printer import format_op_head, print_graph
from ..ir.verify import verify
from .base import Pass, PassContext, PassRecord
from .spec import parse_spec

@dataclass(frozen=True)
class Pipeline:
    """An ordered list of passes; ``run`` verifies after each, dumps and times them."""

    passes: tuple[Pass, ...] = ()

    @classmethod
    def from_spec(cls, spec: str) -> Pipeline:
        """Build a pipeline from a spec string such as ``"dce,cse"``."""
        return cls(tuple(parse_spec(spec)))

    def spec(self) -> str:
        """The spec string that rebuilds this pipeline."""
        return ",".join(p.spec() for p in self.passes)

    def run(self, graph: Graph, ctx: PassContext | None = None) -> Graph:
        """Apply every pass in order; PassError names the pass, those before it, the op."""
        ctx = ctx or PassContext()
        if ctx.verify:
            try:
                verify(graph)
            except IRVerifyError as e:
                raise PassError(f"the input graph does not verify, before any pass ran:\n{e}",
                                pass_name="<input>") from e
        done: list[str] = []
        for k, p in enumerate(self.passes):
            spec = p.spec()
            t0 = time.perf_counter()
            try:
                new = p(graph, ctx)
            except Exception as e:
                raise _pass_error(spec, done, e) from e
            if not isinstance(new, Graph):
                raise PassError(f"pass {spec!r} returned {type(new).__name__}, not a Graph",
                                pass_name=p.name, before=tuple(done))
            t1 = time.perf_counter()
            changed = new is not graph
            new = new.replace(passes=new.passes + (spec,))
            if ctx.verify:
                try:
                    verify(new)
                except IRVerifyError as e:
                    raise _pass_error(spec, done, e, "left a graph that does not verify") from e
            t2 = time.perf_counter()
            ctx.records.append(PassRecord(spec, changed, t1 - t0, t2 - t1))
            if ctx.wants_dump(p.name):
                _dump(ctx, k, p.name, new)
            done.append(spec)
            graph = new
        return graph


def _pass_error(spec: str, done: list[str], e: Exception,
                what: str = "failed") -> PassError:
    before = ", ".join(done) if done else "none"
    msg = f"pass {spec!r} {what} (passes run before it: {before})\n{e}"
    op = getattr(e, "op", None)
    if isinstance(op, Op):
        msg += f"\n  at op: {format_op_head(op)}"
    elif not isinstance(e, DiphomaError):
        msg = f"{msg}\n  ({type(e).__name__}; this is a bug in the pass)"
    # str(e) already carries e's hint
    return PassError(msg, pass_name=spec.split("{")[0], before=tuple(done))


def _dump(ctx: PassContext, k: int, name: str, graph: Graph) -> None:
    text = print_graph(graph)
    if ctx.dump_dir is not None:
        ctx.dump_dir.mkdir(parents=True, exist_ok=True)
        (ctx.dump_dir / f"{k:02d}-{name}.ir").write_text(text)
    else:
        ctx.dump_stream(f"# IR after {name}\n{text}")
