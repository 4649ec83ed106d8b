"""The per-rank runtime of a pipelined torch step: this rank's stages, run on a schedule.

The ``pipeline`` pass left every op a stage and the values that cross stages as send/recv
pairs. A rank runs one stage (GPipe, 1F1B: its coordinate on the pipeline axis) or several
(interleaved: stages r, r + P, ...; zbv: r and 2P - 1 - r); each stage's ops are cut into
programs (``passes/pipeline_programs.py``), each built by ``build.py``: forward and
backward (the zero-bubble schedules: its input-gradient part I and weight-gradient part
W), run once per microbatch, and the update,
run once (in rounds when it receives from other stages' updates, as a global gradient-norm
clip does), writing new parameters and state into their storage where they are made.
Between them: the values received (``irecv``, waited for before the program
that reads them; in memory between two stages of one rank), the values sent (``isend``,
waited for at the end of the step), and what leaves the microbatches for the update or the
step's results (gradients, the loss) averaged over the microbatches. The order of the runs
is the schedule's (``pipeline_schedule.py``). Before it, a stage with a count program (a
mean over a count of the batch, which each microbatch divides by the count summed over
them all) runs it on every microbatch and adds up what it returns. Each rank passes its
whole local batch; the batch inputs are cut into M microbatches along their first
dimension. The loss and metrics are broadcast from their stage's rank, so every rank
returns the global batch's.

A rank holds only the parameters its stages read (others are emptied, as
torch.distributed.pipelining deletes other stages' modules); a tied parameter (GPT-2's
embedding and LM head) lives on both its stages, and the one that does not update it
receives the new value; a parameter no stage reads stays on the first stage's ranks.
``state_dict()`` and ``gather_optimizer_state()`` gather the whole model and optimizer
state on every rank."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ..errors import BackendError, MeshError
from ..ir.analysis import users
from ..ir.core import Graph, InputKind
from ..passes.pipeline_parallel import pipeline_of, stage_rank, updated_buffers
from ..passes.pipeline_programs import rank_stages, stage_programs
from .agreement import fingerprint
from .codegen import program
from .dist import TorchDistStep, split_axes
from .ops import DTYPE_TO_TORCH
from .pipeline_schedule import schedule_actions
from .state import Captured, Slot

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
        self.stages = rank_stages(graph)[self.pp.rank]
        self.stage = self.stages[0]         # this rank's first stage
        self.actions = schedule_actions(opts.schedule, self.nstages, opts.microbatches,
                                        self.pp.size)[self.pp.rank]
        self._cut(graph, captured)
        # seconds in this stage's programs and in whole steps: 1 - compute / wall is the
        # share this rank waited (the measured bubble, with the transfers); busy holds
        # (kind, microbatch, stage, start, end) of the last step's programs, in
        # time.perf_counter() seconds (one clock for every process of the machine)
        self.compute_s = self.wall_s = 0.0
        self.busy: list[tuple[str, int, int, float, float]] = []
        return self._run

    # ------------------------------------------------------------------ building
    def _cut(self, graph: Graph, captured: Captured) -> None:
        self.types = graph.value_types()
        cut = stage_programs(graph, self.stages, self.schedule)
        self.segs = cut.programs
        self.nrounds, self.split, self.writes = cut.nrounds, cut.split, cut.writes
        # each program the fx module, or it compiled by Inductor on its first call
        # (codegen="inductor"); the update programs write new parameters and state into
        # their storage where they are made (those stage_programs marked), the others
        # make new tensors (the executor sums microbatches)
        self.modules = {key: program(prog.graph, captured, self.comms,
                                     in_place=key[1].startswith("U"),
                                     label=f"stage {key[0]} {key[1]}")
                        for key, prog in self.segs.items()}
        self.counts, self.totals = cut.counts, cut.totals
        self.count_modules = {st: program(prog.graph, captured, self.comms, in_place=False,
                                          label=f"stage {st} C")
                              for st, prog in cut.counts.items()}
        self.once = cut.once
        self.once_modules = {st: program(prog.graph, captured, self.comms, in_place=False,
                                         label=f"stage {st} T")
                             for st, prog in cut.once.items()}
        # what T makes that no update reads (the parameters gathered whole): dropped once
        # the last backward is done
        read_by_update = {n for (_, k), prog in self.segs.items() if k.startswith("U")
                          for n in prog.inputs}
        self.once_dropped = [n for prog in cut.once.values() for n in prog.outputs
                             if n not in read_by_update]
        # the same numbering on every rank: one wire tag per (microbatch, pair)
        self.ntags = 1 + max([int(op.attrs["tag"]) for op in graph.ops
                              if op.name == "send"] + [0])
        self.inputs_read = cut.inputs_read
        # parameters no stage reads (a BERT pooler a pretraining loss never calls): the
        # first stage keeps them, so that state_dict() has their values
        read = users(graph)
        self.unread = {i.name for i in graph.inputs
                       if i.role.kind is InputKind.param and i.name not in read}
        self.batch = {i.name for i in graph.inputs if i.role.kind is InputKind.batch}
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
        # a buffer the step updates (BatchNorm's running statistics) -> the rank whose
        # stage makes its new value (the others' copies stay as they were)
        self.buffer_writer = {b: stage_rank(self.schedule, producers[new], self.nstages,
                                            self.pp.size)
                              for b, new in updated_buffers(graph).items()
                              if producers.get(new) is not None}
        self.result_stage = {o.name: (None if producers.get(o.name) is None
                                      else stage_rank(self.schedule, producers[o.name],
                                                      self.nstages, self.pp.size))
                             for o in graph.outputs if o.role.target is None}

    @property
    def compile_s(self) -> float | None:
        """Seconds Inductor spent compiling this rank's stage programs (None under fx, or
        before they ran)."""
        done = [m.compile_s for m in self.modules.values()
                if getattr(m, "compile_s", None) is not None]
        return sum(done) if done else None

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
            if not self._holds(slot.name):
                with torch.no_grad():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None

    def _held_in_pieces(self) -> list[int]:
        """Split parameters, and those of other stages (emptied)."""
        split = set(super()._held_in_pieces())
        return [pi for pi, name in enumerate(self._param_names)
                if pi in split or not self._holds(name)]

    def _piece_of(self, pi: int, t: torch.Tensor) -> torch.Tensor:
        if not self._holds(self._param_names[pi]):
            return t.new_empty(0)
        return super()._piece_of(pi, t)

    def _holds(self, name: str) -> bool:
        """Whether this rank keeps parameter ``name``: its stages read it, or no stage
        does and this is the first stage's rank."""
        return name in self.inputs_read or name in self.unread and self.pp.rank == 0

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
            self.pp._count("send", t.numel() * t.element_size())

    def _run(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        self.busy = []
        if self.calls == 1:
            self._check_same_batch(inputs)
        try:
            return self._schedule(*inputs)
        finally:
            self.wall_s += time.perf_counter() - t0

    def _whole_args(self, tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The batch inputs are cut into microbatches, not whole: their ranks compare them
        by who reads them (``_check_same_batch``)."""
        return [(n, t) for n, t in super()._whole_args(tensors) if n not in self.batch]

    def _check_same_batch(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """The ranks of one pipeline must pass the same rows: the first stage reads the
        inputs and the last the targets, and a DistributedSampler over the whole world
        gives them different ones (the step trained inputs against other examples'
        targets with no word). Compared once, on the first call: two sums of each batch
        input (the second weighted by position; NaNs counted as a number) and whether this
        rank's stages read it, all-gathered over the pp group. Refused where the inputs
        that differ are read on two ranks or more together (the inputs on one rank, the
        targets on another; noise drawn per process that two stages read); an input read
        on one rank alone may differ (an augmentation each process draws)."""
        if self.pp.size == 1:
            return
        batch = [(i.name, t) for i, t in zip(self.graph.inputs, inputs) if i.name in self.batch]
        if not batch:
            return
        device = self._device()
        mine = torch.stack([torch.cat([fingerprint(t, device), torch.tensor(
            [float(name in self.inputs_read)], dtype=torch.float64, device=device)])
            for name, t in batch])
        every = [torch.empty_like(mine) for _ in range(self.pp.size)]
        dist.all_gather(every, mine, group=self.pp.group)
        differ = [k for k in range(len(batch))
                  if any(not torch.equal(t[k, :2], every[0][k, :2]) for t in every)]
        readers = {r for k in differ for r, t in enumerate(every) if t[k, 2] > 0}
        if len(readers) < 2:
            return
        which = ", ".join(f"%{batch[k][0]}" for k in differ[:3])
        raise MeshError(
            f"the ranks of one pipeline pass different batches ({which} differ across "
            f"pp ranks {', '.join(map(str, sorted(readers)))}, which read them): the first "
            "stage reads the batch's inputs and the last its targets, so every rank of a "
            "pipeline must pass the same rows",
            hint="split the data over the data-parallel ranks only: DistributedSampler("
                 "dataset, num_replicas=<dp size>, rank=<this rank's dp coordinate>), the "
                 "same on every pp rank of a row; draw noise the step reads from a "
                 "generator seeded alike on a row's ranks")

    def _call(self, key: tuple[int, str], args: list, env: dict, what: tuple[str, int, int],
              acc: dict[str, torch.Tensor] | None = None) -> None:
        """Run one program; with ``acc``, add what leaves the microbatch (gradients, the
        loss) into the sum over microbatches, in place, as autograd accumulates into
        ``.grad`` within the backward (so it counts as the program's time)."""
        t1 = time.perf_counter()
        seg = self.segs[key]
        env.update(zip(seg.outputs, self.modules[key](*args)))
        if acc is not None:
            for n in seg.acc:
                if n not in acc:    # the first term; a copy unless the program's own
                    acc[n] = env[n] if n in seg.acc_owned else env[n].clone()
                else:
                    acc[n].add_(env[n])
        t2 = time.perf_counter()
        self.compute_s += t2 - t1
        self.busy.append((*what, t1, t2))

    def _totals(self, given: dict, chunks: dict) -> dict[str, torch.Tensor]:
        """Each stage's count program run on every microbatch, what it returns added up
        (or averaged): the ``microbatch_sum`` values its programs read; then its program T
        once (their all-reduce over the data-parallel axis; the parameters it gathers)."""
        out: dict[str, torch.Tensor] = {}
        m = self.microbatches
        for st in self.stages:
            t1 = time.perf_counter()
            if st in self.counts:
                prog = self.counts[st]
                sums: dict[str, torch.Tensor] = {}
                for mb in range(m):
                    args = [chunks[n][mb] if n in chunks else given[n] for n in prog.inputs]
                    for n, v in zip(prog.outputs, self.count_modules[st](*args)):
                        sums[n] = v.clone() if n not in sums else sums[n] + v
                for total, (n, how) in self.totals[st].items():
                    out[total] = sums[n] / m if how == "avg" else sums[n]
            if st in self.once:
                prog = self.once[st]
                args = [out[n] if n in out else given[n] for n in prog.inputs]
                out.update(zip(prog.outputs, self.once_modules[st](*args)))
            self.compute_s += time.perf_counter() - t1
        return out

    def _schedule(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        g = self.graph
        m = self.microbatches
        given = {i.name: t for i, t in zip(g.inputs, inputs)}
        chunks = {n: given[n].chunk(m, dim=0) for n in self.batch if n in self.inputs_read}
        given.update(self._totals(given, chunks))
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
            self._call((st, kind), args, env, (kind, mb, st), acc)
            self._send(seg.sends, mb, env)
            if kind in "BW":
                del envs[(st, mb)]
            # nothing here may keep a dropped microbatch's values alive (the plan's rank
            # peak, report/pipeline_peak.py, counts what the envs and sends hold)
            args = env = None
        for n in self.once_dropped:       # read by no update: not kept through it
            given.pop(n, None)
        # the sums become averages in place (each is this executor's own copy): no second
        # copy of the gradients beside them while the update runs
        env = {n: v.div_(m) if v.is_floating_point() else v if m == 1
               else v.div(m, rounding_mode="floor") for n, v in acc.items()}
        for r in range(self.nrounds):
            for st in self.stages:
                seg = self.segs[(st, f"U{r}")]
                self._recv(seg.recvs, m, env)
                args = [env[n] if n in env else given[n] for n in seg.inputs]
                self._call((st, f"U{r}"), args, env, ("U", m, st))
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
        stage that holds it (gathered there first from the pieces its data-parallel ranks
        hold, under ``shard_params``), each buffer the step updates from the stage that
        updates it (a collective: every rank must call it)."""
        cap = self.captured
        slots = [s for s in cap.inputs if s.kind == "param"]
        owner = self._owners()
        by_id: dict[int, torch.Tensor] = {}
        for pi, slot in enumerate(slots):
            typ = self._param_type[pi]
            p = cap.params[pi]
            if owner[slot.name] == self.pp.rank:    # held here: whole, or its pieces
                # (gathered along dim 1 the whole is a view of another layout: broadcast
                # sends storage, and the others would read it in theirs)
                buf = self._whole_of(p, typ).contiguous() if split_axes(typ) else \
                    p.detach().clone()
            else:
                buf = torch.empty(typ.shape, dtype=DTYPE_TO_TORCH[typ.dtype],
                                  device=p.device)
            if self.pp.size > 1:
                dist.broadcast(buf, src=self.pp.global_rank(owner[slot.name]),
                               group=self.pp.group)
            by_id[id(p)] = buf
        # a buffer the step updates: from the rank whose stage updates it
        for slot in cap.inputs:
            if slot.kind == "buffer" and slot.name in self.buffer_writer:
                b = dict(cap.modules[slot.owner].named_buffers())[slot.key[0]]
                buf = b.detach().clone()
                if self.pp.size > 1:
                    dist.broadcast(buf, src=self.pp.global_rank(self.buffer_writer[slot.name]),
                                   group=self.pp.group)
                by_id[id(b)] = buf
        # a tied parameter is in the state dict under each of its names
        mod = cap.modules[module]
        named = dict(mod.named_parameters(remove_duplicate=False))
        named.update(mod.named_buffers(remove_duplicate=False))
        return {k: by_id[id(named[k])] if k in named and id(named[k]) in by_id
                else v.detach().clone() for k, v in mod.state_dict().items()}

    def _owners(self) -> dict[str, int]:
        """Param name -> the lowest stage that reads it (one all_gather of a bitmap)."""
        names = [s.name for s in self.captured.inputs if s.kind == "param"]
        mine = torch.tensor([n in self.inputs_read for n in names], dtype=torch.uint8,
                            device=self._device())      # NCCL sends from this rank's GPU
        every = [torch.empty_like(mine) for _ in range(self.pp.size)]
        if self.pp.size > 1:
            dist.all_gather(every, mine, group=self.pp.group)
        else:
            every = [mine]
        bits = [t.tolist() for t in every]
        out = {}
        for k, n in enumerate(names):
            held = [r for r in range(len(bits)) if bits[r][k]]
            out[n] = held[0] if held else 0      # read by no stage: kept on the first
        return out

    def gather_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole optimizer state, {param name: {slot: tensor}}, on every rank, on the
        device the step computes on: each parameter's broadcast from the lowest stage that
        holds the parameter (gathered there first from its data- and tensor-parallel
        pieces). A collective: every rank must call it."""
        owner = self._owners()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for slot in self.captured.inputs:
            if slot.kind != "opt_state":
                continue
            pi, key = slot.key
            name, typ = self._param_names[pi], self._state_type[slot.key]
            # on the device the step computes on (Adam's step count lives on the CPU:
            # NCCL broadcasts from the GPU), where every rank then returns it
            if owner[name] == self.pp.rank:
                buf = self._whole_of(self._state(slot), typ).to(self._device()).contiguous() \
                    .clone()
            else:
                buf = torch.empty(typ.shape, dtype=DTYPE_TO_TORCH[typ.dtype],
                                  device=self._device())
            if self.pp.size > 1:
                dist.broadcast(buf, src=self.pp.global_rank(owner[name]), group=self.pp.group)
            out.setdefault(name, {})[key] = buf
        return out
