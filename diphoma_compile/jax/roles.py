"""The step convention for JAX: value names from pytree paths, input and output roles.

A step is ``step(params, opt_state, batch, *rest) -> (params, opt_state, *metrics)`` over
pytrees of arrays; which argument is which can be overridden (``StepSignature``), and for
``parallelize`` the later arguments with the batch's rows are batch too
(``infer_batch_argnums``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path, tree_structure

from ..errors import FrontendError
from ..ir.core import Input, InputKind, InputRole, NameSupply, OutputKind, OutputRole, Value
from .dtypes import ir_type, is_key_dtype


@dataclass(frozen=True)
class StepSignature:
    """Which positional arguments of the step hold parameters, optimizer state and batch."""

    params_argnum: int = 0
    opt_state_argnum: int = 1
    batch_argnums: tuple[int, ...] = (2,)

    def check(self, nargs: int) -> None:
        """FrontendError unless the argument numbers are distinct and within ``nargs``."""
        nums = [self.params_argnum, self.opt_state_argnum, *self.batch_argnums]
        if len(set(nums)) != len(nums):
            raise FrontendError(f"argument numbers {nums} repeat an argument; expected "
                                "distinct positions for params, opt_state and batch")
        bad = [n for n in nums if not 0 <= n < nargs]
        if bad:
            raise FrontendError(
                f"the step was given {nargs} example argument(s), but argument number(s) "
                f"{bad} are named as params/opt_state/batch",
                hint="call trace(step, params, opt_state, batch, *rest), or pass "
                     "params_argnum=, opt_state_argnum=, batch_argnums=")

    def prefix(self, argnum: int) -> str:
        """The name prefix of argument ``argnum``: params, opt_state, batch or argN."""
        if argnum == self.params_argnum:
            return "params"
        if argnum == self.opt_state_argnum:
            return "opt_state"
        if argnum in self.batch_argnums:
            return "batch" if len(self.batch_argnums) == 1 else \
                f"batch{self.batch_argnums.index(argnum)}"
        return f"arg{argnum}"


def path_name(prefix: str, path: Sequence[Any]) -> str:
    """``prefix/a/0/b`` for the key path (a, 0, b); just ``prefix`` for the root."""
    return f"{prefix}/{keystr(tuple(path), simple=True, separator='/')}" if path else prefix


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


_NUMBERS = (bool, int, float, complex)


def number_as_array(x: Any) -> Any:
    """A Python number (a learning rate, a scale, a step count) as the weakly typed scalar
    array jax.jit traces it as: its type gives way to the arrays it meets (a bf16 value
    times 0.5 stays bf16); any other leaf as it is."""
    return jnp.asarray(x) if isinstance(x, _NUMBERS) else x


def numbers_as_arrays(args: Sequence[Any]) -> tuple:
    """``args`` with each Python number leaf as ``number_as_array`` makes it."""
    return tuple(jax.tree.map(number_as_array, a) for a in args)


def arg_leaves(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    """(name, leaf) of every leaf of one argument; FrontendError for a non-array leaf."""
    out = []
    for path, leaf in tree_flatten_with_path(tree)[0]:
        name = path_name(prefix, path)
        if not _is_array(leaf):
            raise FrontendError(
                f"step argument leaf {name} is a {type(leaf).__name__} ({str(leaf)[:40]!r}); "
                "expected arrays (jax.Array or numpy.ndarray) or numbers at every leaf",
                hint="bind settings that are not arrays or numbers with functools.partial "
                     "before tracing")
        out.append((name, leaf))
    return out


def _is_key_like(leaf: Any) -> bool:
    """A PRNG key: a typed key array, or the legacy uint32[2] of jax.random.PRNGKey."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and (is_key_dtype(dtype) or (
        np.dtype(dtype) == np.uint32 and tuple(np.shape(leaf)) == (2,)))


def _describe_leaf(leaf: Any) -> str:
    return f"{getattr(leaf, 'dtype', type(leaf).__name__)}{list(np.shape(leaf))}"


def batch_rows(batch: Any) -> int | None:
    """The batch's number of rows: its first leaf's leading dimension (None: no rows)."""
    leaves = jax.tree.leaves(batch)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) >= 1 else None


