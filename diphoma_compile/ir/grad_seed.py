"""Which forward values a step's backward passes differentiate.

A step may differentiate one value and return another: the sum of its losses
backpropagated and their mean per example logged, or the reverse. Data parallelism
combines the devices' gradients as the value differentiated combines over the batch (added
up for a sum, averaged for a mean), so it needs that value, not only the loss returned.

A backward pass starts from a seed, ones at the shape of the value differentiated. Traced,
the seed takes one of two forms:

- an op made from that value (torch's ``loss.backward()`` runs ``ones_like(loss)``): its
  framework rule says so (``FrameworkOpRule.seeds_gradient``), and its operand is the value;
- a constant one in the backward (JAX's ``value_and_grad``): nothing links it to the value,
  but autodiff transposes the value's last op into the seed's first reader, traced at the
  same source line with the same other operands (``loss = s / n`` gives ``ct = 1 / n``,
  ``loss = sum(x)`` gives ``broadcast(1)``, an added term passes the seed on to each
  term's last op). The value is the forward scalar that reader mirrors: the op of its
  name, or the sum a broadcast transposes, at its line, reading its other operands (the
  value may be classed backward where the step returns another: ``phases.py``).
  Several mirrors (two scalars on one line) are all returned; their kinds may disagree,
  and the caller then knows nothing.
"""

from __future__ import annotations

from .core import Graph, Op, Phase
from .framework_ops import framework_rule

# the op a reader of the seed transposes, where its name differs from it
_TRANSPOSED = {"broadcast_in_dim": "reduce_sum"}


def differentiated(graph: Graph) -> list[str] | None:
    """The forward values ``graph``'s backward passes differentiate, in program order; an
    empty list where the step has no seed of either form; None where the backward reads
    constant ones and none has a mirror (the value differentiated is not known). A
    constant one with no mirror beside one that has is taken for the backward's own math
    (``1 - y * y`` of a tanh), not a seed."""
    ops = graph.ops
    found: list[str] = []
    for op in ops:
        rule = framework_rule(op)
        if rule is not None and rule.seeds_gradient and op.phase is Phase.backward:
            found.append(op.inputs[0])
    # (a constant is made once for all its readers: the seed may be the forward's one)
    ones = {op.results[0].name for op in ops if _constant_one(op)}
    readers = [op for op in ops if op.phase is Phase.backward and ones & set(op.inputs)]
    seeded = [m for r in readers for one in ones & set(r.inputs)
              for m in _mirrors(r, one, ops)]
    found += seeded
    if readers and not found:
        return None
    return list(dict.fromkeys(found))


def _constant_one(op: Op) -> bool:
    return op.name == "full" and not op.inputs and len(op.results) == 1 and \
        op.results[0].type.rank == 0 and op.attrs.get("value") in (1, 1.0)


def _mirrors(reader: Op, seed: str, ops: list[Op]) -> list[str]:
    """The forward scalars whose last op ``reader`` (an op reading the seed) transposes."""
    others = [n for n in reader.inputs if n != seed]
    name = _TRANSPOSED.get(reader.name, reader.name)
    return [v.name for op in ops
            if op.phase is not Phase.update and op.name == name and op.loc == reader.loc
            and op is not reader
            and len(op.results) == 1 and (v := op.results[0]).type.rank == 0
            and len(op.inputs) == len(reader.inputs) and all(n in op.inputs for n in others)]
