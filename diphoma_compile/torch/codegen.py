"""The code generators of the torch backend: what turns the built fx GraphModule into the
program that runs.

- ``fx``: the GraphModule itself, interpreted by Python; it makes the eager step's own aten
  calls, so results equal eager's bit for bit (the reference the parity tests use).
- ``inductor``: the GraphModule handed to ``torch._inductor.compile_fx`` on the first call
  (shapes are fixed by the trace, so it compiles once and never again). Its kernels fuse
  and reorder elementwise math, so results differ from eager's in the last bits. The step
  is traced for it with the optimizers' tensor math (no ``.item()`` on the learning rate or
  step count, which would cut the graph and bake the value in) and collectives are
  ``_c10d_functional`` ops, each with its ``wait_tensor``.

The default (``codegen=None``) is ``default_codegen()``: see docs/torch.md for the rule
and the measurements behind it."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..errors import BackendError

CODEGENS = ("fx", "inductor")
log = logging.getLogger("diphoma_compile")


def check_codegen(codegen: str | None) -> str | None:
    """``codegen`` if it names a code generator (or is None or "auto", the default);
    DiphomaError otherwise."""
    if codegen not in (None, "auto") and codegen not in CODEGENS:
        raise BackendError(f"codegen={codegen!r} is not a code generator of the torch "
                           f"backend", hint=f"pass one of {', '.join(CODEGENS)}, or None for "
                                            "the default")
    return codegen


# Inductor by default from this many flops per step: a 4-layer GPT-2-style step (d=256,
# 1,024 tokens; about 3e10) runs in 0.91x eager's time under Inductor on 2 quiet CPU cores
# (0.68x on loaded ones) and compiles in one to two minutes; a step below this takes
# milliseconds, and compiling it (seconds to tens of seconds for a tiny model) is never won
# back in a short run or a test
INDUCTOR_MIN_FLOPS = 1e10


def inductor_available(device: torch.device) -> bool:
    """Whether Inductor can generate code for ``device`` here: a C++ compiler for the CPU,
    Triton for CUDA."""
    if device.type == "cpu":
        return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++"))
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return False


def default_codegen(device: torch.device, flops: float = 0.0) -> str:
    """The code generator ``codegen=None`` picks for a step of ``flops`` per call on
    ``device``: Inductor for a step of at least INDUCTOR_MIN_FLOPS where it can generate
    code for the device, fx otherwise (docs/torch.md has the measurements)."""
    if flops >= INDUCTOR_MIN_FLOPS and inductor_available(device):
        return "inductor"
    return "fx"


class InductorProgram:
    """A GraphModule compiled by Inductor on its first call, with that call's inputs as the
    example (every later call has the same shapes: the runtime checks its arguments)."""

    def __init__(self, gm: fx.GraphModule, label: str = "step",
                 sent: list[tuple[Any, str, int]] | None = None) -> None:
        self.gm = gm
        self.label = label
        self.compiled: Callable | None = None
        self.compile_s: float | None = None   # seconds the first call spent compiling
        # (Comm, kind, bytes) of each collective of the program: the compiled code runs
        # them out of Python's sight, so each call counts them here (and the counts the
        # trace made while compiling are taken back)
        self.sent = sent or []

    @property
    def code(self) -> str:
        """The fx program handed to Inductor, as Python source."""
        return self.gm.code

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if self.compiled is None:
            comms = {id(c): c for c, _, _ in self.sent}.values()
            before = [(c, c.calls.copy(), c.bytes_sent) for c in comms]
            self.compile(list(inputs))
            for c, calls, nbytes in before:     # what tracing counted: nothing ran
                c.calls, c.bytes_sent = calls, nbytes
        out = self.compiled(*inputs)
        for comm, kind, nbytes in self.sent:
            comm._count(kind, nbytes)
        return out

    def compile(self, inputs: list[torch.Tensor]) -> None:
        """Compile the program for these example inputs (once)."""
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx
        log.info("diphoma_compile: Inductor is compiling the %s program (%d nodes; once, on "
                 "this first call: seconds for a small step, minutes for a large one)",
                 self.label, len(self.gm.graph.nodes))
        t0 = time.perf_counter()
        try:
            # random ops (dropout) run as eager's kernels on torch's generator, so a seeded
            # step draws the same masks as the eager step (Inductor's own random numbers
            # come from another stream: other masks, other losses)
            with config.patch(fallback_random=True):
                self.compiled = compile_fx(self.gm, inputs)
        except Exception as e:   # Inductor raises many kinds; say which code generator
            raise BackendError(f"Inductor could not compile the {self.label} program: "
                               f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}",
                               hint="run it with codegen='fx' (the reference code "
                                    "generator)") from e
        self.compile_s = time.perf_counter() - t0
        log.info("diphoma_compile: Inductor compiled the %s program in %.1f s",
                 self.label, self.compile_s)


def program(graph: Any, captured: Any, comms: dict | None = None, in_place: bool = True,
            label: str | None = None) -> Any:
    """The runnable program of ``graph`` for the code generator it was traced for
    (``captured.codegen``): the fx GraphModule, or it under Inductor (named ``label`` in
    its messages; the graph's name by default). ``in_place``: the module writes each new
    parameter and optimizer state into its input's storage where the input is read no more
    (``build.updates_in_place``; a pipeline's stage programs do not: their executor sums
    microbatches and writes back). Inductor keeps such a mutation of a graph input and
    stores the fused update kernel's result there, so the runtime writes nothing back and
    the old and new values never live side by side. For Inductor the module also reads no
    0-d tensor on the host, and its collectives are functional."""
    from .build import build_module
    if captured.codegen != "inductor":
        return build_module(graph, comms, in_place=in_place, device=captured.device,
                            out_variants=True)
    for c in (comms or {}).values():
        c.functional = True
    gm = build_module(graph, comms, in_place=in_place, device=captured.device,
                      host_reads=False)
    return InductorProgram(gm, label or graph.name, _collectives_sent(graph, comms or {}))


def _collectives_sent(graph: Any, comms: dict) -> list[tuple[Any, str, int]]:
    """Each collective of ``graph`` as (its Comm, its kind, the bytes this rank sends):
    the ring formulas of ``OpDef.comm_bytes``, which the fx program's collectives count
    on the tensors they are passed (equal: tests/distributed)."""
    from ..ir.ops import Category, op_def
    from .build import comm_key
    sizes = dict(graph.mesh.axes)
    types = graph.value_types()
    out = []
    for op in graph.walk():
        d = op_def(op.name)
        kind = _COUNTED_AS.get(op.name)
        if d.category is not Category.collective or kind is None or \
                comm_key(op) not in comms:
            continue
        nbytes = d.comm_bytes(op, [types[n] for n in op.inputs],
                              [v.type for v in op.results],
                              sizes.get(str(op.attrs["axis"]), 1), sizes)
        out.append((comms[comm_key(op)], kind, nbytes))
    return out


# the IR collectives whose fx call counts itself (collectives.py), under the kind it counts;
# the others (as_partial, as_varying, as_shard: no call) count nothing there either
_COUNTED_AS = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
               "all_gather": "all_gather", "broadcast": "broadcast",
               "all_to_all": "all_to_all", "take_shard": "take_shard",
               "take_piece": "take_shard"}