def infer_batch_argnums(args: Sequence[Any], first: int = 2, state: Sequence[int] = ()
                        ) -> tuple[int, ...]:
    """The batch arguments of ``step(params, opt_state, batch, *rest)`` by shape: argument
    ``first``, and every later argument whose array leaves all have its first leaf's
    number of rows. A later argument of keys and single numbers (a learning rate, a step
    count) is not batch; anything else (other rows, a mix) is a FrontendError naming it.

    Keys are settings unless they have the batch's rows (one key per example); so is a
    legacy uint32[2] key, unless the batch has 2 rows. ``state`` arguments (the step
    returns their new value: ``returned_state``) are not batch; the batch then starts at
    the first argument from ``first`` that is not state. ``parallelize`` then checks that
    each argument found this way does pair with the batch's rows (jax/framework.py)."""
    while first in state and first + 1 < len(args):
        first += 1
    rows = batch_rows(args[first]) if len(args) > first else None
    if rows is None:
        return (first,)            # the batch's own check says what is wrong with it
    nums = [first]
    for k in range(first + 1, len(args)):
        if k in state:
            continue
        kinds: dict[str, list[str]] = {"rows": [], "setting": [], "other": []}
        for path, leaf in tree_flatten_with_path(args[k])[0]:
            name = path_name(f"argument {k}", path)
            shape = tuple(np.shape(leaf))
            if not _is_array(leaf) or (_is_key_like(leaf) and shape != (rows,)) \
                    or math.prod(shape) == 1:
                kinds["setting"].append(name)
            elif len(shape) >= 1 and shape[0] == rows:
                kinds["rows"].append(name)
            else:
                kinds["other"].append(f"{name} ({_describe_leaf(leaf)})")
        if kinds["rows"] and not kinds["setting"] and not kinds["other"]:
            nums.append(k)
        elif kinds["rows"] or kinds["other"]:
            what = (f"{kinds['other'][0]} has a leading dimension other than the batch's "
                    f"{rows} rows and is not a key or a single number" if kinds["other"] else
                    f"{kinds['rows'][0]} has the batch's {rows} rows but "
                    f"{kinds['setting'][0]} is a single number or a key")
            raise FrontendError(
                f"cannot tell whether step argument {k} is part of the batch (split over the "
                f"devices) or a value every device takes whole: {what}",
                hint=f"pass batch_argnums= to parallelize: ({first}, {k}) to split it with "
                     f"the batch, or ({first},) to give it whole to every device")
    return tuple(nums)


