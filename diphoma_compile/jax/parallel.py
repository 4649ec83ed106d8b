"""The JAX backend for distributed graphs: the per-device program under jax.shard_map.

A graph that the distribution passes made is each device's program: batch inputs are
varying (``V``, the local batch), parameters replicated, optimizer state split (``S(d)``)
or replicated, and collectives say where devices talk. The runner here wraps that program
in one ``jax.jit`` whose in/out shardings lay the user's global pytrees out over a
``jax.sharding.Mesh``; inside, ``jax.shard_map`` hands each device its pieces, and the
ops run on local shapes (``TensorType.local_shape``) with collectives as ``jax.lax``
calls on named mesh axes. On a mesh of one device with no collective, ``JaxOneDeviceStep``
runs the single-device program instead (no shard_map), bit for bit ``compile``'s."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import BackendError, MeshError
from ..ir.core import Graph, InputKind, Op, OutputKind
from ..ir.types import FlatShard, Placement, Replicate, Shard, TensorType, Varying
from ..mesh import Mesh
from ..report.memory import MemoryReport
from . import key_pieces, quant
from .compile import JaxStep, Lowering, check_alive, donated, dtype_matches, graph_function
from .layout import FlatLayout, flat_axis, flat_spec, returned_whole, stored_shape
from .ops import emitter
from .trees import output_tree

_PSUM = {"sum": lax.psum, "avg": lax.pmean, "max": lax.pmax, "min": lax.pmin}


# ---------------------------------------------------------------- per-device lowering

class PerDeviceLowering(Lowering):
    """Ops on local shapes plus collectives over named mesh axes, inside jax.shard_map."""

    def __init__(self, axis_sizes: dict[str, int], graph: Graph | None = None) -> None:
        self.sizes = dict(axis_sizes)
        # draws of which each device keeps only its rows: made piece by piece
        self.deferred = key_pieces.deferred_draws(graph) if graph is not None else set()

    def local(self, t: TensorType) -> TensorType:
        """The type of one device's piece, with no placements left."""
        return TensorType(t.local_shape(self.sizes), t.dtype)

    def emit(self, op: Op, ins: list) -> list:
        if op.name in _COLLECTIVES:
            return _COLLECTIVES[op.name](self, op, ins)
        if op.name in quant.QUANT_OPS:
            return quant.emit(self, op, ins)
        if op.name == "opaque":
            if op.results and op.results[0].name in self.deferred:
                return [key_pieces.defer(op, ins[0])]
            return super().emit(op, ins)
        if ins and isinstance(ins[0], key_pieces.Deferred):
            return [self._narrow(op, ins)]
        outs = [self.local(v.type) for v in op.results]
        if op.name == "slice":
            op = self._local_slice(op)
        elif "dims" in op.attrs and op.name.startswith("reduce_") and \
                len(op.attrs["dims"]) > np.ndim(ins[0]):
            # a flat piece (the rule allows only a sum over every dimension): of its 1-D chunk
            op = op.replace(attrs=op.attrs.set(dims=(0,), keepdim=False))
            return [lax.reshape(x, outs[0].shape) for x in emitter(op)(op, ins, outs)]
        elif op.name in ("literal", "iota") and any(v.type.placements for v in op.results):
            return self._sharded_constant(op)
        elif outs and any(isinstance(p, FlatShard) for _, p in op.results[0].type.placements):
            # a flat piece (1-D) with a whole value of one element broadcast to it, of the
            # tensor's own rank (u / sqrt(sum(u * u, keepdims=True)): muon's normalization)
            ins = [lax.reshape(x, ()) if np.ndim(x) not in (0, len(outs[0].shape)) and
                   np.size(x) == 1 else x for x in ins]
        return emitter(op)(op, ins, outs)

    def _narrow(self, op: Op, ins: list) -> Any:
        """A deferred draw's window viewed as pieces (a reshape splitting its dim), or
        one piece picked and made (``index_select`` by a pipeline's microbatch index)."""
        d = ins[0]
        if op.name == "reshape":
            b = op.results[0].type.shape      # (a whole draw's window has no dim yet)
            dim = d.dim if d.dim is not None else next(
                k for k in range(len(d.shape)) if d.shape[k] != b[k])
            return key_pieces.as_pieces(d, dim, b[dim])
        if op.name == "index_select" and d.pieces > 1:
            return key_pieces.pick(d, ins[1])
        raise BackendError(f"{op.name} cannot read a deferred random draw",
                           hint="this is a bug in jax/key_pieces.deferred_draws")

    def _local_slice(self, op: Op) -> Op:
        # The sharding rule keeps a split only through whole dims: their limit is the global
        # size, which on one device is the local size.
        (res,) = op.results
        local = res.type.local_shape(self.sizes)
        if local == res.type.shape or len(local) != res.type.rank:
            return op
        limits = [start + n if n != g else limit for limit, start, g, n in
                  zip(op.attrs["limits"], op.attrs["starts"], res.type.shape, local)]
        return op.replace(attrs=op.attrs.set(limits=tuple(limits)))

    def _sharded_constant(self, op: Op) -> list:
        # A constant placed split is built whole and cut to this device's piece.
        (res,) = op.results
        x = emitter(op)(op, [], [res.type.replicated()])[0]
        for axis, p in res.type.placements:
            x = _cut(x, axis, self.sizes[axis], p)
        return [x]


