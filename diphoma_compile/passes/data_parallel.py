"""Data parallelism: every device runs the step on its own part of the batch, and the
gradients (and the loss) are averaged across devices where they are complete.

The graph is the step traced at the *local* batch (each device's share): batch inputs become
varying (``V``, one value per device), every op that reads a varying value becomes a
per-device computation, and each varying value that the update or an output reads gets an
``all_reduce{op=avg}`` right where it is made (the end of backward for a gradient). This is
the DDP convention: the step's loss is a mean over the examples of the batch, so the mean of
the devices' gradients is the gradient of the global batch. A loss that is a sum over the
batch (``ir/batch_coupling.py``'s ``split_batch`` tells it from a mean) has its gradients
and itself added up instead (``op=sum``), and so has any returned sum over the batch.
Buffers that the forward pass updates from the batch take the average (or sum) of the
devices' values where they are linear in means (or sums) over the batch (a moving average
of a batch mean), else device 0's new value, as DDP does (a BatchNorm's variance).
A mean over a count the batch sums to (a masked mean, cross-entropy's targets not ignored)
divides by the count summed over the devices (``global_counts.py``; ``counts=local``: each
device's own, as DDP). Where the forward combines examples of the batch otherwise (a batch
norm's statistics, a contrastive loss), each device's share computes it alone, as under DDP:
the record lists those places (``ir/batch_coupling.py``) and ``parallelize`` warns of them."""

from __future__ import annotations

import re

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..ir.core import (Attrs, Graph, Input, InputKind, InputRole, Op, Output, OutputKind, Phase,
                       Value)
from ..ir.analysis import differentiates, free_inputs
from ..ir.batch_coupling import split_batch, split_notes
from ..ir.framework_ops import framework_rule
from ..ir.ops import draws_from_a_key, op_def, random_draw
from ..ir.row_probe import RowProbe
from ..ir.sharding_rules import propagate
from ..ir.types import REPLICATE, VARYING, TensorType, Varying
from .base import Pass, PassContext, PassFailure, register_pass
from .dce import dce_graph
from .global_counts import count_globally


def require_axis(graph: Graph, axis: str, pass_name: str) -> int:
    """The size of mesh axis ``axis``; PassFailure when the graph's mesh lacks it."""
    sizes = dict(graph.mesh.axes)
    if axis not in sizes:
        have = ", ".join(f"{a}={n}" for a, n in graph.mesh.axes) or "no mesh"
        hint = (f"give the mesh an axis {axis!r}, or name the axis: {pass_name}{{axis=...}}"
                if graph.mesh.axes else
                f"a graph with no mesh runs on one device (compile() makes one): plan it "
                f"over a mesh with parallelize(step, {{{axis!r}: N}}, passes=...), or, for "
                f"IR text, give its graph header a mesh[{axis}=N]")
        raise PassFailure(f"{pass_name}: the mesh has no axis {axis!r} (it has {have})",
                          hint=hint)
    return sizes[axis]


def _one_key_draw(op: Op, types: Mapping[str, TensorType]) -> bool:
    """Numbers (or keys) made from one key at the shape the op names (its framework
    rule's ``shape_attr``: JAX's random_bits, random_split)."""
    rule = framework_rule(op) if op.name == "opaque" else None
    return rule is not None and bool(rule.shape_attr) and len(op.inputs) == 1 and \
        types[op.inputs[0]].rank == 0 and len(op.results) == 1 and \
        tuple(op.attrs.get(rule.shape_attr, ())) == op.results[0].type.shape


