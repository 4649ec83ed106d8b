"""The collectives a generated per-rank program calls, on the process group of one mesh axis.

Each helper is a plain function of (comm, tensor, attributes) so that the fx program reads as
Python: ``all_reduce(comm_dp, grad, 'avg')``. Each adds the bytes this rank sends under the
ring model to ``comm.bytes_sent``, by the formulas of ``OpDef.comm_bytes`` applied to the
tensors actually passed (flat shards count their zero padding: it is sent), so a test can
compare what ran with what the plan predicted.

With ``async_op=True`` (a collective that ``schedule-comm`` issues early) a helper starts the
collective and returns a ``Pending``; ``wait`` finishes it where the program first needs the
result, so the communication overlaps the computation in between. The Comm records the time
spent blocked in collectives (``blocked_s``); with ``force_sync`` every collective is waited
for at once, which is how ``profile`` measures the whole communication time."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

_REDUCE = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
_FUNCTIONAL_OP = {"sum": "sum", "avg": "sum", "max": "max", "min": "min"}

# torch >= 2.13 names the single-tensor forms *_single; older releases *_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm(torch.nn.Module):
    """One mesh axis as the program sees it: its process group, this rank's index in it,
    and what was sent so far. A Module so that the program reaches it by ``get_attr``."""

    def __init__(self, axis: str, size: int, rank: int, group: Any = None) -> None:
        super().__init__()
        self.axis = axis
        self.size = size
        self.rank = rank
        self.group = group
        self.bytes_sent = 0
        self.calls: Counter[str] = Counter()   # collective kind -> how many ran
        self.blocked_s = 0.0                   # time spent waiting for collectives
        self.force_sync = False                # wait for every collective at once
        # _c10d_functional ops instead of torch.distributed calls, for a code generator
        # (Inductor) that traces the program (codegen.InductorProgram then counts each
        # call's collectives: the compiled code runs them out of Python's sight)
        self.functional = False
        self.backend: str | None = None        # the group's backend, read on first use

    def global_rank(self, group_rank: int) -> int:
        """The world rank of the group's ``group_rank``-th member (for src/dst arguments)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group,
                                                                          group_rank)

    def _count(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes_sent += nbytes

    def extra_repr(self) -> str:
        return f"axis={self.axis}, size={self.size}, rank={self.rank}"


class Pending:
    """A collective in flight: its work handle and what turns the buffer into the result."""

    def __init__(self, comm: Comm, work: Any, finish: Any) -> None:
        self.comm, self.work, self.finish = comm, work, finish

    def wait(self) -> Any:
        """Block until the collective is done; its result (a tensor or a tuple)."""
        t0 = time.perf_counter()
        if self.work is not None:
            self.work.wait()
        self.comm.blocked_s += time.perf_counter() - t0
        return self.finish()


def _start(comm: Comm, launch: Any, finish: Any, async_op: bool,
           functional_async: bool = True) -> Any:
    """Run ``launch(async_op)`` (which returns a work handle or None) and finish now, or
    hand back a Pending to finish at the wait. A functional collective started async is
    waited for (``wait_tensor``) where the program waits for it, so that a code generator
    tracing the program sees the computation in between, to overlap with the transfer."""
    go_async = (async_op and not comm.force_sync and comm.size > 1
                and (functional_async or not comm.functional))
    t0 = time.perf_counter()
    work = launch(go_async)
    comm.blocked_s += time.perf_counter() - t0
    p = Pending(comm, work, finish)
    return p if go_async else p.wait()


def wait(p: Any) -> Any:
    """The result of a collective started with ``async_op=True``."""
    return p.wait() if isinstance(p, Pending) else p


def _functional(comm: Comm, kind: str, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """The ``_c10d_functional`` collective ``kind`` of ``x`` on the axis's group, waited
    for (every functional collective needs its wait_tensor)."""
    return torch.ops._c10d_functional.wait_tensor(_functional_launch(comm, kind, x, *args))


def _functional_launch(comm: Comm, kind: str, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """The ``_c10d_functional`` collective ``kind`` of ``x``, started: its result may be
    read only after ``wait_tensor``."""
    group = comm.group if comm.group is not None else dist.group.WORLD
    return getattr(torch.ops._c10d_functional, kind)(x, *args, group.group_name)


class _FunctionalWork:
    """A functional collective in flight, as a work handle: ``wait()`` waits for its result
    and copies it into ``into`` (the buffer the non-functional call would fill)."""

    def __init__(self, into: torch.Tensor, started: torch.Tensor) -> None:
        self.into, self.started = into, started

    def wait(self) -> None:
        self.into.copy_(torch.ops._c10d_functional.wait_tensor(self.started))


def _functional_into(comm: Comm, into: torch.Tensor, async_op: bool, kind: str,
                     x: torch.Tensor, *args: Any) -> _FunctionalWork | None:
    """Start the functional collective ``kind`` whose result goes into ``into``: a work
    handle when ``async_op``, else waited for and copied now (None)."""
    work = _FunctionalWork(into, _functional_launch(comm, kind, x, *args))
    if async_op:
        return work
    work.wait()
    return None


def _frac(comm: Comm) -> float:
    n = comm.size
    return (n - 1) / n


def _reduce_op(op: str):
    return getattr(dist.ReduceOp, _REDUCE[op])


def _padded_flat(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """The flattened tensor zero-padded to a multiple of n (contiguous), and the chunk size."""
    flat = x.reshape(-1)
    numel = flat.numel()
    k = -(-numel // n)
    if n * k != numel:
        flat = torch.cat([flat, flat.new_zeros(n * k - numel)])
    return flat.contiguous(), k


def all_reduce(comm: Comm, x: torch.Tensor, op: str, owned: bool = False,
               async_op: bool = False) -> Any:
    """The reduction of every rank's ``x``; ``avg`` sums, then divides by N in x's dtype.
    ``owned``: the program does not read ``x`` again, so it may be reduced in place."""
    if owned and x._base is None and x.is_contiguous():
        t = x
    else:
        t = x.clone(memory_format=torch.contiguous_format)
    comm._count("all_reduce", int(2 * _frac(comm) * (t.numel() * t.element_size())))

    def launch(a: bool) -> Any:
        if comm.size > 1 and comm.functional:
            return _functional_into(comm, t, a, "all_reduce", t, _FUNCTIONAL_OP[op])
        elif comm.size > 1:
            return dist.all_reduce(t, op=_reduce_op(op), group=comm.group, async_op=a)
        return None

    def finish() -> torch.Tensor:
        return t.div_(comm.size) if op == "avg" else t
    return _start(comm, launch, finish, async_op)


def reduce_scatter(comm: Comm, x: torch.Tensor, op: str, dim: Any,
                   local_shape: list[int], async_op: bool = False) -> Any:
    """This rank's chunk of the reduction: of the zero-padded flattened tensor (``flat``), or
    along dimension ``dim``."""
    n = comm.size
    if dim == "flat":
        src, k = _padded_flat(x, n)
        out_shape: list[int] = [k]
    else:
        src = x.movedim(dim, 0).contiguous()
        out_shape = [src.shape[0] // n, *src.shape[1:]]

    def shaped(res: torch.Tensor) -> torch.Tensor:
        if dim != "flat":
            res = res.movedim(0, dim)
        return res.reshape(local_shape)
    return _start_scatter(comm, src, out_shape, op, shaped, async_op)


def _scatters_by_all_to_all(comm: Comm) -> bool:
    """gloo has no reduce-scatter algorithm of its own: torch runs it as an all-reduce of
    the whole input, as slow as one. An all_to_all of the rows (row j to rank j) and a sum
    of the N rows received sends each rank's (N - 1) / N of the bytes once, as a ring
    reduce-scatter does: measured on 4 gloo ranks here, 16 ms against 34 ms for 9.6 MB
    (docs/data-parallel.md). It holds a receive buffer as large as the input until the
    wait (``scratch_bytes(receive_whole=True)``)."""
    if comm.size == 1:
        return False
    if comm.backend is None:
        comm.backend = str(dist.get_backend(comm.group))
    return comm.backend == "gloo"


def _reduce_rows(rows: torch.Tensor, op: str) -> torch.Tensor:
    """The reduction over dimension 0 of the N rows each rank sent this one."""
    if op in ("sum", "avg"):
        return rows.sum(0)
    return rows.amax(0) if op == "max" else rows.amin(0)


def _start_scatter(comm: Comm, src: torch.Tensor, out_shape: list[int], op: str,
                   shaped: Any, async_op: bool) -> Any:
    """Start the reduce-scatter of ``src`` (contiguous, its rows the ranks' chunks) into a
    chunk of ``out_shape``; ``shaped`` turns the (averaged) chunk into the result."""
    n = comm.size
    k = src.numel() // n
    comm._count("reduce_scatter", int(_frac(comm) * n * (k * src.element_size())))
    if _scatters_by_all_to_all(comm):
        recv = torch.empty_like(src)

        def launch(a: bool) -> Any:
            if comm.functional:
                rows = [src.shape[0] // n] * n
                return _functional_into(comm, recv, a, "all_to_all_single", src, rows, rows)
            return dist.all_to_all_single(recv, src, group=comm.group, async_op=a)

        def finish() -> Any:
            out = _reduce_rows(recv.view(n, *out_shape), op)
            return shaped(out.div_(n) if op == "avg" else out)
        return _start(comm, launch, finish, async_op)
    out = src.new_empty(out_shape)

    def finish_scatter() -> Any:
        return shaped(out.div_(n) if op == "avg" else out)
    return _start(comm, _scatter_launch(comm, out, src, op), finish_scatter, async_op)


def _scatter_launch(comm: Comm, out: torch.Tensor, src: torch.Tensor, op: str) -> Any:
    def launch(a: bool) -> Any:
        if comm.size > 1 and comm.functional:
            return _functional_into(comm, out, a, "reduce_scatter_tensor", src,
                                    _FUNCTIONAL_OP[op], comm.size)
        elif comm.size > 1:
            return _reduce_scatter(out, src, op=_reduce_op(op), group=comm.group, async_op=a)
        else:
            out.copy_(src)
        return None
    return launch


def _gather_launch(comm: Comm, out: torch.Tensor, src: torch.Tensor) -> Any:
    def launch(a: bool) -> Any:
        if comm.size > 1 and comm.functional:
            return _functional_into(comm, out, a, "all_gather_into_tensor", src, comm.size)
        elif comm.size > 1:
            return _all_gather(out, src, group=comm.group, async_op=a)
        else:
            out.copy_(src)
        return None
    return launch


def all_gather_groups(comm: Comm, x: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
    """The whole tensor from every rank's chunk of each of the ``groups`` groups along
    ``dim`` (the inverse of ``take_shard(..., groups=groups)``)."""
    whole = all_gather(comm, _grouped(x, dim, groups), dim + 1, [])
    return whole.flatten(dim, dim + 1)


def all_gather(comm: Comm, x: torch.Tensor, dim: Any, shape: list[int],
               async_op: bool = False) -> Any:
    """The whole tensor of global ``shape`` from every rank's chunk (padding dropped)."""
    n = comm.size
    if dim == "flat":
        src = x.reshape(-1).contiguous()
        out = src.new_empty(n * src.numel())
    else:
        src = x.movedim(dim, 0).contiguous()
        out = src.new_empty((n * src.shape[0], *src.shape[1:]))
    comm._count("all_gather", int(_frac(comm) * n * (src.numel() * src.element_size())))

    def finish() -> torch.Tensor:
        if dim == "flat":
            return out[:math.prod(shape)].view(shape)
        return out.movedim(0, dim)
    return _start(comm, _gather_launch(comm, out, src), finish, async_op)


def as_partial(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """A replicated tensor as one piece of a sum: rank 0 of the axis keeps it, the others
    hold zeros (nothing is sent)."""
    return x if comm.rank == 0 else torch.zeros_like(x)


def _grouped(x: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
    """``x`` with dimension ``dim`` viewed as two, [groups, size/groups]."""
    return x.unflatten(dim, (groups, x.shape[dim] // groups))


def take_shard(comm: Comm, x: torch.Tensor, dim: Any, local_shape: list[int],
               groups: int = 1) -> torch.Tensor:
    """This rank's chunk of a replicated tensor, without communication (with ``groups``:
    its chunk of each of the groups dimension ``dim`` is made of, in group order)."""
    n, r = comm.size, comm.rank
    if groups > 1:
        return take_shard(comm, _grouped(x, dim, groups), dim + 1, []).flatten(dim, dim + 1)
    comm._count("take_shard", 0)
    if dim == "flat":
        flat, k = _padded_flat(x, n)
        return flat.narrow(0, r * k, k).reshape(local_shape)
    c = x.shape[dim] // n
    return x.narrow(dim, r * c, c)


def broadcast(comm: Comm, x: torch.Tensor, root: int) -> torch.Tensor:
    """Rank ``root``'s ``x`` on every rank (only the root sends)."""
    t = x.clone(memory_format=torch.contiguous_format)
    if comm.size > 1 and comm.functional:
        t = _functional(comm, "broadcast", t, comm.global_rank(root))
    elif comm.size > 1:
        dist.broadcast(t, src=comm.global_rank(root), group=comm.group)
    # a pipelined ring broadcast: every rank but the last forwards the message
    comm._count("broadcast", int(_frac(comm) * t.numel() * t.element_size()))
    return t


# ------------------------------------------------------------------ buckets
# A bucket moves k values of one dtype as one packed buffer. Each member is laid out as
# (N, m): row r is rank r's piece, flattened (a whole value under all_reduce is its own
# single row); the rows of all members are concatenated, so a rank's piece of the buffer is
# its pieces of the members, one after the other.

def _rows(x: torch.Tensor, n: int, dim: Any) -> torch.Tensor:
    """A value to scatter as (n, m): its zero-padded flattening, or its chunks along dim."""
    if dim == "flat":
        flat, k = _padded_flat(x, n)
        return flat.view(n, k)
    return x.movedim(dim, 0).reshape(n, -1)


def all_reduce_bucket(comm: Comm, xs: list[torch.Tensor], op: str,
                      async_op: bool = False) -> Any:
    """all_reduce of k values in one call on their concatenation."""
    buf = torch.cat([x.reshape(-1) for x in xs])
    comm._count("all_reduce", int(2 * _frac(comm) * (buf.numel() * buf.element_size())))

    def launch(a: bool) -> Any:
        if comm.size > 1 and comm.functional:
            return _functional_into(comm, buf, a, "all_reduce", buf, _FUNCTIONAL_OP[op])
        elif comm.size > 1:
            return dist.all_reduce(buf, op=_reduce_op(op), group=comm.group, async_op=a)
        return None

    def finish() -> tuple[torch.Tensor, ...]:
        res = buf.div_(comm.size) if op == "avg" else buf
        return tuple(p.view(x.shape) for p, x in zip(res.split([x.numel() for x in xs]), xs))
    return _start(comm, launch, finish, async_op)


def reduce_scatter_bucket(comm: Comm, xs: list[torch.Tensor], op: str, dim: Any,
                          local_shapes: list[list[int]], async_op: bool = False) -> Any:
    """reduce_scatter of k values in one call: this rank's piece of each. Only the packed
    buffer and the output live while it is in flight: nothing here keeps the members (the
    program drops a gradient once its bucket has packed it)."""
    n = comm.size
    rows = [_rows(x, n, dim) for x in xs]
    widths = [r.shape[1] for r in rows]
    src = torch.cat(rows, dim=1).reshape(-1)
    del rows
    pieces_of = None if dim == "flat" else [
        ([x.shape[dim] // n] + [s for i, s in enumerate(x.shape) if i != dim]) for x in xs]

    def shaped(res: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pieces = res.split(widths)
        if pieces_of is None:
            return tuple(p.view(s) for p, s in zip(pieces, local_shapes))
        return tuple(p.view(s).movedim(0, dim) for p, s in zip(pieces, pieces_of))
    return _start_scatter(comm, src, [src.numel() // n], op, shaped, async_op)


def _member(r: torch.Tensor, n: int, dim: Any, piece: list[int],
             shape: list[int]) -> torch.Tensor:
    """One bucket member's whole value from its gathered rows ``r`` (n, m): padding dropped
    (flat), or the ranks' pieces joined along ``dim``."""
    if dim == "flat":
        return r.reshape(-1)[:math.prod(shape)].view(shape)
    return r.reshape([n * piece[0]] + piece[1:]).movedim(0, dim)


def _unpack_into(dest: torch.Tensor, r: torch.Tensor, n: int, dim: Any,
                 piece: list[int]) -> torch.Tensor:
    """Write the gathered rows ``r`` (n, m) of one bucket member straight into ``dest``, the
    storage of the whole value (the parameter it replaces), with no copy in between."""
    if not dest.is_contiguous():
        return dest.copy_(_member(r, n, dim, piece, list(dest.shape)))
    if dim == "flat":
        numel, m = dest.numel(), r.shape[1]
        flat = dest.view(-1)
        full = numel // m
        if full:
            flat[:full * m].view(full, m).copy_(r[:full])
        if numel > full * m:
            flat[full * m:].copy_(r[full, :numel - full * m])
        return dest
    dest.movedim(dim, 0).unflatten(0, (n, piece[0])).copy_(r.unflatten(1, piece))
    return dest


def all_gather_bucket(comm: Comm, xs: list[torch.Tensor], dim: Any,
                      shapes: list[list[int]], async_op: bool = False,
                      dests: list[torch.Tensor | None] | None = None) -> Any:
    """all_gather of k values in one call: each whole value, padding dropped. ``dests``
    (where given, per member): a contiguous tensor of the member's whole shape that the
    result is written into, straight from the packed buffer (the parameter the gathered
    value replaces), so no unpacked copy lives beside the buffer."""
    n = comm.size
    flats = [(x.movedim(dim, 0) if dim != "flat" else x).reshape(-1) for x in xs]
    widths = [f.numel() for f in flats]
    pieces = [list(x.movedim(dim, 0).shape) if dim != "flat" else [] for x in xs]
    src = torch.cat(flats)
    del flats
    out = src.new_empty(n * src.numel())
    comm._count("all_gather", int(_frac(comm) * n * (src.numel() * src.element_size())))
    into = list(dests) if dests is not None else [None] * len(xs)

    def finish() -> tuple[torch.Tensor, ...]:
        rows = out.view(n, -1).split(widths, dim=1)
        res = []
        for r, piece, shape, dest in zip(rows, pieces, shapes, into):
            res.append(_unpack_into(dest, r, n, dim, piece) if dest is not None
                       else _member(r, n, dim, piece, shape))
        return tuple(res)
    return _start(comm, _gather_launch(comm, out, src), finish, async_op)


def all_to_all(comm: Comm, x: torch.Tensor, from_dim: int, to_dim: int,
               async_op: bool = False) -> Any:
    """S(from_dim) -> S(to_dim): this rank's piece cut along ``to_dim`` into N chunks, chunk
    j sent to rank j, the N chunks received joined along ``from_dim``."""
    n = comm.size
    src = torch.stack(list(x.chunk(n, dim=to_dim))).contiguous()   # (n, ...chunk)
    comm._count("all_to_all", int(_frac(comm) * src.numel() * src.element_size()))
    if n == 1:
        return x
    out = torch.empty_like(src)

    def launch(a: bool) -> Any:
        return dist.all_to_all_single(out, src, group=comm.group, async_op=a)

    def finish() -> torch.Tensor:
        return torch.cat(list(out.unbind(0)), dim=from_dim)
    return _start(comm, launch, finish, async_op, functional_async=False)


def all_to_all_bucket(comm: Comm, xs: list[torch.Tensor], async_op: bool = False) -> Any:
    """all_to_all of k 1-d payloads in one call: chunk j of each member goes to rank j; each
    result is the N chunks received, sender by sender."""
    n = comm.size
    rows = [x.reshape(n, -1) for x in xs]
    src = torch.cat(rows, dim=1).contiguous()         # row j: every member's chunk j
    comm._count("all_to_all", int(_frac(comm) * src.numel() * src.element_size()))
    out = torch.empty_like(src)

    def launch(a: bool) -> Any:
        if n > 1:
            return dist.all_to_all_single(out, src, group=comm.group, async_op=a)
        out.copy_(src)
        return None

    widths = [r.shape[1] for r in rows]
    del rows

    def finish() -> tuple[torch.Tensor, ...]:
        return tuple(c.reshape(-1) for c in out.split(widths, dim=1))
    return _start(comm, launch, finish, async_op, functional_async=False)


# ------------------------------------------------------------------ memory model
# What the helpers above hold besides a collective's results, for the plan's peak
# (Framework.collective_scratch): a reduce-scatter's packed (or padded) send buffer, kept
# until the wait; an all-gather bucket's packed pieces, kept until the wait, and, at the
# wait, its members unpacked beside the received buffer (all but those written straight
# into the parameter they replace). An all-reduce hands on views of the buffer it reduces,
# and a lone all-gather views of the one it receives into: their results.

def plans_for_gloo(device_model: str) -> bool:
    """Whether the program will run its collectives on gloo: the default process group's
    backend, or, where none exists (``inspect``), whether the plan's device model is."""
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend()) == "gloo"
    return device_model.endswith("-gloo")


def scratch_bytes(graph: Any, in_place: Any = (), receive_whole: bool = False
                  ) -> dict[int, int]:
    """Top-level op index -> bytes held besides the results, from that op to the wait that
    finishes it (a wait's own index: at the wait only). ``in_place``: the values the program
    writes into the input they replace (``build.updates_in_place``). ``receive_whole``: a
    reduce-scatter receives as many bytes as it sends (gloo's, run as an all_to_all)."""
    sizes = dict(graph.mesh.axes)
    types = graph.value_types()
    waits: dict[str, tuple[int, str]] = {}        # collective result -> (wait index, result)
    for k, op in enumerate(graph.ops):
        if op.name == "wait":
            for i, v in zip(op.inputs, op.results):
                waits[i] = (k, v.name)
    out: dict[int, int] = {}

    def add(k: int, nbytes: int) -> None:
        if nbytes:
            out[k] = out.get(k, 0) + nbytes
    for k, op in enumerate(graph.ops):
        if op.name not in ("reduce_scatter", "all_gather") or not op.inputs:
            continue
        n = sizes.get(op.attrs.get("axis"), 1)
        dim = op.attrs.get("dim")
        local = [types[i].local_nbytes(sizes) for i in op.inputs]
        bucket = len(op.inputs) > 1
        if op.name == "reduce_scatter":
            t = types[op.inputs[0]]
            padded = dim == "flat" and math.prod(t.local_shape(sizes)) % n
            whole = sum(_padded(types[i], b, n, dim, sizes) for i, b in zip(op.inputs, local))
            if bucket or dim not in (0, "flat") or padded:
                add(k, whole)
            if receive_whole and n > 1:
                add(k, whole)
            continue
        if not bucket:
            add(k, local[0] if dim not in (0, "flat") else 0)
            continue
        add(k, sum(local))                      # the packed pieces
        for v in op.results:
            at, final = waits.get(v.name, (k, v.name))
            if final not in in_place:
                add(at, types[v.name].local_nbytes(sizes))
    return out


def _padded(t: Any, nbytes: int, n: int, dim: Any, sizes: dict[str, int]) -> int:
    """Bytes of a value laid out as n rows: zero-padded to a multiple of n when flat."""
    if dim != "flat":
        return nbytes
    numel = math.prod(t.local_shape(sizes))
    return -(-numel // n) * n * (nbytes // numel if numel else 0)
