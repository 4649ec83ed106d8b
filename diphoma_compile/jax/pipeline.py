"""The JAX runtime of a pipelined step: each stage on its own devices, one controller.

The ``pipeline`` pass left every op a stage and the values crossing stages as send/recv
pairs; ``passes/pipeline_programs.py`` cuts each stage into its programs (forward and
backward, run once per microbatch; the update, in rounds). Here stage s runs on the
devices whose coordinate on the pipeline axis is s (a sub-mesh: the data axis's devices of
that column), and each program is ``jax.jit`` over ``jax.shard_map`` on that sub-mesh, the
same per-device lowering as the data-parallel step (its data-parallel collectives run
inside, per microbatch). This is MPMD from one controller, as JAX runs several programs on
several devices: the controller dispatches every rank's actions in the schedule's per-rank
order (``passes/pipeline_orders.py``: GPipe, 1F1B; interleaved 1F1B and interleaved zero
bubble, whose rank r runs stages r, r + P, ... on its one column of devices; ZB-V, whose
rank r runs stages r and 2P - 1 - r), each as soon as the values it
receives have been dispatched; dispatch is asynchronous, so the stages' devices compute
concurrently, each in its schedule's order, and a value crossing stages is
``jax.device_put`` onto the receiving stage's devices (a device-to-device copy).

The user passes the global batch; each batch leaf is cut into data-parallel shares and M
microbatches (rows [d L + m b, d L + (m + 1) b) of data index d's L rows are its
microbatch m, as the torch runtime cuts a rank's local batch). Gradients and the loss are
summed over microbatches on their stage and divided by M. A stage with a count program (a
mean over a count of the batch, divided by the count summed over all microbatches) runs it
on every microbatch first and adds up what it returns, then its program T once on the sums
(their all-reduce over the data axis). Parameters and optimizer state
come back on their stage's devices (replicated over the data axis, or split where
weight-update sharding split them); a parameter read on two stages (a tied embedding) is
returned from the stage that updates it and copied to the other at the next step.

With ``donate`` (the default over a mesh, as the data-parallel step's), the last update
program of a stage that reads a parameter or optimizer-state array and makes its new value
donates it: the new value is written into the old one's buffers, so the arrays passed in
are consumed when they are in their stage's layout (the step's own results are); arrays in
another layout (the user's first ones) are copied onto the stage and left intact.

The zero-bubble schedules split each backward into its input-gradient program I (what the
gradient sent to the stage before needs) and its weight-gradient program W, which reads
what the microbatch's forward and I left; a microbatch's values on a stage are dropped
after its W (after its B otherwise). Dispatch being asynchronous, the order decides what
each column of devices queues next, not when the controller waits."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import BackendError, MeshError, no_keywords
from ..ir.core import Graph, InputKind, OutputKind
from ..ir.types import Partial, Varying
from ..passes.pipeline_orders import ORDERED, rank_orders
from ..passes.pipeline_parallel import pipeline_of, stage_rank
from ..passes.pipeline_programs import StageProgram, stage_programs
from ..report.memory import MemoryReport
from .compile import check_alive, dtype_matches, graph_function
from .layout import flat_axis
from .parallel import (MeasuredRunner, PerDeviceLowering, _global_shape, _spec, jax_mesh,
                       per_device_bytes)
from .trees import output_tree


def schedule_orders(schedule: str, ranks: int, microbatches: int, stages: int
                    ) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Each rank's actions under ``schedule``, as this runtime runs them (the written-out
    orders of ``passes/pipeline_orders.py``); what has none, or what a schedule refuses,
    is a ``BackendError``."""
    if schedule not in ORDERED:
        raise BackendError(f"the JAX pipeline runtime has no order for schedule {schedule!r}",
                           hint=f"schedule= one of {', '.join(ORDERED)}")
    try:
        return rank_orders(schedule, ranks, microbatches, stages)
    except ValueError as e:
        raise BackendError(f"the pipeline cannot run: {e}",
                           hint=f"microbatches={ranks * max(1, microbatches // ranks)}"
                                f" (a multiple of the {ranks} pipeline ranks)") from None