def key_draws_per_row(graph: Graph, rows: Mapping[str, int]
                      ) -> dict[int, tuple[int, str]]:
    """Draws from a JAX key that meet a value split by the batch's rows (``rows``: value ->
    its rows' dim, ``split_batch``), through ops on whole values: id of the draw -> (the
    dim holding the rows, the value whose rows are the batch's: the draw's result, or a
    device's ``take_piece`` of it, which a pipeline keeps each microbatch's rows of). Two
    forms: bits drawn from one key at the value's own shape (a dropout mask over
    activations: flax's Dropout), and one key per example split from one key
    (``jax.random.split(key, n)``, then a draw per example under ``jax.vmap``: equinox's
    Dropout), whose keys are the batch's rows."""
    types = graph.value_types()
    src: dict[str, Op] = {}
    last: dict[int, str] = {}
    found: dict[int, tuple[int, str]] = {}
    for op in graph.ops:
        if op.regions:
            continue
        if _one_key_draw(op, types):
            src[op.results[0].name] = op
            last[id(op)] = op.results[0].name
            continue
        if op.name == "take_piece" and op.inputs[0] in src and \
                last[id(src[op.inputs[0]])] == op.inputs[0]:
            src[op.results[0].name] = src[op.inputs[0]]
            last[id(src[op.inputs[0]])] = op.results[0].name
            continue
        drawn = [n for n in op.inputs if n in src]
        # (a draw the analysis placed by rows for its use is not yet the batch's rows)
        split = [n for n in op.inputs if n in rows and n not in src]
        if drawn and split:
            shape, dim = types[split[0]].shape, rows[split[0]]
            for n in drawn:
                draw = src[n]
                made, got = types[last[id(draw)]].shape, types[n].shape
                # the value's shape, or broadcast to it along other dims than the rows
                # (``x * uniform(key, (B, 1))``: a number per example)
                fits = got == shape or len(got) == len(shape) and shape[dim] > 1 and \
                    got[dim] == shape[dim] and all(a in (b, 1) for a, b in zip(got, shape))
                if fits and (made == got or dim == 0 and made == (shape[0],)):
                    found.setdefault(id(draw), (dim if made == got else 0, last[id(draw)]))
        elif drawn:
            src.update((v.name, src[drawn[0]]) for v in op.results)
    return found


# what a refusal of a key's draws meeting per-device values suggests
_KEY_DRAW_HINT = ("turn dropout off (rate 0, or deterministic=True) for data parallelism, or "
                  "draw the random numbers outside the step and pass them in with the batch")


def _varying(t: TensorType, axis: str) -> bool:
    return isinstance(t.placement(axis), Varying)


def _sums_contributions(op: Op, ins: list[TensorType], axis: str) -> bool:
    """An update-phase sum of two per-device values (the caller checks both are gradients):
    two contributions to one gradient (a tied embedding). Averaging commutes with it, so it
    stays per device and the gradient is averaged once, after it."""
    return op.name in ("add", "sub") and len(ins) == 2 and all(_varying(t, axis) for t in ins)


def _combine(name: str, t: TensorType, made_by: dict[str, Op], types: dict[str, TensorType],
             made_in: Phase | None, kinds: Mapping[str, str], grads: str) -> str:
    """How the devices' values of a returned per-device value make the single-device value.

    A gradient (made in backward) is combined as the update's are (``grads``). A value
    the batch analysis found a sum or a mean over the batch (``kinds``, from
    ``ir/batch_coupling.py``'s ``split_batch``: a loss with ``reduction="sum"``, a count of
    correct answers; a mean, also written as a sum divided by the rows) is added up or
    averaged. A scalar made by a maximum or minimum over more than one element is combined
    by max or min (through negations, which swap them); any other scalar is averaged, as
    DDP does. A forward value that is not a scalar (per-example outputs, per-class
    statistics) and not a sum or mean over the batch is refused."""
    if made_in is Phase.backward:
        return grads
    if name in kinds:
        return kinds[name]
    if t.numel != 1:
        raise PassFailure(
            f"data-parallel: the step returns %{name}, a {list(t.shape)} value computed per "
            "device from the batch; only scalars (a mean, maximum or minimum over the batch) "
            "can be combined into the value the single-device step returns",
            hint="return scalars, or compute per-example outputs outside the step")
    op = made_by.get(name)
    negated = False
    while op is not None and op.name == "neg":      # -max is a min
        negated = not negated
        op = made_by.get(op.inputs[0])
    if op is not None and op.name in ("reduce_max", "reduce_min") and \
            types[op.inputs[0]].numel > 1:
        how = op.name.removeprefix("reduce_")
        return {"max": "min", "min": "max"}.get(how, how) if negated else how
    return "avg"


