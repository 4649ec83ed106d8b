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


def assign_phases(graph: Graph, transposed: set[str] | frozenset[str] = frozenset()) -> Graph:
    """``graph`` with a phase on every op, by the rules in this module's docstring;
    ``transposed`` names the results of ops autodiff made by transposition."""
    loss = [o.name for o in graph.outputs if o.role.kind is OutputKind.loss]
    if not loss:
        return graph
    inputs = {i.name: i for i in graph.inputs}
    state_targets = {n for n, i in inputs.items()
                     if i.role.kind in (InputKind.param, InputKind.opt_state)}
    state_outputs = {o.name for o in graph.outputs if o.role.kind is OutputKind.replaces
                     and o.role.target in state_targets}
    opt_inputs = {n for n, i in inputs.items() if i.role.kind is InputKind.opt_state}

    ops = graph.ops
    reads = [free_inputs(op) for op in ops]
    made = {v.name: k for k, op in enumerate(ops) for v in op.results}
    numel = {i.name: i.value.type.numel for i in graph.inputs}
    numel.update((v.name, v.type.numel) for op in ops for v in op.results)
    users: dict[int, list[int]] = {k: [] for k in range(len(ops))}
    for k, names in enumerate(reads):
        for n in names:
            if n in made:
                users[made[n]].append(k)

    def ancestors(names: set[str]) -> set[int]:
        seen: set[int] = set()
        stack = [made[n] for n in names if n in made]
        while stack:
            k = stack.pop()
            if k not in seen:
                seen.add(k)
                stack.extend(made[n] for n in reads[k] if n in made)
        return seen

    forward = ancestors(set(loss))
    feeds_state = ancestors(state_outputs)
    if transposed:
        backward = {k for k, op in enumerate(ops) if any(v.name in transposed
                                                         for v in op.results)}
        residuals = ancestors(set(transposed)) - backward
        return _with_marks(graph, forward | residuals, backward, feeds_state, reads, made)
    reads_state = [False] * len(ops)
    for k in range(len(ops)):
        reads_state[k] = any(n in opt_inputs or (n in made and reads_state[made[n]])
                             for n in reads[k])

    update: set[int] = set()
    for k in reversed(range(len(ops))):
        if k in forward or k not in feeds_state:
            continue
        # Users that feed no state output (metrics of the new values, dead results) run
        # after the update and do not decide whether this op belongs to it.
        deciding = [u for u in users[k] if u in feeds_state]
        # optimizer math reads parameters, state and scalars, never a forward activation
        # (the gradient of a scalar parameter reduces activations: that is backward)
        reads_activation = any(n in made and made[n] in forward and numel[n] > 1
                               for n in reads[k])
        if all(u in update for u in deciding) and not reads_activation and \
                (reads_state[k] or _optimizer_math(ops[k], numel)):
            update.add(k)

    phases: list[Phase] = []
    for k in range(len(ops)):
        src = [phases[made[n]] for n in reads[k] if n in made]
        if k in forward:
            phases.append(Phase.forward)
        elif k in update or Phase.update in src:
            phases.append(Phase.update)
        elif k in feeds_state or Phase.backward in src:
            phases.append(Phase.backward)
        else:
            phases.append(Phase.forward)
    return graph.replace(ops=tuple(_with_phase(op, p) for op, p in zip(ops, phases)))


def _with_marks(graph: Graph, forward: set[int], backward: set[int], feeds_state: set[int],
                reads: list[set[str]], made: dict[str, int]) -> Graph:
    """Phases from autodiff's marks; ``forward`` holds the loss's ancestors and the
    residuals backward reads, ``backward`` the transposed ops."""
    ops = graph.ops
    phases: list[Phase] = []
    for k in range(len(ops)):
        src = {phases[made[n]] for n in reads[k] if n in made}
        if k in forward:
            phases.append(Phase.forward)
        elif k in backward:
            phases.append(Phase.backward)
        elif src & {Phase.backward, Phase.update} or k in feeds_state:
            phases.append(Phase.update)
        else:
            phases.append(Phase.forward)
    return graph.replace(ops=tuple(_with_phase(op, p) for op, p in zip(ops, phases)))
