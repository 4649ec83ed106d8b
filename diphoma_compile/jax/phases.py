"""Phases of a traced JAX step: forward, backward, update.

A jaxpr of ``value_and_grad`` + optimizer is one flat list of equations. JAX's autodiff
names the equations it makes by transposing the forward pass (their name stack reads
``transpose(jvp(...))``); when the converter found such equations, they are the backward
pass exactly, and:

- forward: every op the loss output depends on, and the other untransposed ops the backward
  pass reads (residuals of the linearization, such as tanh's 1 - y**2);
- backward: the transposed ops (the gradients and everything computed to make them);
- update: the other ops that read a backward or update value, or feed a new parameter or
  optimizer state (the optimizer: clipping, per-row statistics such as Adafactor's, the
  moments, the new parameters, and metrics of gradients or new parameters);
- forward: the rest (metrics computed from the forward pass alone).

So the backward/update boundary is where autodiff's gradients leave it, whatever the
optimizer then computes from them. Without such marks (gradients written by hand), the
phases are told from data flow and roles alone:

1. forward: every op the loss output depends on.
2. update: reading the top-level ops backwards, an op not in the forward set that feeds a
   parameter or optimizer-state output is an update op when its users that feed such
   outputs are all update ops, and it is optimizer math: elementwise or a constant, a
   broadcast or reshape of a single element, a reduction to a single element (a global
   gradient norm), or anything that reads optimizer state. Such walks stop at the ops that
   make gradients (dot, reductions over some dims, transposes, scatters), which stay
   backward. An op that reads an update value is update too (it runs after the update:
   metrics of the new parameters).
3. backward: the remaining ops that feed a parameter or optimizer-state output, or read a
   backward value.
4. forward: the rest (metrics computed from the forward pass alone).

Without a loss output no phases are assigned. Ops inside regions take their op's phase.
Known imprecision: the sum of two gradient contributions of one parameter (a tied
embedding) is elementwise and is classed update; it is elementwise math on gradients, so
sharding it like the update is still correct.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.analysis import free_inputs
from ..ir.core import Graph, InputKind, Op, OutputKind, Phase, Region
from ..ir.ops import Category, op_def

_ELEMENTWISE = {Category.unary, Category.binary, Category.ternary, Category.cast,
                Category.constant}


def _optimizer_math(op: Op, numel: dict[str, int]) -> bool:
    cat = op_def(op.name).category
    if cat in _ELEMENTWISE:
        return True
    if op.name in ("broadcast_in_dim", "reshape"):
        return all(numel[n] == 1 for n in op.inputs)
    if cat is Category.reduce:
        return all(v.type.numel == 1 for v in op.results)
    return False


def _with_phase(op: Op, phase: Phase) -> Op:
    regions = tuple(Region(r.name, r.args, tuple(_with_phase(o, phase) for o in r.ops),
                           r.yields) for r in op.regions)
    return op.replace(phase=phase, regions=regions)


@dataclass(frozen=True)
class _Flow:
    """Who makes and who reads each value among the top-level ops (by op index)."""

    ops: tuple[Op, ...]
    reads: list[set[str]]      # the outer values each op reads (its regions' included)
    made: dict[str, int]       # result name -> index of the op making it
    numel: dict[str, int]      # element count of every input and result

    def ancestors(self, names: set[str]) -> set[int]:
        """The ops that make ``names`` and everything those read, transitively."""
        seen: set[int] = set()
        stack = [self.made[n] for n in names if n in self.made]
        while stack:
            k = stack.pop()
            if k not in seen:
                seen.add(k)
                stack.extend(self.made[n] for n in self.reads[k] if n in self.made)
        return seen

    def constants(self) -> set[int]:
        """The ops computed from no input at all (a literal, ``1 - decay``)."""
        out: set[int] = set()
        for k, names in enumerate(self.reads):
            if all(n in self.made and self.made[n] in out for n in names):
                out.add(k)
        return out

    def users(self) -> dict[int, list[int]]:
        """For each op, the ops reading one of its results."""
        users: dict[int, list[int]] = {k: [] for k in range(len(self.ops))}
        for k, names in enumerate(self.reads):
            for n in names:
                if n in self.made:
                    users[self.made[n]].append(k)
        return users


def _data_flow(graph: Graph) -> _Flow:
    """The data flow of ``graph``'s top-level ops."""
    ops = graph.ops
    numel = {i.name: i.value.type.numel for i in graph.inputs}
    numel.update((v.name, v.type.numel) for op in ops for v in op.results)
    return _Flow(ops, [free_inputs(op) for op in ops],
                 {v.name: k for k, op in enumerate(ops) for v in op.results}, numel)


def _state_outputs(graph: Graph) -> set[str]:
    """The outputs that replace a parameter or an optimizer-state input."""
    targets = {i.name for i in graph.inputs
               if i.role.kind in (InputKind.param, InputKind.opt_state)}
    return {o.name for o in graph.outputs if o.role.kind is OutputKind.replaces
            and o.role.target in targets}


