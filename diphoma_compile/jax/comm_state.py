"""The JAX runner of steps that carry communication state: the exact weight pieces and the
rounding keys that the quantizing passes add as inputs and outputs of the step
(``comm_state`` roles; docs/quantized.md). The user calls the step with their own pytrees;
this runner holds the state between calls, feeds it to the program and keeps what the
program returns for it, as the PyTorch runtime holds it in ``TorchDistStep.comm_state``."""

from __future__ import annotations

import functools

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..errors import BackendError
from ..ir.core import Graph, InputKind, OutputKind
from ..ir.types import DType, TensorType
from .compile import user_leaves
from .trees import check_argument_trees, input_trees
from .parallel import JaxParallelStep


def has_comm_state(graph: Graph) -> bool:
    """True when a pass added communication state to the step."""
    return any(i.role.kind is InputKind.comm_state for i in graph.inputs)


class JaxCommStateStep(JaxParallelStep):
    """A distributed step whose communication state lives here: an exact piece starts as
    the parameter's own (the weights are exact before the first step), a rounding key as
    ``seed``; ``comm_state`` holds the global arrays (pieces laid out over the mesh)."""

    def __init__(self, graph: Graph, out_tree: Any = None, *, mesh: Any = None,
                 axis: str | None = None, donate: bool = False, seed: int = 0) -> None:
        super().__init__(graph, out_tree, mesh=mesh, axis=axis, donate=donate)
        self._tree_jit = None        # the leaves are the user's plus the held state
        self.seed = int(seed)
        self.state_names = [i.name for i in graph.inputs
                            if i.role.kind is InputKind.comm_state]
        self.user_graph = graph.replace(
            inputs=tuple(i for i in graph.inputs if i.name not in self.state_names),
            outputs=tuple(o for o in graph.outputs if not self._is_state(o)))
        self.comm_state: dict[str, Any] = {}

    def _is_state(self, o: Any) -> bool:
        return o.role.kind is OutputKind.replaces and o.role.target in self.state_names

    @functools.cached_property
    def traced_trees(self) -> tuple | None:
        """The user's argument structures (the graph's less the held state), looked up once."""
        return input_trees(self.user_graph)

    def leaves(self, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(the program's input leaves: the user's, with the held state where the graph
        takes it; the treedef of each user argument)."""
        user, treedefs = user_leaves(args)
        check_argument_trees(self.traced_trees, treedefs)
        want = len(self.graph.inputs) - len(self.state_names)
        if len(user) != want:
            raise BackendError(f"the step was called with {len(user)} array leaves; it "
                               f"takes {want}",
                               hint="pass the same pytrees the step was traced with")
        by_name = dict(zip((i.name for i in self.user_graph.inputs), user))
        out, it = [], iter(user)
        for k, i in enumerate(self.graph.inputs):
            if i.role.kind is InputKind.comm_state:
                out.append(self._state(k, by_name))
            else:
                out.append(next(it))
        return out, treedefs

    def _state(self, k: int, user: dict[str, Any]) -> Any:
        i = self.graph.inputs[k]
        if i.name not in self.comm_state:
            t: TensorType = i.value.type
            if t.dtype is DType.key:
                x = jnp.asarray(self.seed & 0xFFFFFFFF, jnp.uint32)
            elif i.role.of in user:
                x = user[i.role.of]
            else:
                raise BackendError(f"communication state {i.name} has no parameter to "
                                   f"start from ({i.role.of!r})")
            self.comm_state[i.name] = jax.device_put(x, self.in_shardings[k])
        return self.comm_state[i.name]

    def _check_leaf(self, name: str, t: TensorType, want: tuple[int, ...], leaf: Any) -> None:
        if name not in self.state_names:      # the held state is this runner's own
            super()._check_leaf(name, t, want, leaf)

    def __call__(self, *args: Any) -> Any:
        leaves, treedefs = self.flatten(args)
        outs = self.run(leaves)
        user = []
        for o, x in zip(self.graph.outputs, outs):
            if self._is_state(o):
                self.comm_state[o.role.target] = x
            else:
                user.append(x)
        self._last = tuple(user)
        if self.out_tree is not None:
            return jax.tree.unflatten(self.out_tree, user)
        return self._by_roles(args, treedefs, user, self.user_graph)

    def _state_outputs(self) -> dict[InputKind, list[int]]:
        kinds = {i.name: i.role.kind for i in self.user_graph.inputs}
        found: dict[InputKind, list[int]] = {InputKind.param: [], InputKind.opt_state: []}
        for k, o in enumerate(self.user_graph.outputs):
            if o.role.kind is OutputKind.replaces and kinds.get(o.role.target) in found:
                found[kinds[o.role.target]].append(k)
        return found

    def gather_comm_state(self) -> dict[str, Any]:
        """The communication state, {input name: global array}: the exact weights of a
        quantize-weight-diff step are ``<param>.master`` (for a checkpoint)."""
        return dict(self.comm_state)

    def load_comm_state(self, state: dict[str, Any]) -> None:
        """Resume from ``gather_comm_state()``'s arrays."""
        for k, i in enumerate(self.graph.inputs):
            if i.name in state:
                self.comm_state[i.name] = jax.device_put(state[i.name], self.in_shardings[k])


__all__ = ["JaxCommStateStep", "has_comm_state"]