def _axis(op: Op) -> str:
    return str(op.attrs["axis"])   # the verifier checked that the mesh has it


def _flat_padded(x: Any, n: int) -> tuple[Any, int]:
    """x flattened and zero padded to a multiple of n; and the chunk size per device."""
    flat = lax.reshape(x, (math.prod(np.shape(x)),))
    chunk = -(-flat.shape[0] // n)
    pad = chunk * n - flat.shape[0]
    if pad:
        flat = lax.pad(flat, np.array(0, flat.dtype), [(0, pad, 0)])
    return flat, chunk


def _cut(x: Any, axis: str, n: int, p: Placement) -> Any:
    """This device's piece of the whole (replicated) value x under placement p."""
    if isinstance(p, Replicate) or isinstance(p, Varying):
        return x
    idx = lax.axis_index(axis)
    if isinstance(p, Shard) and p.groups > 1:
        shape = np.shape(x)
        view = jnp.reshape(x, shape[:p.dim] + (p.groups, shape[p.dim] // p.groups)
                           + shape[p.dim + 1:])
        piece = _cut(view, axis, n, Shard(p.dim + 1))
        return jnp.reshape(piece, shape[:p.dim] + (shape[p.dim] // n,) + shape[p.dim + 1:])
    if isinstance(p, Shard):
        chunk = np.shape(x)[p.dim] // n
        return lax.dynamic_slice_in_dim(x, idx * chunk, chunk, axis=p.dim)
    if isinstance(p, FlatShard):
        flat, chunk = _flat_padded(x, n)
        return lax.dynamic_slice_in_dim(flat, idx * chunk, chunk, axis=0)
    raise BackendError(f"cannot take a device's piece of a value placed {p}")


# A bucket (k inputs, k results) moves as one packed buffer. A value is packed as rows, one
# per device: row j is device j's piece (its chunk along the split dim, or of the padded flat
# tensor), so one collective over the concatenated rows moves every member at once.

def _rows(x: Any, dim: Any, n: int) -> Any:
    """(n, c): row j is device j's piece of x (split along ``dim``, or flat), flattened."""
    if dim == "flat":
        flat, chunk = _flat_padded(x, n)
        return lax.reshape(flat, (n, chunk))
    return lax.reshape(jnp.moveaxis(x, int(dim), 0), (n, math.prod(np.shape(x)) // n))


def _piece(row: Any, dim: Any, shape: tuple[int, ...]) -> Any:
    """One device's piece, of local ``shape``, from its flattened row."""
    if dim == "flat":
        return lax.reshape(row, shape)
    d = int(dim)
    moved = (shape[d],) + shape[:d] + shape[d + 1:]
    return jnp.moveaxis(lax.reshape(row, moved), 0, d)


def _split_columns(packed: Any, widths: Sequence[int]) -> list:
    """The column blocks of a 2-d array, ``widths`` wide, in order."""
    out, at = [], 0
    for w in widths:
        out.append(lax.slice_in_dim(packed, at, at + w, axis=1))
        at += w
    return out


def _flat_concat(xs: Sequence[Any]) -> Any:
    return lax.concatenate([lax.reshape(x, (1, math.prod(np.shape(x)))) for x in xs], 1)


def _all_reduce(low: PerDeviceLowering, op: Op, ins: list) -> list:
    red = str(op.attrs.get("op", "sum"))
    if red not in _PSUM:
        raise BackendError(f"all_reduce with op={red} has no JAX lowering")
    if len(ins) == 1:
        return [_PSUM[red](ins[0], _axis(op))]
    packed = _PSUM[red](_flat_concat(ins), _axis(op))
    cols = _split_columns(packed, [math.prod(np.shape(x)) for x in ins])
    return [lax.reshape(c, np.shape(x)) for c, x in zip(cols, ins)]


def _reduce_scatter(low: PerDeviceLowering, op: Op, ins: list) -> list:
    axis, red, dim = _axis(op), str(op.attrs.get("op", "sum")), op.attrs["dim"]
    n = low.sizes[axis]
    if red not in ("sum", "avg"):
        raise BackendError(f"reduce_scatter with op={red} has no JAX lowering",
                           hint="reduce_scatter sums or averages")
    if len(ins) == 1:
        x, scatter = ins[0], dim
        if dim == "flat":
            x, scatter = _flat_padded(x, n)[0], 0
        outs = [lax.psum_scatter(x, axis, scatter_dimension=int(scatter), tiled=True)]
    else:
        rows = [_rows(x, dim, n) for x in ins]
        mine = lax.psum_scatter(lax.concatenate(rows, 1), axis, scatter_dimension=0,
                                tiled=True)
        cols = _split_columns(mine, [r.shape[1] for r in rows])
        outs = [_piece(c, dim, low.local(v.type).shape) for c, v in zip(cols, op.results)]
    if red == "avg":
        outs = [lax.div(o, np.array(n, o.dtype)) for o in outs]
    return outs


def _all_gather(low: PerDeviceLowering, op: Op, ins: list) -> list:
    axis, dim = _axis(op), op.attrs["dim"]
    if len(ins) == 1 and dim != "flat":
        return [lax.all_gather(ins[0], axis, axis=int(dim), tiled=True)]
    # each device contributes its pieces as one row; gathered, row j is device j's
    pieces = [x if dim == "flat" else jnp.moveaxis(x, int(dim), 0) for x in ins]
    gathered = lax.all_gather(_flat_concat(pieces), axis, axis=0, tiled=True)
    cols = _split_columns(gathered, [math.prod(np.shape(x)) for x in ins])
    outs = []
    for c, v in zip(cols, op.results):
        shape = low.local(v.type).shape
        if dim == "flat":      # drop the padding of the last piece
            whole = lax.reshape(c, (math.prod(np.shape(c)),))
            outs.append(lax.reshape(lax.slice_in_dim(whole, 0, math.prod(shape)), shape))
        else:                  # (n, piece) -> the pieces stacked along the split dim
            outs.append(_piece(c, dim, shape))
    return outs


def _wait(low: PerDeviceLowering, op: Op, ins: list) -> list:
    # XLA schedules collectives itself (asynchronously where the platform can): the values
    # are simply handed on
    return list(ins)


def _take_shard(low: PerDeviceLowering, op: Op, ins: list) -> list:
    axis = _axis(op)
    (res,) = op.results
    return [_cut(ins[0], axis, low.sizes[axis], res.type.placement(axis))]


def _take_piece(low: PerDeviceLowering, op: Op, ins: list) -> list:
    axis, dim = _axis(op), int(op.attrs["dim"])
    if isinstance(ins[0], key_pieces.Deferred):
        mine = key_pieces.device_piece(ins[0], axis, low.sizes[axis], dim)
        return [mine if op.results[0].name in low.deferred else key_pieces.bits(mine)]
    return [_cut(ins[0], axis, low.sizes[axis], Shard(dim))]


def _broadcast(low: PerDeviceLowering, op: Op, ins: list) -> list:
    axis, root, x = _axis(op), int(op.attrs.get("root", 0)), ins[0]
    if jax.numpy.issubdtype(x.dtype, jax.numpy.number):
        # the root's value plus zeros from the others: one all-reduce, exact
        mine = lax.eq(lax.axis_index(axis), np.int32(root))
        return [lax.psum(lax.select(lax.broadcast(mine, np.shape(x)), x,
                                    lax.full_like(x, 0)), axis)]
    return [lax.index_in_dim(lax.all_gather(x, axis), root, keepdims=False)]


def _as_partial(low: PerDeviceLowering, op: Op, ins: list) -> list:
    x = ins[0]
    mine = lax.eq(lax.axis_index(_axis(op)), np.int32(0))
    return [lax.select(lax.broadcast(mine, np.shape(x)), x, lax.full_like(x, 0))]


def _as_varying(low: PerDeviceLowering, op: Op, ins: list) -> list:
    # under shard_map with check_vma=False a replicated array is already this device's own
    return [ins[0]]


def _all_to_all(low: PerDeviceLowering, op: Op, ins: list) -> list:
    local = op.attrs.get("local")
    if len(ins) > 1 or local:      # 1-d payloads (a bucket): row j of each goes to device j
        n = low.sizes[_axis(op)]
        m = n if not local else quant.level_size(op, n)
        rows = [lax.reshape(x, (m, math.prod(np.shape(x)) // m)) for x in ins]
        both = lax.concatenate(rows, 1)
        got = (quant.level_all_to_all(both, _axis(op), n, int(local),
                                      str(op.attrs.get("level", "local")))
               if local else lax.all_to_all(both, _axis(op), split_axis=0, concat_axis=0,
                                            tiled=True))
        cols = _split_columns(got, [r.shape[1] for r in rows])
        return [lax.reshape(c, (math.prod(np.shape(c)),)) for c in cols]
    return [lax.all_to_all(ins[0], _axis(op), split_axis=int(op.attrs["to_dim"]),
                           concat_axis=int(op.attrs["from_dim"]), tiled=True)]


_COLLECTIVES = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter,
                "all_gather": _all_gather, "wait": _wait, "take_shard": _take_shard,
                "broadcast": _broadcast, "all_to_all": _all_to_all, "as_partial": _as_partial,
                "as_varying": _as_varying, "take_piece": _take_piece}


# ---------------------------------------------------------------- layouts over the mesh

def _spec(t: TensorType, mesh_axes: Sequence[str], what: str) -> PartitionSpec:
    """The PartitionSpec of a graph input or output of type t (global arrays outside)."""
    if flat_axis(t) is not None:        # stored as a padded 1-D array (jax/layout.py)
        return flat_spec(t, what)
    dims: list[list[str]] = [[] for _ in range(t.rank)]
    for axis in mesh_axes:              # mesh order: the order devices are laid out in
        p = t.placement(axis)
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Shard) and p.groups > 1:
            raise BackendError(f"{what} is placed {p} on axis {axis!r}: a split in groups "
                               "(each device's piece of every group) has no PartitionSpec",
                               hint="the JAX backend runs tensor parallelism on plain splits; "
                                    "split fused projections into one per group, or use the "
                                    "PyTorch backend")
        if isinstance(p, Shard):
            dims[p.dim].append(axis)
        elif isinstance(p, Varying) and t.rank >= 1:
            dims[0].append(axis)
        else:
            why = ("a per-device scalar has no global array to be part of"
                   if isinstance(p, Varying) else
                   "flat (padded) shards are kept inside the program only"
                   if isinstance(p, FlatShard) else "a partial value must be reduced first")
            if isinstance(p, Varying):      # a value only a device's own share made
                raise BackendError(
                    f"{what} is each device's own scalar on axis {axis!r} (made from its "
                    "share of the batch alone, e.g. a mask's sum), and the step hands it "
                    "out of the program, where a scalar has no global array to be a piece "
                    "of",
                    hint="return a value combined over the devices (a mean over the "
                         "batch), or divide by the rows (keep.size) instead of the mask's "
                         "sum: a mean over examples, the same on every share")
            raise BackendError(f"{what} is placed {p} on axis {axis!r}: {why}",
                               hint="the distribution passes give graph inputs and outputs "
                                    "R, S(d) or (batch) V placements")
    return PartitionSpec(*[None if not d else d[0] if len(d) == 1 else tuple(d)
                           for d in dims])


def _global_shape(t: TensorType, sizes: dict[str, int]) -> tuple[int, ...]:
    """The global shape of a graph input: varying values stack along dim 0; a flat-split
    value is stored padded, as one dimension."""
    if flat_axis(t) is not None:
        return stored_shape(t, sizes)
    shape = list(t.shape)
    for axis, p in t.placements:
        if isinstance(p, Varying):
            shape[0] *= sizes[axis]
    return tuple(shape)


def jax_mesh(mesh: Any) -> jax.sharding.Mesh:
    """A jax.sharding.Mesh for a jax Mesh (as is), a diphoma Mesh or a dict of axis sizes
    (over jax.devices(), whose number must equal the mesh's size)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    m = Mesh.of(mesh)
    devices = jax.devices()
    m.check_world(len(devices), what=f"JAX devices ({devices[0].platform})")
    shape = tuple(s for _, s in m.axes)
    return jax.sharding.Mesh(np.array(devices).reshape(shape), m.names)


# ---------------------------------------------------------------- memory

def per_device_bytes(arrays: Sequence[Any]) -> int:
    """The most bytes any one device holds of these arrays (their addressable shards)."""
    held: dict[Any, int] = {}
    for x in arrays:
        shards = getattr(x, "addressable_shards", None)
        if shards is None:          # numpy or a scalar: on the host, counted as whole
            held[None] = held.get(None, 0) + int(np.asarray(x).nbytes)
            continue
        for s in shards:
            held[s.device] = held.get(s.device, 0) + int(s.data.nbytes)
    return max(held.values(), default=0)


# ---------------------------------------------------------------- the runner

class MeasuredRunner(JaxStep):
    """A runner that keeps its last outputs (``_last``), to report the memory of the
    ``device_count`` devices it covers."""

    _last: tuple
    device_count: int

    def run(self, leaves: list[Any]) -> Sequence[Any]:
        """The program's output leaves, kept as the last outputs for memory_report."""
        outs = self.jitted(*leaves)
        self._last = tuple(outs)
        return outs

    def _kept(self, result: Any) -> Any:
        # the output tree's leaves are the graph's outputs, in order
        self._last = tuple(jax.tree.leaves(result))
        return result

    def _state_outputs(self) -> dict[InputKind, list[int]]:
        kinds = {i.name: i.role.kind for i in self.graph.inputs}
        found: dict[InputKind, list[int]] = {InputKind.param: [], InputKind.opt_state: []}
        for k, o in enumerate(self.graph.outputs):
            if o.role.kind is OutputKind.replaces and kinds.get(o.role.target) in found:
                found[kinds[o.role.target]].append(k)
        return found

    def memory_report(self) -> MemoryReport:
        """Parameter and optimizer-state bytes per device: measured from the arrays the last
        call returned (their shards on each device), or planned from the graph's types
        before the first call."""
        which = self._state_outputs()
        if self._last:
            param = per_device_bytes([self._last[k] for k in which[InputKind.param]])
            state = per_device_bytes([self._last[k] for k in which[InputKind.opt_state]])
            return MemoryReport(param, state, devices=self.device_count, measured=True)
        types = self.graph.value_types()
        axes = dict(self.graph.mesh.axes)

        def planned(kind: InputKind) -> int:
            return sum(types[self.graph.outputs[k].name].local_nbytes(axes) for k in which[kind])
        return MemoryReport(planned(InputKind.param), planned(InputKind.opt_state),
                            devices=self.device_count, measured=False)


class JaxParallelStep(MeasuredRunner):
    """A distributed graph as one jax.jit over a mesh: call it like the user's step with
    the global batch; parameters come back replicated, optimizer state stays sharded."""

    def __init__(self, graph: Graph, out_tree: Any = None, *, mesh: Any = None,
                 axis: str | None = None, donate: bool = False) -> None:
        self.graph = graph
        self.out_tree = out_tree if out_tree is not None else output_tree(graph)
        self._tree_jit = None    # the leaves are laid out over the mesh first (flatten)
        self.mesh = jax_mesh(mesh if mesh is not None else graph.mesh)
        self.axis = axis if axis is not None else _data_axis(graph)
        self.sizes = {str(k): int(v) for k, v in self.mesh.shape.items()}
        self._check_meshes()
        names = tuple(self.mesh.axis_names)
        self.in_specs = tuple(_spec(i.value.type, names, f"input {i.name}")
                              for i in graph.inputs)
        self.out_specs = tuple(_spec(graph.value_types()[o.name], names, f"output {o.name}")
                               for o in graph.outputs)
        self.in_shardings = tuple(NamedSharding(self.mesh, s) for s in self.in_specs)
        self.out_shardings = tuple(NamedSharding(self.mesh, s) for s in self.out_specs)
        self.global_shapes = [_global_shape(i.value.type, self.sizes) for i in graph.inputs]
        self.fn = graph_function(graph, PerDeviceLowering(dict(graph.mesh.axes), graph))
        body = jax.shard_map(self.fn, mesh=self.mesh, in_specs=self.in_specs,
                             out_specs=self.out_specs, check_vma=False)
        body, self.out_shardings = returned_whole(       # a returned flat gradient
            body, [(graph.value_types()[o.name], o.role.kind is OutputKind.replaces)
                   for o in graph.outputs], self.out_shardings, self.mesh)
        self.donated = set(donated(graph)) if donate else set()
        self.jitted = jax.jit(body, in_shardings=self.in_shardings,
                              out_shardings=self.out_shardings,
                              donate_argnums=tuple(sorted(self.donated)))
        self.device_count = self.mesh.size
        self._last: tuple = ()
        self.layout = FlatLayout([i.value.type for i in graph.inputs], self.sizes,
                                 self.in_shardings)

    def user_shapes(self, tree: Any, argnum: int | None = None) -> Any:
        """``tree`` (parameters or optimizer state the step took or returned) with every
        leaf stored flat (a padded 1-D array, jax/layout.py) in the user's shape again."""
        return self.layout.to_user(tree, argnum)

    def _check_meshes(self) -> None:
        have = ", ".join(f"{n}={s}" for n, s in self.sizes.items())
        if self.axis not in self.sizes:
            raise MeshError(f"the device mesh ({have}) has no axis {self.axis!r}",
                            hint="name the data axis of the mesh, or add it to the mesh")
        for name, size in self.graph.mesh.axes:
            if self.sizes.get(name) != size:
                raise MeshError(f"the graph was partitioned for mesh axis {name}={size}, but "
                                f"the device mesh has {have}",
                                hint="run the passes with the mesh you run on")

    def flatten(self, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(input leaves laid out over the mesh, the treedef of each argument), checked
        against the graph: global shapes, dtypes, and a batch that splits evenly."""
        leaves, treedefs = self.leaves(args)
        self.layout.note_arguments(treedefs)
        placed = []
        for k, (i, want, sharding, leaf) in enumerate(zip(self.graph.inputs, self.global_shapes,
                                                          self.in_shardings, leaves)):
            check_alive(i.name, leaf)
            leaf = self.layout.to_stored(k, leaf)     # the user's shape -> padded, flat
            self._check_leaf(i.name, i.value.type, want, leaf)
            if isinstance(leaf, jax.Array) and leaf.sharding != sharding:
                # a copy when donating: the caller's array in another layout is left alone
                # (device_put alone shares the buffer a device already holds, may_alias=False
                # or not, and the donation would delete it)
                leaf = jax.device_put(jnp.copy(leaf) if k in self.donated else leaf, sharding)
            placed.append(leaf)
        return placed, treedefs

    def _check_leaf(self, name: str, t: TensorType, want: tuple[int, ...], leaf: Any) -> None:
        shape = tuple(np.shape(leaf))
        dtype = getattr(leaf, "dtype", None)
        varying = [a for a, p in t.placements if isinstance(p, Varying)]
        if varying and shape:
            n = math.prod(self.sizes[a] for a in varying)
            if shape[0] % n:
                raise MeshError(
                    f"the global batch leaf {name} has {shape[0]} rows along dim 0, which "
                    f"does not divide evenly over the {n} devices of mesh axis "
                    f"{'/'.join(varying)}",
                    hint=f"use a global batch that is a multiple of {n}")
            if shape[0] != want[0]:
                raise BackendError(
                    f"batch leaf {name} has {shape[0]} rows, but the step was parallelized "
                    f"for a global batch of {want[0]} ({t.shape[0]} per device x {n})",
                    hint="parallelize again for this batch size")
        if shape != want or not dtype_matches(dtype, t.dtype):
            raise BackendError(f"input {name} is {dtype}{list(shape)}; the parallel step "
                               f"expects {t.dtype}{list(want)}",
                               hint="call it with the global arrays of the shapes it was "
                                    "parallelized for")


class JaxOneDeviceStep(MeasuredRunner):
    """``parallelize`` on a mesh of one device: the single-device program under jax.jit,
    exactly as ``compile`` runs it, on the mesh's device (a jax Mesh's, else the default)."""

    def __init__(self, graph: Graph, out_tree: Any = None, *, mesh: Any = None,
                 donate: bool = False) -> None:
        super().__init__(graph, out_tree, donate)
        self.device = mesh.devices.flat[0] if isinstance(mesh, jax.sharding.Mesh) else None
        if self.device is not None:
            self._tree_jit = None     # the leaves are put on the mesh's device first
        self.device_count = 1
        self._last: tuple = ()

    def flatten(self, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(input leaves on the mesh's device, the treedef of each argument), checked."""
        leaves, treedefs = super().flatten(args)
        if self.device is not None:
            leaves = [jax.device_put(x, self.device) for x in leaves]
        return leaves, treedefs


def _data_axis(graph: Graph) -> str:
    """The one mesh axis the batch inputs vary over (when the caller names none)."""
    axes = {a for i in graph.inputs for a, p in i.value.type.placements
            if isinstance(p, Varying)}
    if len(axes) == 1:
        return axes.pop()
    if not axes and len(graph.mesh.axes) == 1:
        return graph.mesh.axes[0][0]
    raise MeshError(f"cannot tell the data axis of the graph (batch inputs vary over "
                    f"{sorted(axes) or 'no axis'})", hint="pass axis= explicitly")


def compile_jax_parallel(graph: Graph, *, mesh: Any = None, axis: str | None = None,
                         out_tree: Any = None) -> JaxParallelStep:
    """The per-device graph ``graph`` as a runnable step over ``mesh`` (a jax Mesh, a
    diphoma Mesh or a dict of axis sizes; by default the graph's own mesh)."""
    return JaxParallelStep(graph, out_tree, mesh=mesh, axis=axis)


__all__ = ["JaxOneDeviceStep", "JaxParallelStep", "MeasuredRunner",
           "PerDeviceLowering", "compile_jax_parallel", "jax_mesh", "per_device_bytes"]