def _reads_opt_state(graph: Graph, flow: _Flow) -> list[bool]:
    """For each op, whether it reads optimizer state, directly or through other ops."""
    opt_inputs = {i.name for i in graph.inputs if i.role.kind is InputKind.opt_state}
    reads_state = [False] * len(flow.ops)
    for k in range(len(flow.ops)):
        reads_state[k] = any(n in opt_inputs or (n in flow.made and reads_state[flow.made[n]])
                             for n in flow.reads[k])
    return reads_state


def _update_ops(graph: Graph, flow: _Flow, forward: set[int], feeds_state: set[int]
                ) -> set[int]:
    """The update ops of a step without autodiff's marks (rule 2 of the docstring)."""
    reads_state = _reads_opt_state(graph, flow)
    users = flow.users()
    made, numel = flow.made, flow.numel
    update: set[int] = set()
    for k in reversed(range(len(flow.ops))):
        if k in forward or k not in feeds_state:
            continue
        # Users that feed no state output (metrics of the new values, dead results) run
        # after the update and do not decide whether this op belongs to it.
        deciding = [u for u in users[k] if u in feeds_state]
        # optimizer math reads parameters, state and scalars, never a forward activation
        # (the gradient of a scalar parameter reduces activations: that is backward)
        reads_activation = any(n in made and made[n] in forward and numel[n] > 1
                               for n in flow.reads[k])
        if all(u in update for u in deciding) and not reads_activation and \
                (reads_state[k] or _optimizer_math(flow.ops[k], numel)):
            update.add(k)
    return update


def _phases_from_flow(flow: _Flow, forward: set[int], update: set[int],
                      feeds_state: set[int], const: set[int]) -> list[Phase]:
    """Each op's phase from data flow and roles (rules 1-4 of the docstring); the
    constants ``const`` give no phase to their readers."""
    phases: list[Phase] = []
    for k in range(len(flow.ops)):
        src = [phases[flow.made[n]] for n in flow.reads[k]
               if n in flow.made and flow.made[n] not in const]
        if k in forward:
            phases.append(Phase.forward)
        elif k in update or Phase.update in src:
            phases.append(Phase.update)
        elif k in feeds_state or Phase.backward in src:
            phases.append(Phase.backward)
        else:
            phases.append(Phase.forward)
    return phases


def _phases_from_marks(flow: _Flow, forward: set[int], transposed: set[str],
                       feeds_state: set[int], const: set[int]) -> list[Phase]:
    """Each op's phase from autodiff's marks: the transposed ops are the backward pass."""
    backward = {k for k, op in enumerate(flow.ops) if any(v.name in transposed
                                                          for v in op.results)}
    # the untransposed values the backward pass reads (residuals) run in the forward pass
    forward = forward | (flow.ancestors(transposed) - backward)
    phases: list[Phase] = []
    for k in range(len(flow.ops)):
        src = {phases[flow.made[n]] for n in flow.reads[k]
               if n in flow.made and flow.made[n] not in const}
        if k in forward:
            phases.append(Phase.forward)
        elif k in backward:
            phases.append(Phase.backward)
        elif src & {Phase.backward, Phase.update} or k in feeds_state:
            phases.append(Phase.update)
        else:
            phases.append(Phase.forward)
    return phases


def assign_phases(graph: Graph, transposed: set[str] | frozenset[str] = frozenset()) -> Graph:
    """``graph`` with a phase on every op, by the rules in this module's docstring;
    ``transposed`` names the results of ops autodiff made by transposition."""
    loss = {o.name for o in graph.outputs if o.role.kind is OutputKind.loss}
    if not loss:
        return graph
    flow = _data_flow(graph)
    forward = flow.ancestors(loss)
    feeds_state = flow.ancestors(_state_outputs(graph))
    const = flow.constants()
    if transposed:
        phases = _phases_from_marks(flow, forward, set(transposed), feeds_state, const)
    else:
        update = _update_ops(graph, flow, forward, feeds_state)
        phases = _phases_from_flow(flow, forward, update, feeds_state, const)
    phases = _constants_where_read(flow, phases, const, {o.name for o in graph.outputs})
    return graph.replace(ops=tuple(_with_phase(op, p) for op, p in zip(graph.ops, phases)))


_ORDER = (Phase.forward, Phase.backward, Phase.update)


def _constants_where_read(flow: _Flow, phases: list[Phase], const: set[int],
                          outputs: set[str]) -> list[Phase]:
    """A constant (computed from no input) runs in the earliest phase among the live ops
    that read it, which is its own when nothing reads it: one literal may be shared by the
    optimizer and a forward op (JAX makes ``1 - 0.9`` once for SGD's momentum and a
    BatchNorm's moving average alike), and its readers in later phases may read an earlier
    value. (A constant does not make its readers' phase either: the rules above skip it
    among what an op reads.) An op no output needs runs no earlier than what it reads."""
    users = flow.users()
    live = flow.ancestors(outputs)
    phases = list(phases)
    for k in sorted(const, reverse=True):     # a constant's readers come after it
        readers = [phases[u] for u in users[k] if u in live]
        if readers:
            phases[k] = min(readers, key=_ORDER.index)
    for k in range(len(flow.ops)):            # a dead op runs no earlier than what it reads
        if k not in live:
            phases[k] = max([phases[k]] + [phases[flow.made[n]] for n in flow.reads[k]
                                           if n in flow.made], key=_ORDER.index)
    return phases