def _same_shapes(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    # shapes only: optax keeps moments in another dtype on request (adam(mu_dtype=bf16))
    return len(la) == len(lb) and all(x.shape == y.shape for x, y in zip(la, lb))


def _factored(state: tuple[int, ...], param: tuple[int, ...]) -> bool:
    """The state leaf is the parameter's shape less one dimension (a factored moment, as
    Adafactor's row and column statistics) or a placeholder of one element."""
    return math.prod(state) <= 1 or any(param[:a] + param[a + 1:] == state
                                        for a in range(len(param)))


def _factored_shapes(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x.shape == y.shape or _factored(x.shape, y.shape)
                                      for x, y in zip(la, lb)) and \
        any(math.prod(x.shape) > 1 for x in la)


def opt_state_links(params: Any, opt_state: Any) -> list[tuple[int | None, str | None]]:
    """For each optimizer-state leaf: the index of the parameter leaf it belongs to, and
    its slot name.

    A subtree of the state with the parameters' tree structure and leaf shapes mirrors
    them (optax's mu, nu, trace, ...): its leaves link to the parameters in order, and the
    key naming the subtree is the slot. Other leaves (step counts) link to nothing; their
    slot is their last key. A subtree with the parameters' tree structure whose leaves are
    factored forms of theirs (optax.adafactor's v_row and v_col: each parameter's shape less
    one dimension, or a one-element placeholder) links the same way."""
    pdef = tree_structure(params)
    nparams = pdef.num_leaves

    def mirrors(node: Any) -> bool:
        return nparams > 0 and tree_structure(node) == pdef and (
            _same_shapes(node, params) or _factored_shapes(node, params))

    links: list[tuple[int | None, str | None]] = []
    for path, node in tree_flatten_with_path(opt_state, is_leaf=mirrors)[0]:
        last = keystr(tuple(path[-1:]), simple=True, separator="/") if path else None
        if mirrors(node):
            links.extend((k, last or "state") for k in range(nparams))
        else:
            links.append((None, last))
    return links


def _keys(path: Any) -> tuple[str, ...]:
    return tuple(keystr((k,), simple=True, separator="/") for k in path)


def _links_by_path(params: Any, opt_state: Any) -> list[tuple[int | None, str | None]]:
    """``opt_state_links`` where no subtree of the state has the parameters' tree structure
    (flax.nnx: the parameters are ``Param`` variables of the model, object 0 of the split,
    the state ``OptState`` variables under the optimizer, object 1): a state leaf links to
    the parameter whose path is the longest end of its own path naming one parameter alone,
    of the same shape (``.../mu/fc1/kernel/value`` to ``0/fc1/kernel/value``); the key
    before that end is the slot. None when no leaf links."""
    owner: dict[tuple[str, ...], int | None] = {}
    shapes = []
    for k, (path, leaf) in enumerate(tree_flatten_with_path(params)[0]):
        keys = _keys(path)
        shapes.append(np.shape(leaf))
        for a in range(len(keys)):
            end = keys[a:]
            owner[end] = k if end not in owner else None     # None: several parameters
    links: list[tuple[int | None, str | None]] = []
    for path, leaf in tree_flatten_with_path(opt_state)[0]:
        keys = _keys(path)
        found = None
        for a in range(len(keys)):          # the longest end first
            k = owner.get(keys[a:])
            if k is not None and shapes[k] == np.shape(leaf) and a > 0:
                found = (k, keys[a - 1])
                break
        links.append(found or (None, keys[-1] if keys else None))
    return links if any(of is not None for of, _ in links) else []


def flax_state(params: Any) -> list[bool]:
    """For each leaf of the params argument: True where it is model state, not a
    parameter. A flax variables dict (``{"params": ..., "batch_stats": ...}``: a dict with
    a "params" collection beside others) holds parameters under "params" and state in the
    other collections (BatchNorm's running statistics), which the step returns updated but
    the optimizer does not touch; any other params argument is parameters throughout, and
    so is such a dict whose every leaf the optimizer keeps state for (``step_inputs``)."""
    paths = [p for p, _ in tree_flatten_with_path(params)[0]]
    if not (isinstance(params, dict) and "params" in params and len(params) > 1):
        return [False] * len(paths)
    return [getattr(p[0], "key", None) != "params" for p in paths]


def step_inputs(args: Sequence[Any], sig: StepSignature) -> list[Input]:
    """The graph inputs for the step's arguments, flattened in argument order, with roles;
    a flax variables dict's collections other than "params" are buffers (``flax_state``)."""
    leaves = {k: arg_leaves(a, sig.prefix(k)) for k, a in enumerate(args)}
    params, opt_state = args[sig.params_argnum], args[sig.opt_state_argnum]
    state = flax_state(params)
    links = opt_state_links(params, opt_state)
    if any(of is not None for of, _ in links):
        # the optimizer keeps state for every leaf: all of them are trained ({"params": w,
        # "scale": s} of the user's own, not flax's collections)
        state = [False] * len(state)
    elif any(state):
        links = opt_state_links(params["params"], opt_state)
    else:
        # no subtree mirrors the parameters (flax.nnx's OptState beside its Params)
        links = _links_by_path(params, opt_state) or links
    param_names = [n for (n, _), st in zip(leaves[sig.params_argnum], state) if not st]
    names = NameSupply(set())
    inputs = []
    for k in range(len(args)):
        for j, (name, leaf) in enumerate(leaves[k]):
            t = ir_type(leaf, f"step argument leaf {name}")
            if k == sig.params_argnum:
                role = InputRole(InputKind.buffer if state[j] else InputKind.param)
            elif k == sig.opt_state_argnum:
                of, slot = links[j]
                role = InputRole(InputKind.opt_state,
                                 of=None if of is None else param_names[of], slot=slot)
            elif k in sig.batch_argnums:
                role = InputRole(InputKind.batch)
            elif is_key_dtype(leaf.dtype):
                role = InputRole(InputKind.rng)
            elif t.numel == 1:
                role = InputRole(InputKind.hyper)  # a learning rate, a step count
            else:
                role = InputRole(InputKind.other)
            inputs.append(Input(Value(names(name), t), role))
    return inputs


def _describe(tree: Any) -> str:
    text = str(tree_structure(tree))
    return text if len(text) < 120 else text[:117] + "..."


def _check_mirror(what: str, got: Any, want: Any) -> None:
    if tree_structure(got) != tree_structure(want):
        raise FrontendError(
            f"the step's returned {what} has the structure {_describe(got)}, but the {what} "
            f"argument has {_describe(want)}; expected the same pytree",
            hint="return (new_params, new_opt_state, *metrics) in that order")
    gl = tree_flatten_with_path(got)[0]
    for (path, g), w in zip(gl, jax.tree.leaves(want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            raise FrontendError(
                f"the step returns {path_name(what, path)} as {g.dtype}{list(g.shape)}, but "
                f"takes it as {w.dtype}{list(w.shape)}; expected the same shape and dtype",
                hint="a new parameter or optimizer state must keep its input's type")


def returned_state(out: Any, args: Sequence[Any], sig: StepSignature) -> dict[int, int]:
    """Results after the optimizer state that are the new value of a later argument (model
    state: haiku's ``state``, flax's ``batch_stats`` passed apart): result index among the
    metrics -> the argument it replaces. A result is one when it has an argument's pytree
    structure, leaf shapes and dtypes, and some leaf of more than one element, the argument
    being neither the parameters, the optimizer state nor the batch, nor keys (a new key
    returned stays a metric), nor an argument with a leaf of the batch's rows (a
    per-example result shaped like per-example weights is a metric, not their new
    value)."""
    taken = {sig.params_argnum, sig.opt_state_argnum, *sig.batch_argnums}
    rows = next((batch_rows(args[k]) for k in sig.batch_argnums if k < len(args)), None)

    def may_be_state(leaves: list[Any]) -> bool:
        return bool(leaves) and not any(_is_key_like(w) for w in leaves) and \
            not any(np.ndim(w) >= 1 and np.shape(w)[0] == rows for w in leaves) and \
            any(math.prod(np.shape(w)) > 1 for w in leaves)
    candidates = [k for k, a in enumerate(args)
                  if k not in taken and may_be_state(jax.tree.leaves(a))]
    found: dict[int, int] = {}
    for m, metric in enumerate(out[2:]):
        got = jax.tree.leaves(metric)
        for k in candidates:
            want = jax.tree.leaves(args[k])
            if k not in found.values() and tree_structure(metric) == tree_structure(args[k]) \
                    and all(g.shape == tuple(np.shape(w)) and g.dtype == w.dtype
                            for g, w in zip(got, want)):
                found[m] = k
                break
    return found


def step_outputs(out: Any, args: Sequence[Any], sig: StepSignature,
                 inputs: list[Input], loss_at: int | None = None
                 ) -> list[tuple[str, OutputRole]]:
    """(preferred value name, role) of every output leaf, checking the convention.
    ``loss_at``: the flat output index of the loss, where the caller knows it better."""
    if not isinstance(out, (tuple, list)) or len(out) < 2:
        if isinstance(out, jax.ShapeDtypeStruct):
            what = f"a single array ({out.dtype}{list(out.shape)})"
        elif isinstance(out, (tuple, list)):
            what = f"a {type(out).__name__} of length {len(out)}"
        else:
            what = f"a {type(out).__name__}"
        raise FrontendError(
            f"the step returned {what}; expected a tuple (params, opt_state, "
            "*metrics)", hint="return the new parameters and optimizer state first, "
                              "then any metrics (the first scalar metric is the loss)")
    _check_mirror("params", out[0], args[sig.params_argnum])
    _check_mirror("opt_state", out[1], args[sig.opt_state_argnum])
    by_arg: dict[int, list[str]] = {}
    pos = 0
    for k, a in enumerate(args):
        n = len(jax.tree.leaves(a))
        by_arg[k] = [i.name for i in inputs[pos:pos + n]]
        pos += n
    result: list[tuple[str, OutputRole]] = []
    for argnum in (sig.params_argnum, sig.opt_state_argnum):
        for target in by_arg[argnum]:
            result.append((f"new/{target}", OutputRole(OutputKind.replaces, target)))
    state = returned_state(out, args, sig)
    loss = _loss_leaf(out, state) if loss_at is None else None
    for m, metric in enumerate(out[2:]):
        if m in state:
            for target in by_arg[state[m]]:
                result.append((f"new/{target}", OutputRole(OutputKind.replaces, target)))
            continue
        for j, (path, _) in enumerate(tree_flatten_with_path(metric)[0]):
            if (m, j) == loss or len(result) == loss_at:
                result.append(("loss", OutputRole(OutputKind.loss)))
            else:
                result.append((path_name(f"metric/{m}", path), OutputRole(OutputKind.metric)))
    return result


def _loss_leaf(out: Any, state: dict[int, int]) -> tuple[int, int] | None:
    """(metric, leaf) of the loss among the step's metrics: a scalar float named loss (a
    dict key or attribute with "loss" in it: ``{"grad_norm": ..., "loss": ...}`` flattens
    the norm first), else the first scalar float."""
    scalars = []
    for m, metric in enumerate(out[2:]):
        if m in state:
            continue
        for j, (path, leaf) in enumerate(tree_flatten_with_path(metric)[0]):
            if leaf.shape == () and jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):
                scalars.append(((m, j), path))
    named = [key for key, path in scalars if path and "loss" in
             str(getattr(path[-1], "key", getattr(path[-1], "name", ""))).lower()]
    return named[0] if named else scalars[0][0] if scalars else None
