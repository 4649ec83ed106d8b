"""Command line: ``python -m diphoma_compile`` or ``diphoma``.

``inspect PATH[:NAME]`` plans a model file's training step for a mesh and prints the plan
(no devices needed; see docs/guide.md); ``ir FILE`` reads IR text, verifies it, runs a pass
pipeline and prints the result with its analyses; ``passes`` and ``ops`` list what is
registered."""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
from pathlib import Path

from . import __version__
from .errors import DiphomaError
from .report.units import human


def _stats(graph) -> str:
    from .ir.analysis import graph_cost, liveness
    from .ir.ops import op_def
    total, _ = graph_cost(graph)
    live = liveness(graph)
    cats: dict[str, int] = {}
    for op in graph.walk():
        c = op_def(op.name).category.value
        cats[c] = cats.get(c, 0) + 1
    lines = [
        f"# ops: {sum(cats.values())} (" + ", ".join(f"{k} {v}" for k, v in sorted(cats.items()))
        + ")",
        f"# flops: {total.flops:,}   bytes touched: {human(total.bytes)}   "
        f"sent per device: {human(total.comm_bytes)}",
        f"# peak live memory per device: {human(live.peak_bytes)} "
        f"(at op #{live.peak_index})",
    ]
    return "\n".join(lines) + "\n"


def read_ir_file(name: str) -> str:
    """The text of the IR file ``name``; a DiphomaError when it is missing or a folder."""
    path = Path(name)
    if not path.exists():
        raise DiphomaError(f"no such file: {name}",
                           hint="give the path of a .ir file, or - to read standard input")
    if path.is_dir():
        raise DiphomaError(f"{name} is a directory", hint="give a .ir file in it")
    return path.read_text()


def cmd_ir(args: argparse.Namespace) -> int:
    from .ir import parse, print_graph
    from .passes import PassContext, Pipeline
    text = sys.stdin.read() if args.file == "-" else read_ir_file(args.file)
    graph = parse(text)
    dump = "all" if args.dump_ir_after == "all" else frozenset(
        x for x in (args.dump_ir_after or "").split(",") if x)
    ctx = PassContext(verify=True, dump_after=dump,
                      dump_stream=lambda s: sys.stdout.write(s))
    pipeline = Pipeline.from_spec(args.passes) if args.passes else Pipeline()
    if dump != "all":       # checked before the passes run (they may take a while)
        names = {p.name for p in pipeline.passes}
        unknown = sorted(dump - names)
        if unknown:
            raise DiphomaError(f"--dump-ir-after {','.join(unknown)}: no pass of that name is "
                               "in --passes" + (f" (it has {', '.join(sorted(names))})"
                                                if names else " (none given)"),
                               hint="name passes of --passes, or all")
    graph = pipeline.run(graph, ctx)
    out = print_graph(graph)
    if args.stats:
        out += _stats(graph)
        for r in ctx.records:
            out += (f"# pass {r.spec}: {'changed' if r.changed else 'unchanged'}, "
                    f"{r.seconds * 1e3:.2f} ms (+{r.verify_seconds * 1e3:.2f} ms verify)\n")
    if args.out:
        Path(args.out).write_text(out)
    else:
        sys.stdout.write(out)
    return 0


def cmd_passes(args: argparse.Namespace) -> int:
    from .passes import available_passes
    for cls in available_passes().values():
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"{cls().spec():40s} {doc}")
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    from .ir.ops import OPS
    for name, d in sorted(OPS.items(), key=lambda kv: (kv[1].category.value, kv[0])):
        attrs = ", ".join(f"{k}{'' if req else '?'}" for k, (_, req) in d.attrs.items())
        print(f"{d.category.value:11s} {name:17s} {attrs}")
    return 0


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows the RST literals of the docstrings it is given
    (text in double backquotes) as plain text."""

    def format_help(self) -> str:
        """The help text, double backquotes removed."""
        return re.sub(r"``(.+?)``", r"\1", super().format_help())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``diphoma`` command."""
    p = Parser(prog="diphoma", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    from .inspect.command import add_parser
    add_parser(sub)
    ir = sub.add_parser("ir", help="verify IR text, run passes on it, print it with analyses")
    ir.add_argument("file", help="a .ir file, or - for standard input")
    ir.add_argument("--passes", default="", help="pipeline spec, e.g. 'dce,cse'")
    ir.add_argument("--dump-ir-after", default="", metavar="PASS|all",
                    help="print the IR after these passes (comma-separated) or all")
    ir.add_argument("--stats", action="store_true",
                    help="append op counts, flops, bytes, peak memory and pass timings")
    ir.add_argument("--out", help="write the result to this file instead of stdout")
    ir.set_defaults(func=cmd_ir)
    sub.add_parser("passes", help="list registered passes (plugins included)").set_defaults(
        func=cmd_passes)
    sub.add_parser("ops", help="list the op vocabulary").set_defaults(func=cmd_ops)
    return p


def run() -> None:
    """The ``diphoma`` command and ``python -m diphoma_compile``: ``main()``, then exit."""
    # Tracing a large step makes millions of short-lived objects and few cycles: with the
    # default threshold the young generation is collected every 700 allocations, which
    # costs about a third of a second of the 13 s it takes to plan GPT-2 small.
    gc.set_threshold(10_000, 10, 10)
    status = main()
    # The interpreter's collections at exit would walk every object torch and the command
    # made (about a second after inspecting GPT-2 small) only to free them anyway.
    gc.freeze()
    sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    """Entry point; a DiphomaError prints its message (no traceback) and exits 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DiphomaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader (head, less) went away: stop quietly, as Unix tools do
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