class JaxPipelineStep(MeasuredRunner):
    """A staged graph run over a mesh with a pipeline axis: call it like the user's step
    with the global batch; it returns the global batch's loss."""

    def __init__(self, graph: Graph, out_tree: Any = None, *, mesh: Any = None,
                 donate: bool = False) -> None:
        opts = pipeline_of(graph)
        if opts is None:
            raise BackendError("the graph was not cut into pipeline stages",
                               hint="run the pipeline pass")
        self.graph = graph
        self.out_tree = out_tree if out_tree is not None else output_tree(graph)
        self._tree_jit = None
        self.mesh = jax_mesh(mesh if mesh is not None else graph.mesh)
        self.sizes = {str(k): int(v) for k, v in self.mesh.shape.items()}
        for name, size in graph.mesh.axes:
            if self.sizes.get(name) != size:
                have = ", ".join(f"{n}={s}" for n, s in self.sizes.items())
                raise MeshError(f"the graph was partitioned for mesh axis {name}={size}, but "
                                f"the device mesh has {have}",
                                hint="run the passes with the mesh you run on")
        self.axis, self.m, self.schedule = opts.axis, opts.microbatches, opts.schedule
        self.ranks = self.sizes[self.axis]
        self.nstages = 1 + max(op.stage for op in graph.ops if op.stage is not None)
        self.types = graph.value_types()
        self.orders = schedule_orders(opts.schedule, self.ranks, self.m, self.nstages)
        self.cut = stage_programs(graph, list(range(self.nstages)), opts.schedule)
        names = tuple(self.mesh.axis_names)
        k = names.index(self.axis)
        # rank r: the devices at coordinate r of the pipeline axis (that axis size 1); stage
        # s runs on rank stage_rank(s)
        self.rank_of = [stage_rank(opts.schedule, s, self.nstages, self.ranks)
                        for s in range(self.nstages)]
        self.sub = [jax.sharding.Mesh(np.take(self.mesh.devices, [r], axis=k), names)
                    for r in range(self.ranks)]
        # parameter or optimizer-state input -> the output holding its new value
        self.new_of = {o.role.target: o.name for o in graph.outputs
                       if o.role.kind is OutputKind.replaces}
        self.donated = self._donations(graph) if donate else {}
        self.consumed = {(s, n) for (s, _), names in self.donated.items() for n in names}
        self.fns = {key: self._jit(key, prog) for key, prog in self.cut.programs.items()}
        self.count_fns = {s: self._jit((s, "C"), prog) for s, prog in self.cut.counts.items()}
        self.once_fns = {s: self._jit((s, "T"), prog) for s, prog in self.cut.once.items()}
        self.reads = {s: {n for (st, _), p in self.cut.programs.items() if st == s
                          for n in p.inputs} |
                      set(self.cut.counts[s].inputs if s in self.cut.counts else ()) |
                      set(self.cut.once[s].inputs if s in self.cut.once else ())
                      for s in range(self.nstages)}
        # what T makes that no update reads (the parameters gathered whole): let go once
        # the schedule is done
        by_update = {(s, n) for (s, k), p in self.cut.programs.items() if k.startswith("U")
                     for n in p.inputs}
        # (stage, name, the stage whose T makes it): a parameter gathered once for the
        # stages of a rank, read by a later one of them (stage_programs)
        made_by = {n: s for s, p in self.cut.once.items() for n in p.outputs}
        self.once_shared = [(s, n, made_by[n]) for s in range(self.nstages)
                            for n in sorted(self.reads[s])
                            if n in made_by and made_by[n] != s]
        self.once_dropped = [(s, n) for s, p in self.cut.once.items() for n in p.outputs
                             if (s, n) not in by_update] + \
            [(s, n) for s, n, _ in self.once_shared if (s, n) not in by_update]
        self.batch = {i.name for i in graph.inputs if i.role.kind is InputKind.batch}
        # the microbatch's index, which key draws made for every microbatch read
        # (passes/pipeline_draws.py): the runtime passes it, not the user
        self.index = next((i.name for i in graph.inputs
                           if i.role.kind is InputKind.microbatch), None)
        self._indices: dict[tuple[int, int], Any] = {}
        self._state_inputs = {i.name for i in graph.inputs
                              if i.role.kind in (InputKind.param, InputKind.opt_state)}
        self.device_count = self.mesh.size
        self._last: tuple = ()
        # (stage, name) -> the parameters and optimizer state the last step placed there
        self._held: dict[tuple[int, str], Any] = {}

    # ------------------------------------------------------------------ building
    def _sharding(self, stage: int, name: str) -> NamedSharding:
        t = self.types[name]
        if flat_axis(t) is not None:
            raise BackendError(f"%{name} is split flat ({t}); the JAX pipeline runtime runs "
                               "values split along a dimension only",
                               hint="this is a bug: parallelize plans JAX pipelines with "
                                    "weight-update sharding's layout=dims")
        axes = _own_scalar(t)
        if axes:        # each device's own scalar: one element of an array over the axes
            return NamedSharding(self.sub[self.rank_of[stage]],
                                 PartitionSpec(axes if len(axes) > 1 else axes[0]))
        return NamedSharding(self.sub[self.rank_of[stage]],
                             _spec(t, self.mesh.axis_names, f"%{name}"))

    def _donations(self, graph: Graph) -> dict[tuple[int, str], list[str]]:
        """(stage, update program) -> the parameter and optimizer-state inputs it donates:
        those it makes the new value of, in the last update round of the stage that reads
        them (an earlier round's donation would delete what a later one reads)."""
        kinds = {i.name: i.role.kind for i in graph.inputs}
        last: dict[tuple[int, str], str] = {}       # (stage, input) -> last round reading it
        for r in range(self.cut.nrounds):          # the rounds in the order they run
            for (st, kind), prog in self.cut.programs.items():
                if kind == f"U{r}":
                    for n in prog.inputs:
                        last[(st, n)] = kind
        out: dict[tuple[int, str], list[str]] = {}
        for (st, n), kind in last.items():
            if kinds.get(n) in (InputKind.param, InputKind.opt_state) and \
                    self.new_of.get(n) in self.cut.programs[(st, kind)].outputs:
                out.setdefault((st, kind), []).append(n)
        return out

    def _jit(self, key: tuple[int, str], prog: StageProgram) -> Any:
        stage = key[0]
        gone = set(self.donated.get(key, ()))
        donate = tuple(k for k, n in enumerate(prog.inputs) if n in gone)
        fn = _own_scalars_as_rows(
            graph_function(prog.graph, PerDeviceLowering(dict(self.graph.mesh.axes),
                                                         prog.graph)),
            [bool(_own_scalar(self.types[n])) for n in prog.inputs],
            [bool(_own_scalar(self.types[n])) for n in prog.outputs])
        ins = [self._sharding(stage, n) for n in prog.inputs]
        outs = [self._sharding(stage, n) for n in prog.outputs]
        body = jax.shard_map(fn, mesh=self.sub[self.rank_of[stage]],
                             in_specs=tuple(s.spec for s in ins),
                             out_specs=tuple(s.spec for s in outs), check_vma=False)
        return jax.jit(body, in_shardings=tuple(ins), out_shardings=tuple(outs),
                       donate_argnums=donate)

    # ------------------------------------------------------------------ inputs
    def _data_ways(self, name: str) -> int:
        t = self.types[name]
        return int(np.prod([self.sizes[a] for a, p in t.placements
                             if isinstance(p, Varying)], dtype=np.int64))

    def _microbatches(self, name: str, leaf: Any) -> list[Any]:
        """A global batch leaf cut into M microbatches, each a global array of the data
        axis's shares of that microbatch."""
        t = self.types[name]
        d = self._data_ways(name)
        want = (t.shape[0] * d * self.m, *t.shape[1:])
        shape = tuple(np.shape(leaf))
        if shape[:1] and shape[0] != want[0] and shape[0] % (d * self.m):
            raise MeshError(f"the global batch leaf {name} has {shape[0]} rows, which do not "
                            f"split into {d} data-parallel shares of {self.m} microbatches",
                            hint=f"use a global batch that is a multiple of {d * self.m}")
        if shape != want or not dtype_matches(getattr(leaf, "dtype", None), t.dtype):
            raise BackendError(f"batch leaf {name} is {getattr(leaf, 'dtype', None)}"
                               f"{list(shape)}; the pipelined step expects {t.dtype}"
                               f"{list(want)} ({d} data shares x {self.m} microbatches x "
                               f"{t.shape[0]} rows)",
                               hint="call it with the global arrays of the shapes it was "
                                    "parallelized for")
        x = jnp.reshape(leaf, (d, self.m, t.shape[0], *t.shape[1:]))
        return [jnp.reshape(x[:, m], (d * t.shape[0], *t.shape[1:])) for m in range(self.m)]

    def _check(self, name: str, leaf: Any) -> None:
        check_alive(name, leaf)
        t = self.types[name]
        shape = tuple(np.shape(leaf))
        if shape != _global_shape(t, self.sizes) or \
                not dtype_matches(getattr(leaf, "dtype", None), t.dtype):
            raise BackendError(f"input {name} is {getattr(leaf, 'dtype', None)}"
                               f"{list(shape)}; the pipelined step expects {t.dtype}"
                               f"{list(_global_shape(t, self.sizes))}",
                               hint="pass the parameters and optimizer state the step "
                                    "was traced with, or the ones it returned")

    # ------------------------------------------------------------------ running
    def run(self, leaves: list[Any]) -> Sequence[Any]:
        g = self.graph
        given = dict(zip((i.name for i in g.inputs), leaves))
        chunks = {n: self._microbatches(n, given[n]) for n in self.batch
                  if any(n in r for r in self.reads.values())}
        placed: dict[tuple[int, str], Any] = {}
        for s in range(self.nstages):
            for i in g.inputs:
                if i.name in self.reads[s] and i.name not in self.batch and \
                        i.name != self.index:
                    x, sharding = given[i.name], self._sharding(s, i.name)
                    if (s, i.name) in self.consumed and \
                            getattr(x, "sharding", None) != sharding:
                        # a copy: the caller's array in another layout is left alone
                        # (device_put alone may share the buffer a device already holds,
                        # and the donation would delete it)
                        x = jnp.copy(x)
                    placed[(s, i.name)] = jax.device_put(x, sharding)
        for s in range(self.nstages):
            if s in self.cut.counts:                # the counts summed over microbatches
                prog = self.cut.counts[s]
                sums: dict[str, Any] = {}
                for mb in range(self.m):
                    args = [chunks[n][mb] if n in chunks else self._index(s, mb)
                            if n == self.index else placed[(s, n)] for n in prog.inputs]
                    for n, v in zip(prog.outputs, self.count_fns[s](*args)):
                        sums[n] = v if n not in sums else sums[n] + v
                for total, (n, how) in self.cut.totals[s].items():
                    placed[(s, total)] = sums[n] / self.m if how == "avg" else sums[n]
            if s in self.cut.once:      # what the stage makes once: of the sums, gathers
                prog = self.cut.once[s]
                made = self.once_fns[s](*[placed[(s, n)] for n in prog.inputs])
                placed.update(((s, n), v) for n, v in zip(prog.outputs, made))
        for s, n, maker in self.once_shared:    # the same devices: the same array
            placed[(s, n)] = placed[(maker, n)]
        envs: dict[tuple[int, int], dict[str, Any]] = {}
        mail: dict[tuple[int, int], Any] = {}          # (tag, microbatch) -> value sent
        acc: dict[int, dict[str, Any]] = {s: {} for s in range(self.nstages)}

        def ready(key: tuple[int, str], mb: int) -> bool:
            return all((tag, mb) in mail for _, _, tag in self.cut.programs[key].recvs)

        def call(key: tuple[int, str], mb: int, env: dict, reduce: bool) -> None:
            s = key[0]
            prog = self.cut.programs[key]
            for name, _, tag in prog.recvs:
                env[name] = jax.device_put(mail.pop((tag, mb)), self._sharding(s, name))
            args = [env[n] if n in env else chunks[n][mb] if n in chunks
                    else self._index(s, mb) if n == self.index
                    else placed[(s, n)] for n in prog.inputs]
            env.update(zip(prog.outputs, self.fns[key](*args)))
            for name, _, tag in prog.sends:
                mail[(tag, mb)] = env[name]
            if reduce:
                for n in prog.acc:
                    acc[s][n] = env[n] if n not in acc[s] else acc[s][n] + env[n]

        # every rank's actions in its own order, each dispatched once what it receives
        # has been dispatched (its inputs are futures: the devices wait, not the controller)
        queues = [deque(order) for order in self.orders]
        self.dispatched: list[tuple[str, int, int]] = []
        while any(queues):
            moved = False
            for q in queues:
                while q and ready((q[0][2], q[0][0]), q[0][1]):
                    kind, mb, s = q.popleft()
                    self.dispatched.append((kind, mb, s))
                    env = envs.setdefault((s, mb), {})
                    call((s, kind), mb, env, True)
                    if kind in ("B", "W"):         # the microbatch is done on s
                        del envs[(s, mb)]
                    moved = True
            if not moved:
                raise BackendError("the pipeline schedule waits on itself",
                                   hint="this is a bug in the pipeline schedule")
        for key in self.once_dropped:
            placed.pop(key, None)
        final = {s: {n: _mean(v, self.m) for n, v in acc[s].items()}
                 for s in range(self.nstages)}
        for r in range(self.cut.nrounds):
            for s in range(self.nstages):
                call((s, f"U{r}"), self.m, final[s], False)
        made = {n: v for s in range(self.nstages) for n, v in final[s].items()}
        # what each stage holds now: a donated array's buffers hold its new value
        self._held = {k: made[self.new_of[k[1]]] if k in self.consumed else x
                      for k, x in placed.items() if k[1] in self._state_inputs}
        out = []
        for o in g.outputs:
            if o.name in made:
                out.append(made[o.name])
            elif o.name in given:
                out.append(given[o.name])
            else:
                raise BackendError(f"no stage made the step's output %{o.name}",
                                   hint="this is a bug in the pipeline programs")
        self._last = tuple(out)
        return out

    def _index(self, stage: int, mb: int) -> Any:
        """Microbatch ``mb``'s index on ``stage``'s devices (made once)."""
        key = (stage, mb)
        if key not in self._indices:
            self._indices[key] = jax.device_put(np.int32(mb),
                                                self._sharding(stage, self.index))
        return self._indices[key]

    def flatten(self, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(input leaves, the treedef of each argument); shapes are checked as the leaves
        are placed on their stages."""
        leaves, treedefs = self.leaves(args)
        for i, leaf in zip(self.graph.inputs, leaves):
            if i.name not in self.batch:
                self._check(i.name, leaf)
        return leaves, treedefs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        no_keywords(kwargs)
        leaves, treedefs = self.flatten(args)
        outs = self.run(leaves)
        if self.out_tree is not None:
            return jax.tree.unflatten(self.out_tree, outs)
        return self._by_roles(args, treedefs, outs)

    def memory_report(self) -> MemoryReport:
        """Parameter and optimizer-state bytes per device, measured from the arrays the
        last step placed on each stage's devices (a tied parameter on both of its stages);
        planned from the graph's types before the first call."""
        if not self._held:
            return super().memory_report()
        kinds = {i.name: i.role.kind for i in self.graph.inputs}
        param = [k for k in self._held if kinds[k[1]] is InputKind.param]
        state = [k for k in self._held if kinds[k[1]] is InputKind.opt_state]
        return MemoryReport(per_device_bytes([self._held[k] for k in param]),
                            per_device_bytes([self._held[k] for k in state]),
                            devices=self.device_count, measured=True)


__all__ = ["JaxPipelineStep", "schedule_orders"]


def _own_scalar(t: Any) -> tuple[str, ...]:
    """The axes along which a scalar is each device's own (made from its share of the
    batch alone: a mask's count dividing a masked mean, read by a later stage program; or
    its part of a sum over another axis: a tensor-parallel stage's part of a global
    gradient norm, summed where the last part arrives); () for any other value."""
    if t.rank:
        return ()
    return tuple(a for a, p in t.placements if isinstance(p, (Varying, Partial)))


def _own_scalars_as_rows(fn: Any, ins: Sequence[bool], outs: Sequence[bool]) -> Any:
    """``fn`` (a stage program per device) reading and returning each device's own
    scalars as arrays of one element: between programs they are global arrays of one
    element per device (a scalar has no global array to be a piece of)."""
    if not any(ins) and not any(outs):
        return fn

    def run(*args: Any) -> Any:
        got = fn(*(jnp.reshape(a, ()) if own else a for a, own in zip(args, ins)))
        return type(got)(jnp.reshape(x, (1,)) if own else x for x, own in zip(got, outs))
    return run


def _mean(total: Any, m: int) -> Any:
    """A sum over m microbatches as their mean, in its own dtype (an integer a step
    writes, as haiku's moving-average counter, stays an integer)."""
    if jnp.issubdtype(total.dtype, jnp.floating):
        return total / m
    return total if m == 1 else total // m