@dataclass(frozen=True)
class DataParallelRecord:
    """What data-parallel decided: the batch it split and how values leave per-device code."""

    axis: str
    batch: tuple[str, ...]                # the inputs made per-device
    averaged: tuple[str, ...]             # all-reduced (avg) where they leave per-device code
    broadcast: tuple[str, ...]            # buffers that take device 0's value
    combined: Mapping[str, str]           # returned values combined by "sum", "max", "min"
    random_per_device: tuple[str, ...]    # where per-process draws meet per-device values
    # forward ops that combine examples of the batch (ir/batch_coupling.py): the step
    # differs from the single-device one whatever the data; then those exact only when
    # every device's share counts alike (a mean over a mask's count, ignored targets)
    batch_coupled: tuple[str, ...] = ()
    batch_counted: tuple[str, ...] = ()
    # how the gradients combine: "avg", or "sum" where the loss is a sum over the batch
    gradients: str = "avg"
    # draws from a JAX key made at the global batch's shape, each device keeping its rows
    random_per_row: tuple[str, ...] = ()
    # means over counts the batch sums to, divided by the count summed over the devices
    counted_globally: tuple[str, ...] = ()
    # False: each device's share has one row and the step could not be traced at more, so
    # whether its forward combines examples was not judged (ir/batch_coupling.py)
    batch_judged: bool = True
    # True: each device's share has one row, and the batch was judged on the step traced
    # at more rows per device
    batch_probed: bool = False
    # means over counts found on that trace with no match in the step that runs (its
    # code branches on the batch's size): each device's own, and the batch not judged
    batch_unmatched: tuple[str, ...] = ()
    # False: the step has no backward (it computes no gradient), so none is averaged
    differentiates: bool = True
    # "global": means over counts divided by the count summed over the devices where the
    # pass could; "local": each device's own, as DDP (asked for: not warned of)
    counts: str = "global"

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``notes["data-parallel"]`` (docs/plan.md)."""
        return {"axis": self.axis, "batch": list(self.batch), "averaged": list(self.averaged),
                "broadcast": list(self.broadcast), "combined": dict(self.combined),
                "random_per_device": list(self.random_per_device),
                "batch_coupled": list(self.batch_coupled),
                "batch_counted": list(self.batch_counted), "gradients": self.gradients,
                "random_per_row": list(self.random_per_row),
                "counted_globally": list(self.counted_globally),
                "batch_judged": self.batch_judged, "batch_probed": self.batch_probed,
                "batch_unmatched": list(self.batch_unmatched),
                "differentiates": self.differentiates}


@register_pass
@dataclass(frozen=True)
class DataParallel(Pass):
    """Split the batch over mesh axis ``axis``; average gradients, loss and metrics there."""

    name = "data-parallel"
    axis: str = "dp"
    # "global": a mean over a count the batch sums to (a masked mean, cross-entropy's
    # targets not ignored) divides by the count summed over the devices, the batch's
    # (passes/global_counts.py); "local": by each device's own, as DDP does
    counts: str = "global"

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        require_axis(graph, self.axis, self.name)
        done = [p for p in graph.passes if p.split("{", 1)[0].strip() == self.name
                and re.search(rf"\baxis={re.escape(self.axis)}\b", p)]
        if done:
            raise PassFailure(f"data-parallel: the graph is data parallel over "
                              f"{self.axis!r} already (its passes hold {done[0]})",
                              hint="run data-parallel once for an axis")
        if self.counts not in ("global", "local"):
            raise PassFailure(f"data-parallel: counts={self.counts!r}",
                              hint="counts=global (the batch's count) or counts=local "
                                   "(each device's, as DDP)")
        # dead reads must not sync anything (traced views leave dead update ops behind)
        split = _Split(dce_graph(graph), self.axis, ctx.batch_probe, ctx.traced)
        for op in split.graph.ops:
            split.place(op)
        split.combine_outputs()
        out = split.insert_syncs()
        counted = list(split.analysis.counted) \
            if self.counts == "global" and split.grads == "avg" else []
        out, made = count_globally(out, counted, self.axis, split.n, split.analysis.rows)
        exact = {id(x) for c in made for x in (c.coupling, *c.shifts)}
        ctx.decisions[self.name] = replace(
            split.record(*split_notes([c for c in split.analysis.couplings
                                       if id(c) not in exact])),
            counted_globally=tuple(dict.fromkeys(str(c.coupling) for c in made)),
            batch_judged=split.analysis.judged, batch_probed=split.analysis.probed,
            batch_unmatched=split.analysis.unmatched, counts=self.counts)
        return out


class _Split:
    """One run of data-parallel: the per-device types and sync decisions its steps share."""

    def __init__(self, graph: Graph, axis: str, probe: RowProbe | None = None,
                 traced: Graph | None = None) -> None:
        self.graph, self.ax = graph, axis
        self.batch = [i.name for i in graph.inputs if i.role.kind is InputKind.batch]
        self.rows = {i.value.type.shape[0] for i in graph.inputs
                     if i.role.kind is InputKind.batch and i.value.type.rank}
        self.param_shapes = {i.value.type.shape for i in graph.inputs
                             if i.role.kind is InputKind.param}
        if not self.batch:
            raise PassFailure("data-parallel: the step has no batch input to split",
                              hint="pass the batch as an argument of the step (not a "
                                   "closure or a global)")
        self.types: dict[str, TensorType] = {}
        self.inputs: list[Input] = []
        for i in graph.inputs:
            t = i.value.type
            if i.role.kind is InputKind.batch:
                t = t.with_placement(axis, VARYING)
                i = type(i)(Value(i.name, t), i.role)
            self.types[i.name] = t
            self.inputs.append(i)
        self.names = graph.fresh_names()      # for the values this pass adds
        self.need: dict[str, str] = {}        # varying name -> how it is synchronized
        self.ops: list[Op] = []
        self.made_in: dict[str, Phase] = {n: Phase.forward for n in self.batch}  # varying
        self.returned = {o.name for o in graph.outputs
                         if o.role.kind in (OutputKind.loss, OutputKind.metric)}
        self.drawn: dict[str, str] = {}       # values computed from random draws -> how drawn
        self.random_ops: list[str] = []       # per-process draws that meet per-device values
        self.updated: set[str] = set()        # what update ops make (new params, late metrics)
        self.constant: set[str] = set()       # update values computed from no input
        # returned sums and means over the batch; a loss that is a sum over the batch
        # (reduction="sum") has gradients that add up across devices, not average
        self.analysis = split_batch(graph, probe, traced)
        loss = next((o.name for o in graph.outputs if o.role.kind is OutputKind.loss), None)
        # the gradients combine as the value differentiated does, where the backward shows
        # which it is, else as the loss returned
        kind = self.analysis.gradients or self.analysis.combine.get(loss)
        self.grads = "sum" if kind == "sum" else "avg"
        self.n = dict(graph.mesh.axes)[axis]
        self.draws_by_row = self.key_draws_per_row()
        self.pieces: list[str] = []           # key draws each device takes its rows of

    def key_draws_per_row(self) -> dict[int, int]:
        """Draws from a JAX key that meet a value split by the batch's rows (the module's
        ``key_draws_per_row``): id of the draw -> the dim holding the rows. Each device
        makes them at the global batch's shape and keeps its own rows, the numbers the
        single-device step draws for them."""
        return {k: dim for k, (dim, _) in
                key_draws_per_row(self.graph, self.analysis.rows).items()}

    def draw_per_row(self, op: Op, dim: int) -> Op:
        """The draw made at the global batch's shape (rows times the axis size), then this
        device's piece of its rows as the value the step reads."""
        (res,) = op.results
        t = res.type
        shape = tuple(k * self.n if d == dim else k for d, k in enumerate(t.shape))
        whole = Value(self.names(f"{res.name}.all"), t.with_shape(shape))
        attr = framework_rule(op).shape_attr
        self.ops.append(op.replace(attrs=Attrs({**op.attrs, attr: list(shape)}),
                                   results=(whole,)))
        self.types[whole.name] = whole.type
        self.pieces.append(op.loc or res.name)
        return Op("take_piece", (whole.name,), (Value(res.name, t.with_placement(self.ax,
                                                                                 VARYING)),),
                  Attrs(axis=self.ax, dim=dim), phase=op.phase, loc=op.loc)

    # 1. every op before the update that reads a per-device value computes per device;
    #    the update reads averaged values instead (step 2)
    def place(self, op: Op) -> None:
        """Place one op of the step: per device, or reading synced values in the update."""
        ins = [self.types[n] for n in op.inputs]
        draws = random_draw(op)
        if id(op) in self.draws_by_row:
            op = self.draw_per_row(op, self.draws_by_row[id(op)])
            self.made_in.update((v.name, Phase.forward) for v in op.results)
            self.types.update((v.name, v.type) for v in op.results)
            self.ops.append(op)
            return
        was = op.phase
        op = self.phase_of(op, ins)
        if was is Phase.update and op.phase is Phase.forward:
            self.constants_to_forward(free_inputs(op))
        varying = any(_varying(self.types[n], self.ax) for n in free_inputs(op))
        # (the loss and metrics the step returns are read synced, as returned)
        own = any(_varying(self.types[n], self.ax) and n not in self.returned
                  for n in free_inputs(op))
        if op.phase is Phase.update and not (own and self.after_update(op)):
            self.read_synced(op, ins)
            if any(n not in self.constant for n in free_inputs(op)):
                self.updated.update(v.name for v in op.results)
            else:       # a constant the update uses (2.0 in loss * 2.0): not a new value
                self.constant.update(v.name for v in op.results)
        elif varying:
            # (a region may read a per-device value it captures, not only its operands)
            op = self.per_device(op, ins, draws)
        self.follow_draws(op, ins, draws)
        self.types.update((v.name, v.type) for v in op.results)
        self.ops.append(op)

    def constants_to_forward(self, names: list[str]) -> None:
        """The update's constants a late metric reads (the 0 of ``(y != 0).sum()`` after
        the optimizer step) run in forward with it: a forward op reads nothing later."""
        wanted = {n for n in names if n in self.constant}
        for k, o in enumerate(self.ops):
            if wanted & {v.name for v in o.results}:
                self.ops[k] = o.replace(phase=Phase.forward)

    def after_update(self, op: Op) -> bool:
        """An update op reading the batch's values and the new parameters: the model run
        again after the optimizer step for a metric (``with torch.no_grad(): model(x)``),
        per-device work after the update, combined where it is returned."""
        ins = free_inputs(op)
        return any(n in self.updated for n in ins) and not any(
            self.made_in.get(n) is Phase.backward for n in ins)

    def phase_of(self, op: Op, ins: list[TensorType]) -> Op:
        """The op in the phase it runs in: gradient-part sums and late metrics are per device."""
        ax = self.ax
        if op.phase is Phase.update and _sums_contributions(op, ins, ax) and \
                all(self.made_in.get(n) is Phase.backward for n in op.inputs):
            # (not a metric of the new parameters on the batch: f(new, x) - y)
            op = op.replace(phase=Phase.backward)
        if op.phase is Phase.update:
            # the loss or a metric the update reads (Polyak step sizes, plateau
            # schedules, scaling by the loss) is read synced, as the step returns it
            kinds = {self.made_in.get(n) for n, t in zip(op.inputs, ins)
                     if _varying(t, ax) and n not in self.returned}
            if Phase.forward in kinds and Phase.backward in kinds:
                raise PassFailure("data-parallel: an op after backward reads both a "
                                  "per-device forward value and a gradient", op=op,
                                  hint="compute metrics of the batch and the update "
                                       "apart")
            if Phase.forward in kinds and not self.after_update(op):
                # a metric of the batch computed after backward (accuracy, the largest
                # logit): it is per-device work, combined where it is returned
                op = op.replace(phase=Phase.forward)
        return op

    def read_synced(self, op: Op, ins: list[TensorType]) -> None:
        """An update op reads the averaged value of every per-device value it reads."""
        if op.regions and any(n in self.batch for n in free_inputs(op)):
            raise PassFailure(
                f"data-parallel: the optimizer update runs {op.name} over the batch (a "
                "line search, as optax.lbfgs's, evaluates the loss again inside it for each "
                "step size it tries): the update runs on values averaged over the devices, "
                "and cannot evaluate the model on each device's share there", op=op,
                hint="use an update that does not evaluate the model (optax.lbfgs("
                     "linesearch=None) with a step size), or run the step on one device")
        for n, t in zip(op.inputs, ins):
            if n in self.batch:
                raise PassFailure(f"data-parallel: the optimizer update reads the "
                                  f"batch input %{n} directly", op=op,
                                  hint="the update may read gradients, parameters "
                                       "and optimizer state, not the batch")
            if _varying(t, self.ax):
                # (summed over its examples first, or weighted by whole values, it
                # averages as their sum does: a mean of microbatches' gradients)
                summed = op.name == "reduce_sum" and 0 in tuple(op.attrs.get("dims", ())) \
                    or op.name == "dot" and not any(
                        _varying(u, self.ax) for x, u in zip(op.inputs, ins) if x != n)
                if self.made_in.get(n) is Phase.backward and self.per_example(t) and \
                        not summed:
                    raise PassFailure(
                        f"data-parallel: the optimizer update reads %{n} ({t.shape}), a "
                        "gradient per example of the batch (jax.vmap of jax.grad: DP-SGD, "
                        "per-example clipping): averaging it over the devices would "
                        "average different examples' gradients together", op=op,
                        hint="sum or average the per-example gradients over their examples "
                             "inside the step before the optimizer reads them, or run the "
                             "step on one device")
                self.need.setdefault(n, self.grads if self.made_in.get(n) is Phase.backward
                                     else self.analysis.combine.get(n, "avg"))

    def per_example(self, t: TensorType) -> bool:
        """A value shaped as a parameter with the batch's rows before it (the gradient of
        each example: ``jax.vmap(jax.grad(...))``), and not as a parameter itself (a
        [16, 64] weight's gradient beside a [64] bias at 16 rows a device)."""
        return t.rank >= 1 and t.shape[0] in self.rows and t.shape[1:] in self.param_shapes \
            and t.shape not in self.param_shapes

    def per_device(self, op: Op, ins: list[TensorType], draws: str | None) -> Op:
        """The op run per device: its results placed by the op's sharding rule."""
        ax = self.ax
        self.check_random(op, ins, draws)
        if op.regions:
            return self.per_device_regions(op)
        outs = [v.type for v in op.results]
        got = propagate(op, ins, outs, ax, op_def(op.name).sharding_rule)
        if got is None:
            raise PassFailure(f"data-parallel: {op.name} mixes per-device and split "
                              "values", op=op)
        op = op.replace(results=tuple(Value(v.name, v.type.with_placement(ax, p))
                                      for v, p in zip(op.results, got)))
        # (an update-phase op here is a metric after the update: a forward value)
        self.made_in.update((v.name, Phase.backward if op.phase is Phase.backward
                             else Phase.forward) for v in op.results)
        if op.phase is Phase.update:
            self.updated.update(v.name for v in op.results)
        return op

    def per_device_regions(self, op: Op) -> Op:
        """A lax.scan over per-device values (layers scanned over the activations in
        forward, its transpose in backward): it runs on each device's own values, as the
        ops outside it do. Inside its body a value is per device when it is computed from
        one (the body's carry until that settles); its results are per device where its
        yields are. A carry that starts replicated and becomes per device (a shared
        weight's gradient summed over the iterations from zeros) enters through
        ``as_varying``, each device's own copy. Refused: a key's draws inside (they would
        repeat on every device, as outside) and other control flow (while, cond) over
        per-device values."""
        hint = "trace the step without lax.while_loop/cond over batch data"
        if op.name != "scan" or any(o.regions for o in op.regions[0].ops):
            raise PassFailure(f"data-parallel: {op.name} with nested regions reads the "
                              "batch; per-device control flow other than a flat lax.scan "
                              "is not supported yet", op=op, hint=hint)
        if draws_from_a_key(op):
            raise PassFailure(
                f"data-parallel: random numbers drawn from a JAX key inside {op.name} meet "
                "per-device values (dropout in a scanned layer): every device would draw "
                "them from the same key, repeating one another's masks", op=op,
                hint=_KEY_DRAW_HINT)
        drawn = [n for n in free_inputs(op) if self.drawn.get(n) == "key"]
        if drawn:
            raise PassFailure(
                f"data-parallel: {op.name} over per-device values reads %{drawn[0]}, drawn "
                "from a JAX key (dropout masks made outside the scan, passed in): every "
                "device would use the same numbers, repeating one another's masks", op=op,
                hint=_KEY_DRAW_HINT)
        ax, body = self.ax, op.regions[0]
        nc, nk = op.attrs.get("num_consts", 0), op.attrs["num_carry"]
        ins = [_varying(self.types[n], ax) for n in op.inputs]
        captured = {n for n in free_inputs(op) if _varying(self.types[n], ax)}
        while True:
            v = captured | {a.name for a, var in zip(body.args, ins) if var}
            for o in body.ops:
                if any(n in v for n in free_inputs(o)):
                    v.update(r.name for r in o.results)
            grown = [k for k in range(nk) if body.yields[k] in v and not ins[nc + k]]
            if not grown:
                break
            for k in grown:
                ins[nc + k] = True
        operands = list(op.inputs)
        for k in range(nk):
            name = operands[nc + k]
            if ins[nc + k] and not _varying(self.types[name], ax):
                # a carry that starts the same everywhere and becomes per device in the
                # body (a weight every iteration reads: its gradient summed over the
                # iterations from replicated zeros) enters as this device's own copy
                v_name = self.names(f"{name}.v")
                t = self.types[name].with_placement(ax, VARYING)
                self.ops.append(Op("as_varying", (name,), (Value(v_name, t),),
                                   Attrs(axis=ax), phase=op.phase, loc=op.loc))
                self.types[v_name] = t
                operands[nc + k] = v_name
        op = op.replace(inputs=tuple(operands))

        def typed(val: Value, var: bool) -> Value:
            return Value(val.name, val.type.with_placement(ax, VARYING)) if var else val
        args = tuple(typed(a, var) for a, var in zip(body.args, ins))
        ops = [o.replace(results=tuple(typed(r, r.name in v) for r in o.results))
               for o in body.ops]
        yields = list(body.yields)
        arg_type = {a.name: a.type for a in body.args}
        made = {r.name: r.type for o in body.ops for r in o.results}
        for k in range(nk):          # a per-device carry whose body yields a whole value
            if ins[nc + k] and yields[k] not in v:
                t = (made.get(yields[k]) or arg_type.get(yields[k]) or self.types[yields[k]])
                name = self.names(f"{yields[k]}.v")
                ops.append(Op("as_varying", (yields[k],),
                              (Value(name, t.with_placement(ax, VARYING)),), Attrs(axis=ax),
                              phase=op.phase, loc=op.loc))
                yields[k] = name
                v.add(name)
        yv = [y in v for y in yields]
        results = tuple(typed(r, yv[k]) for k, r in enumerate(op.results))
        op = op.replace(regions=(body.replace(args=args, ops=tuple(ops),
                                              yields=tuple(yields)),), results=results)
        self.made_in.update((r.name, Phase.forward if op.phase is Phase.forward
                             else Phase.backward) for r, var in zip(op.results, yv) if var)
        return op

    def check_random(self, op: Op, ins: list[TensorType], draws: str | None) -> None:
        """Note per-process draws that meet per-device values; refuse draws from a JAX key."""
        # randomness per element of a per-device value (a dropout mask: a draw of
        # the value's own shape); weights with noise drawn at their own shape are
        # the same on every device, as on one
        shape = op.results[0].type.shape if op.results else None
        source = draws or next(
            (self.drawn[n] for n, t in zip(op.inputs, ins) if n in self.drawn
             and t.numel > 1 and t.shape == shape), None)
        if source == "global":
            # drawn from each process's own generator, as under DDP: the masks
            # are per device, right in distribution but not the global batch's;
            # the plan says so
            self.random_ops.append(op.loc or op.name)
        elif source == "key" and not (draws == "key" and all(
                _varying(t, self.ax) for t in ins)):
            # (a draw from each device's own keys, split per example: its own numbers)
            raise PassFailure(
                "data-parallel: random numbers drawn from a JAX key meet per-device "
                "values here (dropout, noise on activations): every device would "
                "draw them from the same key at its own share's shape, so the "
                "devices would repeat one another's masks instead of drawing the "
                "global batch's; per-device random draws are not supported yet",
                op=op,
                hint=_KEY_DRAW_HINT)

    def follow_draws(self, op: Op, ins: list[TensorType], draws: str | None) -> None:
        """Remember which values are random draws, through ops on whole values."""
        # a draw stays a draw through ops on whole values (scaling, adding to weights);
        # what it computes with per-device values is per-device data
        if not any(_varying(t, self.ax) for t in ins):
            source = draws or next((self.drawn[n] for n in op.inputs if n in self.drawn),
                                   None)
            if source:
                self.drawn.update((v.name, source) for v in op.results)

    # 2. where a per-device value leaves per-device code, combine it across devices:
    #    the loss and metrics as their last reduction over the batch says
    def combine_outputs(self) -> None:
        """Decide how each per-device output is synced; only floats can be averaged."""
        roles = {i.name: i.role for i in self.inputs}
        made_by = {v.name: op for op in self.ops for v in op.results}
        for o in self.graph.outputs:
            if _varying(self.types[o.name], self.ax):
                self.combine_output(o, roles, made_by)
        for n, how in self.need.items():
            if how == "avg" and not self.types[n].dtype.is_float:
                at = made_by.get(n)
                at = f" (made at {at.loc})" if at is not None and at.loc else ""
                raise PassFailure(f"data-parallel: the {self.types[n].dtype} value %{n}{at} is "
                                  "computed from the batch and leaves the per-device part of "
                                  "the step; only floating-point values can be averaged "
                                  "across devices",
                                  hint="return it as a float, or compute it outside the step")

    def combine_output(self, o: Output, roles: dict[str, InputRole],
                       made_by: dict[str, Op]) -> None:
        """How one per-device output is synced: broadcast, averaged, max or min."""
        types, need = self.types, self.need
        if o.role.kind is OutputKind.replaces and \
                roles[o.role.target].kind is InputKind.buffer:
            # linear in sums or means over the batch (a moving average of a batch mean, a
            # running total of the loss): added up or averaged, the single-device value;
            # else device 0's, as DDP keeps a BatchNorm's statistics
            need[o.name] = self.analysis.combine.get(o.name, "root0")
        elif o.role.kind is OutputKind.replaces and o.name not in need and \
                roles[o.role.target].kind in (InputKind.param, InputKind.opt_state):
            if self.gradients_in_a_scan():
                raise PassFailure(
                    f"data-parallel: the gradients reaching %{o.role.target} are computed "
                    "inside a lax.scan (gradient accumulation over microbatches?): the "
                    "trace has no backward pass outside it, so they cannot be told from "
                    "other values of the batch to average",
                    hint="accumulate over the microbatches with a Python loop (each "
                         "jax.value_and_grad traced), or across calls with "
                         "optax.MultiSteps, or take one value_and_grad of the whole batch "
                         "(data parallelism already splits it)")
            if not any(out.role.kind is OutputKind.loss for out in self.graph.outputs):
                raise PassFailure(
                    "data-parallel: the step returns no loss (a scalar float among its "
                    "results), so its ops cannot be told apart into forward, backward and "
                    f"update, nor the gradients reaching %{o.role.target} found to average",
                    hint="return the loss the gradients are of after the new parameters "
                         "and optimizer state, (params, opt_state, loss, *metrics): the "
                         "first scalar float, or one named loss in a dict of metrics")
            raise PassFailure(f"data-parallel: the new value of %{o.role.target} is "
                              "computed from the batch outside backward (the optimizer "
                              "reads a forward value or the batch itself)",
                              hint="the update may read gradients, parameters and "
                                   "optimizer state, not the batch")
        elif o.role.kind in (OutputKind.loss, OutputKind.metric):
            need[o.name] = _combine(o.name, types[o.name], made_by, types,
                                    self.made_in.get(o.name), self.analysis.combine,
                                    self.grads)
        else:
            need.setdefault(o.name, self.grads)

    def gradients_in_a_scan(self) -> bool:
        """No backward op outside control flow, and a scan in the forward pass: autodiff
        ran inside the scan's body (its ops take the scan's phase)."""
        ops = self.graph.ops
        return not any(op.phase is Phase.backward for op in ops) and \
            any(op.name == "scan" and op.phase is Phase.forward for op in ops)

    # 3. the collectives, each right where its value is made
    def insert_syncs(self) -> Graph:
        """The graph with a collective after each value that leaves per-device code."""
        names = self.names
        made: dict[str, str] = {}
        out_ops: list[Op] = []
        for n in self.need:
            if n in self.types and any(i.name == n for i in self.inputs):
                out_ops.append(self.sync(n, None, names(self.sync_name(n))))
                made[n] = out_ops[-1].results[0].name
        for op in self.ops:
            if made:
                renamed = tuple(made.get(n, n) for n in op.inputs)
                if renamed != op.inputs and op.phase is Phase.update:
                    op = op.replace(inputs=renamed)
            out_ops.append(op)
            for v in op.results:
                if v.name in self.need:
                    out_ops.append(self.sync(v.name, op, names(self.sync_name(v.name))))
                    made[v.name] = out_ops[-1].results[0].name
        outputs = tuple(type(o)(made.get(o.name, o.name), o.role) for o in self.graph.outputs)
        return self.graph.replace(inputs=tuple(self.inputs), ops=tuple(out_ops),
                                  outputs=outputs)

    def sync_name(self, n: str) -> str:
        """The name hint of the synced value of ``n``: ``n.avg``, ``n.max``, ``n.bcast``."""
        how = self.need[n]
        return f"{n}.{how if how != 'root0' else 'bcast'}"

    def sync(self, n: str, at: Op | None, new: str) -> Op:
        """The collective that makes ``new``, the synced ``n``, where ``at`` made ``n``."""
        how = self.need[n]
        reduce = how != "root0"
        attrs = Attrs(axis=self.ax, op=how) if reduce else Attrs(axis=self.ax, root=0)
        kind = "all_reduce" if reduce else "broadcast"
        phase = at.phase if at is not None else Phase.backward
        # the value is whole on this axis now; its placements on other axes stay
        t = self.types[n].with_placement(self.ax, REPLICATE)
        return Op(kind, (n,), (Value(new, t),), attrs,
                  phase=phase, loc=at.loc if at is not None else None)

    def record(self, coupled: tuple[str, ...], counted: tuple[str, ...]
               ) -> DataParallelRecord:
        """What this run decided, for the plan (with ``split_notes``' two lists)."""
        need = self.need
        returned = {o.name for o in self.graph.outputs}
        return DataParallelRecord(
            axis=self.ax, batch=tuple(self.batch),
            averaged=tuple(n for n, how in need.items() if how == "avg"),
            broadcast=tuple(n for n, how in need.items() if how == "root0"),
            combined={n: how for n, how in need.items() if how in ("sum", "max", "min")
                      and n in returned},
            random_per_device=tuple(sorted(set(self.random_ops))),
            batch_coupled=coupled, batch_counted=counted, gradients=self.grads,
            random_per_row=tuple(sorted(set(self.pieces))),
            differentiates=self.gradients_in_a_scan() or differentiates(self.graph))
