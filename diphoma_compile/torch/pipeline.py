"""The per-rank runtime of a pipelined torch step: this rank's stages, run on a schedule.

The ``pipeline`` pass left every op a stage and the values that cross stages as send/recv
pairs. A rank runs one stage (GPipe, 1F1B: its coordinate on the pipeline axis) or several
(interleaved: stages r, r + P, ...; zbv: r and 2P - 1 - r), and cuts each stage's ops into
programs, each built by ``build.py``: forward and backward (the zero-bubble schedules: its
input-gradient part I and weight-gradient part W), run once per microbatch, and the update,
run once (in rounds when it receives from other stages' updates, as a global gradient-norm
clip does). Between them: the values received (``irecv``, waited for before the program
that reads them; in memory between two stages of one rank), the values sent (``isend``,
waited for at the end of the step), and what leaves the microbatches for the update or the
step's results (gradients, the loss) averaged over the microbatches. The order of the runs
is the schedule's (``pipeline_schedule.py``). Each rank passes its whole local batch; the
batch inputs are cut into M microbatches along their first dimension. The loss and metrics
are broadcast from their stage's rank, so every rank returns the global batch's.

A rank holds only the parameters its stages read (others are emptied, as
torch.distributed.pipelining deletes other stages' modules); a tied parameter (GPT-2's
embedding and LM head) lives on both its stages, and the one that does not update it
receives the new value. ``state_dict()`` gathers the whole model on every rank."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import BackendError
from ..ir.analysis import free_inputs
from ..ir.core import Graph, Input, InputKind, InputRole, Op, Output, Phase, Value
from ..passes.pipeline_parallel import (SPLIT_BACKWARD, input_gradient_ops, pipeline_of,
                                        stage_rank)
from .build import build_module
from .dist import TorchDistStep
from .ops import DTYPE_TO_TORCH
from .pipeline_schedule import schedule_actions
from .state import Captured, Slot

_SEGMENTS = {Phase.forward: "F", Phase.backward: "B", Phase.update: "U"}


@dataclass
class _Segment:
    """One program of this stage: its module, what it reads and returns, its sends/recvs."""

    module: Any = None
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    recvs: list[tuple[str, int, int]] = field(default_factory=list)   # name, peer, tag
    sends: list[tuple[str, int, int]] = field(default_factory=list)
    acc: list[str] = field(default_factory=list)   # summed over microbatches (made or received)


class TorchPipelineStep(TorchDistStep):
    """A distributed step whose ranks each run one pipeline stage on a schedule."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._finish_init()

    def _program(self, graph: Graph, captured: Captured) -> Any:
        opts = pipeline_of(graph)
        if opts is None or opts.axis not in self.comms:
            raise BackendError("the graph was not cut into pipeline stages",
                               hint="run the pipeline pass")
        self.pp = self.comms[opts.axis]
        self.pp_side = self._sides[opts.axis]
        self.schedule, self.microbatches = opts.schedule, opts.microbatches
        self.nstages = 1 + max(op.stage for op in graph.ops if op.stage is not None)
        self.stages = [s for s in range(self.nstages)
                       if stage_rank(opts.schedule, s, self.nstages, self.pp.size) == self.pp.rank]
        self.stage = self.stages[0]         # this rank's first stage
        # zero-bubble schedules run each backward as its input-gradient part (I: what the
        # previous stage waits for) and its weight-gradient part (W: the rest)
        self.kinds = "FIWU" if opts.schedule in SPLIT_BACKWARD else "FBU"
        self.actions = schedule_actions(opts.schedule, self.nstages, opts.microbatches,
                                        self.pp.size)[self.pp.rank]
        self._cut(graph)
        # seconds in this stage's programs and in whole steps: 1 - compute / wall is the
        # share this rank waited (the measured bubble, with the transfers); busy holds
        # (kind, microbatch, stage, start, end) of the last step's programs, in
        # time.perf_counter() seconds (one clock for every process of the machine)
        self.compute_s = self.wall_s = 0.0
        self.busy: list[tuple[str, int, int, float, float]] = []
        return self._run

    # ------------------------------------------------------------------ building
    def _cut(self, graph: Graph) -> None:
        types = graph.value_types()
        self.types = types
        self.segs: dict[tuple[int, str], _Segment] = {}
        self.writes: dict[str, tuple[str, int, int]] = {}     # param -> recv of its new value
        self.seg_of: dict[str, str] = {}
        self.split: dict[int, tuple[int, int]] = {}   # stage -> ops in its I and W parts
        # a split backward's input-gradient part: what the gradients sent to an earlier
        # stage's backward depend on
        self.input_grad = input_gradient_ops(graph.ops) if "I" in self.kinds else set()
        self._rounds(graph)
        for me in self.stages:
            self._cut_stage(graph, me)
        # the same numbering on every rank: one wire tag per (microbatch, pair)
        self.ntags = 1 + max([int(op.attrs["tag"]) for op in graph.ops
                              if op.name == "send"] + [0])
        self.inputs_read = {n for s in self.segs.values() for n in s.inputs}
        self.batch = {i.name for i in graph.inputs if i.role.kind is InputKind.batch}
        self.made_here = set(self.seg_of)
        new_of = {o.role.target: o.name for o in graph.outputs if o.role.target is not None}
        # a tied parameter's new value received here stands for the output that replaces it
        self.stand_in = {}
        for name in self.writes:
            p = next((i.name for i in graph.inputs if name.startswith(i.name + ".new.s")),
                     None)
            if p is None or p not in new_of:
                raise BackendError(f"the pipeline receives %{name}, which nothing reads",
                                   hint="this is a bug in the pipeline pass")
            self.stand_in[new_of[p]] = name
        # the step's results (loss, metrics) made on other stages are broadcast from there
        producers = {v.name: op.stage for op in graph.ops for v in op.results}
        self.result_stage = {o.name: (None if producers.get(o.name) is None
                                      else stage_rank(self.schedule, producers[o.name],
                                                      self.nstages, self.pp.size))
                             for o in graph.outputs if o.role.target is None}

    def _cut_stage(self, graph: Graph, me: int) -> None:
        """The forward, backward and update programs of stage ``me``."""
        types = self.types
        roles = {i.name: i.role for i in graph.inputs}
        ops = [op for op in graph.ops if op.stage == me]
        kinds = [k for k in self.kinds if k != "U"] + [f"U{r}" for r in range(self.nrounds)]
        seg_of: dict[str, str] = {}           # value made on this stage -> its segment
        segs = {k: _Segment() for k in kinds}
        body: dict[str, list[Op]] = {k: [] for k in kinds}
        readers: dict[str, set[str]] = {}
        input_grad = self.input_grad if "I" in kinds else set()
        for op in ops:
            if op.name in ("send", "recv"):
                continue
            k = _SEGMENTS[op.phase or Phase.forward]
            if k == "B" and "I" in kinds:
                k = "I" if id(op) in input_grad else "W"
            elif k == "U":
                k = f"U{self.op_round[id(op)]}"
            body[k].append(op)
            seg_of.update((v.name, k) for v in op.results)
            for n in free_inputs(op):
                readers.setdefault(n, set()).add(k)
        for op in ops:
            if op.name == "recv":
                name = op.results[0].name
                where = readers.get(name)
                if not where:           # a tied parameter's new value: written, not read
                    self.writes[name] = (name, int(op.attrs["peer"]), int(op.attrs["tag"]))
                    continue
                k = min(where, key=kinds.index)
                if op.phase is Phase.backward and k == "F":
                    k = kinds[1]
                segs[k].recvs.append((name, int(op.attrs["peer"]), int(op.attrs["tag"])))
                seg_of[name] = "R" + k
            elif op.name == "send":
                n = op.inputs[0]
                k = seg_of.get(n, "F").removeprefix("R")
                segs[k].sends.append((n, int(op.attrs["peer"]), int(op.attrs["tag"])))
                readers.setdefault(n, set()).add("S" + k)
        if "I" in kinds:
            self.split[me] = (len(body["I"]), len(body["W"]))
        returned = {o.name for o in graph.outputs}
        def updates(n: str) -> bool:       # read by the update or returned
            return any(r.startswith("U") for r in readers.get(n, ())) or n in returned

        for k in kinds:
            made = {v.name for op in body[k] for v in op.results}
            seg = segs[k]
            seg.inputs = list(dict.fromkeys(n for op in body[k] for n in free_inputs(op)
                                            if n not in made))
            seg.outputs = [n for n in made if (readers.get(n, set()) - {k}) or n in returned]
            if not k.startswith("U"):
                seg.acc = [n for n in seg.outputs + [r[0] for r in seg.recvs] if updates(n)]
            sub = Graph(f"{graph.name}.stage{me}.{k}",
                        tuple(Input(Value(n, types[n]), roles.get(n, InputRole()))
                              for n in seg.inputs), tuple(body[k]),
                        tuple(Output(n) for n in seg.outputs), graph.mesh)
            seg.module = build_module(sub, self.comms, in_place=False)
            self.segs[(me, k)] = seg
        self.seg_of.update(seg_of)

    def _rounds(self, graph: Graph) -> None:
        """Cut the update into rounds by the values it receives from other stages' updates
        (a global gradient-norm clip: each stage's gradient norms go to one stage, which
        sends the clip factor back): round r reads only what rounds before r sent, so every
        rank runs round 0 of all its stages, then round 1, ... without waiting on itself."""
        value: dict[str, int] = {}
        sent: dict[int, int] = {}
        self.op_round: dict[int, int] = {}
        for op in graph.ops:
            if op.phase is not Phase.update:
                continue
            if op.name == "send":
                sent[int(op.attrs["tag"])] = value.get(op.inputs[0], 0)
            elif op.name == "recv":
                value[op.results[0].name] = sent.get(int(op.attrs["tag"]), -1) + 1
            else:
                r = max([value.get(n, 0) for n in free_inputs(op)] + [0])
                self.op_round[id(op)] = r
                value.update((v.name, r) for v in op.results)
        # then as late as their readers allow: math on the hyperparameters alone (the
        # learning rate's scalars, which a program may keep on the host) runs in the round
        # of the update that reads it rather than crossing from round 0
        readers: dict[str, list[Op]] = {}
        for op in graph.ops:
            for n in free_inputs(op):
                readers.setdefault(n, []).append(op)
        returned = {o.name for o in graph.outputs}
        for op in reversed(graph.ops):
            if id(op) not in self.op_round:
                continue
            late = [self.op_round.get(id(r)) for v in op.results
                    for r in readers.get(v.name, ())]
            if late and None not in late and not any(v.name in returned for v in op.results):
                self.op_round[id(op)] = max(self.op_round[id(op)], min(late))
        self.nrounds = 1 + max(self.op_round.values(), default=0)

    def _finish_init(self) -> None:
        """Batch arguments are M microbatches; other stages' parameters are let go."""
        m = self.microbatches
        arg_slots = [s for s in self.captured.inputs if s.kind == "arg"]
        self._arg_types = [((shape[0] * m, *shape[1:]) if shape and s.name in self.batch
                            else shape, dtype)
                           for (shape, dtype), s in zip(self._arg_types, arg_slots)]
        self._drop_params()

    def _drop_params(self) -> None:
        """Empty the parameters this stage does not read (their owners keep them)."""
        for slot, p in zip([s for s in self.captured.inputs if s.kind == "param"],
                           self.captured.params):
            if slot.name not in self.inputs_read:
                with torch.no_grad():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None

    # ------------------------------------------------------------------ running
    def _input(self, slot: Slot, args_it) -> torch.Tensor:
        if slot.name in self.inputs_read or slot.kind == "arg":
            return super()._input(slot, args_it)
        return torch.empty(0)

    def _write(self, slot: Slot, new: torch.Tensor) -> None:
        if new.numel() == 0 and slot.kind in ("param", "opt_state", "buffer", "grad"):
            return          # made on another stage
        super()._write(slot, new)

    def _tag(self, mb: int, tag: int) -> int:
        return mb * self.ntags + tag

    def _post(self, items: list[tuple[str, int, int]], mb: int) -> list:
        """Post the receives of ``items`` from other ranks: (name, buffer, work) each."""
        sizes = dict(self.mesh.axes)
        posted = []
        for name, peer, tag in items:
            if peer == self.pp.rank:
                continue
            t = self.types[name]
            buf = torch.empty(t.local_shape(sizes), dtype=DTYPE_TO_TORCH[t.dtype])
            posted.append((name, buf, dist.irecv(buf, src=self.pp.global_rank(peer),
                                                 group=self.pp.group,
                                                 tag=self._tag(mb, tag))))
        return posted

    def _recv(self, items: list[tuple[str, int, int]], mb: int, env: dict,
              posted: list | None = None) -> None:
        """Put the values of ``items`` into ``env``: from this rank's other stages, or
        received (``posted`` earlier by ``_post``, or posted now) and waited for."""
        for name, peer, tag in items:
            if peer == self.pp.rank:        # from another stage of this rank
                got = self._local.pop(self._tag(mb, tag), None)
                if got is None:
                    raise BackendError(f"stage program waits for %{name} from a later "
                                       "action of its own rank",
                                       hint="the schedule's order is not runnable; this is "
                                            "a bug in the pipeline schedule")
                env[name] = got
        for name, buf, work in (self._post(items, mb) if posted is None else posted):
            work.wait()
            env[name] = buf

    def _send(self, items: list[tuple[str, int, int]], mb: int, env: dict) -> None:
        for name, peer, tag in items:
            if peer == self.pp.rank:
                self._local[self._tag(mb, tag)] = env[name]
                continue
            t = env[name].contiguous()
            self._pending.append((dist.isend(t, dst=self.pp.global_rank(peer),
                                             group=self.pp.group, tag=self._tag(mb, tag)), t))
            self.pp.bytes_sent += t.numel() * t.element_size()

    def _run(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        self.busy = []
        try:
            return self._schedule(*inputs)
        finally:
            self.wall_s += time.perf_counter() - t0

    def _call(self, seg: _Segment, args: list, env: dict, what: tuple[str, int, int],
              acc: dict[str, torch.Tensor] | None = None) -> None:
        """Run one program; with ``acc``, add what leaves the microbatch (gradients, the
        loss) into the sum over microbatches, in place, as autograd accumulates into
        ``.grad`` within the backward (so it counts as the program's time)."""
        t1 = time.perf_counter()
        env.update(zip(seg.outputs, seg.module(*args)))
        if acc is not None:
            for n in seg.acc:
                if n not in acc:
                    acc[n] = env[n].clone()     # an output may be a view of an input
                else:
                    acc[n].add_(env[n])
        t2 = time.perf_counter()
        self.compute_s += t2 - t1
        self.busy.append((*what, t1, t2))

    def _schedule(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        g = self.graph
        m = self.microbatches
        given = {i.name: t for i, t in zip(g.inputs, inputs)}
        chunks = {n: given[n].chunk(m, dim=0) for n in self.batch if n in self.inputs_read}
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._local: dict[int, torch.Tensor] = {}
        envs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        acc: dict[str, torch.Tensor] = {}
        # the receives of the next action are posted before this one runs, so its inputs
        # arrive while this rank computes (one action ahead: 1F1B's bound on what is in
        # flight holds)
        actions = self.actions
        posted = self._post(self.segs[(actions[0][2], actions[0][0])].recvs, actions[0][1]) \
            if actions else []
        for k, (kind, mb, st) in enumerate(actions):
            env = envs.setdefault((st, mb), {})
            seg = self.segs[(st, kind)]
            self._recv(seg.recvs, mb, env, posted)
            if k + 1 < len(actions):
                nk, nmb, nst = actions[k + 1]
                posted = self._post(self.segs[(nst, nk)].recvs, nmb)
            args = [env[n] if n in env else chunks[n][mb] if n in chunks else given[n]
                    for n in seg.inputs]
            self._call(seg, args, env, (kind, mb, st), acc)
            self._send(seg.sends, mb, env)
            if kind in "BW":
                del envs[(st, mb)]
        env = {n: v / m for n, v in acc.items()}
        for r in range(self.nrounds):
            for st in self.stages:
                seg = self.segs[(st, f"U{r}")]
                self._recv(seg.recvs, m, env)
                args = [env[n] if n in env else given[n] for n in seg.inputs]
                self._call(seg, args, env, ("U", m, st))
                self._send(seg.sends, m, env)
        self._recv(list(self.writes.values()), m, env)
        for w, _ in self._pending:
            w.wait()
        self._pending = []
        out = []
        empty = torch.empty(0)
        for o in g.outputs:
            n = self.stand_in.get(o.name, o.name)
            if o.name in self.result_stage:
                out.append(self._result(o.name, env.get(n)))
            elif n in env:
                out.append(env[n])
            elif n in given:
                out.append(given[n])
            else:
                out.append(empty)
        return out

    def _result(self, name: str, value: torch.Tensor | None) -> torch.Tensor:
        """A result of the step on every rank: broadcast from the stage that made it."""
        src = self.result_stage[name]      # the rank of the stage that made it
        if src is None or self.pp.size == 1:
            return value
        t = self.types[name]
        if value is None:
            value = torch.empty(t.local_shape(dict(self.mesh.axes)),
                                dtype=DTYPE_TO_TORCH[t.dtype])
        value = value.contiguous()
        dist.broadcast(value, src=self.pp.global_rank(src), group=self.pp.group)
        return value

    # ------------------------------------------------------------------ state
    def state_dict(self, module: int = 0) -> dict[str, torch.Tensor]:
        """The whole state dict on every rank: each parameter broadcast from the lowest
        stage that holds it (a collective: every rank must call it)."""
        cap = self.captured
        slots = [s for s in cap.inputs if s.kind == "param"]
        owner = self._owners()
        by_id: dict[int, torch.Tensor] = {}
        for pi, slot in enumerate(slots):
            typ = self._param_type[pi]
            p = cap.params[pi]
            buf = p.detach().clone() if p.numel() else torch.empty(
                typ.shape, dtype=DTYPE_TO_TORCH[typ.dtype], device=p.device)
            if self.pp.size > 1:
                dist.broadcast(buf, src=self.pp.global_rank(owner[slot.name]),
                               group=self.pp.group)
            by_id[id(p)] = buf
        # a tied parameter is in the state dict under each of its names
        mod = cap.modules[module]
        named = dict(mod.named_parameters(remove_duplicate=False))
        return {k: by_id[id(named[k])] if k in named and id(named[k]) in by_id
                else v.detach().clone() for k, v in mod.state_dict().items()}

    def _owners(self) -> dict[str, int]:
        """Param name -> the lowest stage that reads it (one all_gather of a bitmap)."""
        names = [s.name for s in self.captured.inputs if s.kind == "param"]
        mine = torch.tensor([n in self.inputs_read for n in names], dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.pp.size)]
        if self.pp.size > 1:
            dist.all_gather(every, mine, group=self.pp.group)
        else:
            every = [mine]
        out = {}
        for k, n in enumerate(names):
            held = [r for r in range(len(every)) if every[r][k]]
            out[n] = held[0] if held else 0
        return out
