"""A staged graph's programs: each pipeline stage's ops cut into the programs a runtime runs.

After the ``pipeline`` pass every op has a stage and the values crossing stages are
send/recv pairs. Each stage's ops become programs of their own (each a ``Graph``): forward
and backward (F, B), run once per microbatch, or, for the schedules that split the
backward, its input-gradient part I (what the gradients sent to an earlier stage depend
on) and its weight-gradient part W; and the update, run once, in rounds (U0, U1, ...) when
it receives from other stages' updates (a global gradient-norm clip: norms in, the factor
back), so a round never waits for itself. Each program lists what it reads, what it
returns, the values it receives before it runs and sends after, and which of its values
leave the microbatch (summed over the microbatches: gradients, the loss). An update
program's new parameters and state keep the graph output's role (``replaces`` the input)
where no later update program of the rank reads that input, so a runtime may write them
in place. A tied
parameter's new value received by a stage that does not update it is read by no program:
it is listed in ``writes`` (the runtime writes it into that stage's copy).
A ``microbatch_sum`` (a count of the batch summed over the microbatches:
``passes/global_counts.py``) is made by the runtime: the forward ops its input is made of
(from the batch alone) are a count program C of the stage, which it runs on every
microbatch before the schedule starts, adding up what C returns; the forward ops that read
the totals alone (their all-reduce over a data-parallel axis, the division by the shares)
are a program T run once on the sums, not once per microbatch; the forward and backward
programs read what T makes, and the totals, as values of the step (``totals``). T also
gathers, once a step, the parameters a rank holds as pieces (``shard_params``; the
pipeline's ``gather=step``, the default), which each microbatch's forward and backward
would otherwise gather again.

Framework-neutral: the torch runtime (``torch/pipeline.py``) builds each program with
``build.py``, the JAX one (``jax/pipeline.py``) under ``jax.jit`` on the stage's devices."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DiphomaError
from ..ir.analysis import free_inputs, view_bases
from ..ir.core import Graph, Input, InputKind, InputRole, Op, Output, OutputKind, Phase, Value
from ..ir.opdef import is_pure, random_draw
from .pipeline_parallel import SPLIT_BACKWARD, input_gradient_ops, pipeline_of, stage_rank

_KIND = {Phase.forward: "F", Phase.backward: "B", Phase.update: "U"}
Transfer = tuple[str, int, int]         # value name, peer (rank on the axis), tag


@dataclass
class StageProgram:
    """One program of a stage: its graph and the values around it."""

    graph: Graph
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    recvs: list[Transfer] = field(default_factory=list)
    sends: list[Transfer] = field(default_factory=list)
    acc: list[str] = field(default_factory=list)   # summed over microbatches (made or received)
    # of ``acc``, those a runtime may take as the sum's first term without a copy: made
    # here in storage of their own (no other summed value shares it), not sent, by a
    # backward (B or W) after which the microbatch's values on the stage are dropped
    acc_owned: list[str] = field(default_factory=list)


@dataclass
class StagePrograms:
    """The programs of some stages of a staged graph, by (stage, kind)."""

    kinds: str                              # "FBU" or, split backward, "FIWU"
    nrounds: int                            # update rounds U0 .. U{nrounds - 1}
    programs: dict[tuple[int, str], StageProgram] = field(default_factory=dict)
    writes: dict[str, Transfer] = field(default_factory=dict)   # received, read by none
    split: dict[int, tuple[int, int]] = field(default_factory=dict)  # stage -> ops in I, W
    made: set[str] = field(default_factory=set)     # values made or received on the stages
    # stage -> its count program C, run on every microbatch before the schedule; and
    # stage -> {total: (what of C's it adds up, "sum" or "avg")}: microbatch_sum's results
    counts: dict[int, StageProgram] = field(default_factory=dict)
    totals: dict[int, dict[str, tuple[str, str]]] = field(default_factory=dict)
    # stage -> its program T, run once before the schedule: what its forward made of the
    # totals alone (a data-parallel all-reduce, a division) and, with the pipeline's
    # gather=step, the whole parameters gathered from the pieces the rank holds
    once: dict[int, StageProgram] = field(default_factory=dict)

    def kinds_of_stage(self) -> list[str]:
        """The program kinds of a stage, in the order they run within a microbatch, then
        the update rounds."""
        return [k for k in self.kinds if k != "U"] + [f"U{r}" for r in range(self.nrounds)]

    @property
    def inputs_read(self) -> set[str]:
        """Every graph input or value some program of these stages reads."""
        return {n for p in (*self.programs.values(), *self.counts.values(),
                            *self.once.values()) for n in p.inputs}


def runs_per_step(kind: str, microbatches: int) -> int:
    """How often a stage's program of ``kind`` runs a step: once for the update rounds
    (``U0``, ``U1``, ...) and program ``T``, M times for the forward and backward programs
    (``F``, ``B``, ``I``, ``W``) and the count program ``C``."""
    return 1 if kind.startswith("U") or kind == "T" else microbatches


def stage_programs(graph: Graph, stages: list[int], schedule: str,
                   rounds: tuple[dict[int, int], int] | None = None) -> StagePrograms:
    """The programs of ``stages`` of the staged ``graph`` under ``schedule`` (one that
    splits the backward gives I and W programs instead of B); ``rounds``: the graph's
    ``update_rounds``, when already known."""
    op_round, nrounds = rounds or update_rounds(graph)
    out = StagePrograms("FIWU" if schedule in SPLIT_BACKWARD else "FBU", nrounds)
    input_grad = input_gradient_ops(graph.ops) if "I" in out.kinds else set()
    opts = pipeline_of(graph)
    gather = opts.gather if opts is not None else "step"
    rank_of = {s: r for r, held in enumerate(rank_stages(graph)) for s in held} \
        if opts is not None else {}
    # by rank: the parameters an earlier stage of the rank gathers in its program T, which
    # its later stages read from there (a tied embedding on both ends of zbv's V)
    gathered: dict[int, dict[tuple, str]] = {}
    for me in sorted(stages):
        _cut_stage(graph, me, out, op_round, input_grad, gather,
                   gathered.setdefault(rank_of.get(me, me), {}))
    _mark_replaced(graph, out, sorted(stages))
    return out


def rank_stages(graph: Graph) -> list[list[int]]:
    """The stages each rank of a staged graph's pipeline axis runs, by rank."""
    opts = pipeline_of(graph)
    ranks = dict(graph.mesh.axes).get(opts.axis, 1)
    nstages = 1 + max(op.stage for op in graph.ops if op.stage is not None)
    return [[s for s in range(nstages)
             if stage_rank(opts.schedule, s, nstages, ranks) == r] for r in range(ranks)]


def is_staged(graph: Graph) -> bool:
    """Whether the pipeline pass cut ``graph`` into stages over an axis of its mesh."""
    opts = pipeline_of(graph)
    return opts is not None and opts.axis in dict(graph.mesh.axes) and \
        any(op.stage is not None for op in graph.ops)


def rank_stage_programs(graph: Graph) -> list[StagePrograms]:
    """The programs of each rank of a staged graph's pipeline axis, by rank."""
    schedule = pipeline_of(graph).schedule
    rounds = update_rounds(graph)
    cuts = [stage_programs(graph, stages, schedule, rounds) for stages in rank_stages(graph)]
    _check_cadence(cuts)
    return cuts


def _check_cadence(cuts: list[StagePrograms]) -> None:
    """Each send and its receive run as often: both in programs run per microbatch, or
    both once a step (the update, a tied parameter's write); else the receiving rank would
    wait for a message sent once, or leave M - 1 unread, and the ranks hang."""
    sent: dict[int, tuple[str, int, str]] = {}
    got: dict[int, tuple[str, int, str]] = {}
    for cut in cuts:
        for (st, kind), prog in cut.programs.items():
            sent.update((tag, (name, st, kind)) for name, _, tag in prog.sends)
            got.update((tag, (name, st, kind)) for name, _, tag in prog.recvs)
        got.update((tag, (name, -1, "U")) for name, _, tag in cut.writes.values())
    for tag, (name, st, kind) in sent.items():
        if tag in got and kind.startswith("U") != got[tag][2].startswith("U"):
            other, to, k = got[tag]
            raise DiphomaError(
                f"pipeline: %{name} is sent by stage {st}'s {kind} program and received as "
                f"%{other} by stage {to}'s {k} program, one of them run per microbatch and "
                "the other once a step: the ranks would wait for each other forever",
                hint="this is a bug in the pipeline pass; report it with the model")


def _mark_replaced(graph: Graph, out: StagePrograms, stages: list[int]) -> None:
    """Give each update program's new parameter and state values the role of the graph
    output they are (``replaces`` the input), where the program reads that input and no
    update program after it on these stages does (they run round by round, each round
    stage by stage): a runtime may then write the new value into the input's storage where
    it is made, as the unstaged step does."""
    roles = {o.name: o.role for o in graph.outputs if o.role.kind is OutputKind.replaces}
    later: set[str] = set()
    for r in reversed(range(out.nrounds)):
        for st in reversed(stages):
            prog = out.programs[(st, f"U{r}")]
            ins = set(prog.inputs)
            marked = tuple(Output(o.name, roles[o.name]) if o.name in roles
                           and roles[o.name].target in ins and roles[o.name].target not in later
                           else o for o in prog.graph.outputs)
            prog.graph = prog.graph.replace(outputs=marked)
            later |= ins


def _cut_stage(graph: Graph, me: int, out: StagePrograms, op_round: dict[int, int],
               input_grad: set[int], gather: str, gathered: dict[tuple, str]) -> None:
    types = graph.value_types()
    roles = {i.name: i.role for i in graph.inputs}
    ops = [op for op in graph.ops if op.stage == me]
    kinds = out.kinds_of_stage()
    split = "I" in kinds
    seg_of: dict[str, str] = {}           # value made on this stage -> its program
    body: dict[str, list[Op]] = {k: [] for k in kinds}
    recvs: dict[str, list[Transfer]] = {k: [] for k in kinds}
    sends: dict[str, list[Transfer]] = {k: [] for k in kinds}
    for op in ops:
        if op.name in ("send", "recv", "microbatch_sum"):
            continue
        k = _KIND[op.phase or Phase.forward]
        if k == "B" and split:
            k = "I" if id(op) in input_grad else "W"
        elif k == "U":
            k = f"U{op_round[id(op)]}"
        body[k].append(op)
        seg_of.update((v.name, k) for v in op.results)
    _reduce_the_sums(graph, ops, body)
    _share_invariants(graph, body)
    _count_program(graph, me, ops, body, out)
    _once_program(graph, me, ops, body, out, gather, gathered)
    readers = {}
    for k, b in body.items():
        made_k = {v.name for op in b for v in op.results}
        for op in b:
            for n in free_inputs(op):
                if n not in made_k:
                    readers.setdefault(n, set()).add(k)
    for op in ops:
        if op.name == "recv":
            name = op.results[0].name
            where = readers.get(name)
            if not where:           # a tied parameter's new value: written, not read
                out.writes[name] = (name, int(op.attrs["peer"]), int(op.attrs["tag"]))
                continue
            k = min(where, key=kinds.index)
            if op.phase is Phase.backward and (k == "F" or k.startswith("U")):
                # a backward value arrives per microbatch, as it is sent: one read by the
                # update alone (a weight's gradient made on the stage after its home:
                # GPT-NeoX's embedding when its stage holds nothing else) is summed over
                # the microbatches like the stage's own gradients
                k = kinds[1]
            recvs[k].append((name, int(op.attrs["peer"]), int(op.attrs["tag"])))
            seg_of[name] = "R" + k
        elif op.name == "send":
            n = op.inputs[0]
            k = seg_of.get(n, "F").removeprefix("R")
            sends[k].append((n, int(op.attrs["peer"]), int(op.attrs["tag"])))
            readers.setdefault(n, set()).add("S" + k)
    if split:
        out.split[me] = (len(body["I"]), len(body["W"]))
    returned = {o.name for o in graph.outputs}

    def updates(n: str) -> bool:       # read by the update or returned
        return any(r.startswith("U") for r in readers.get(n, ())) or n in returned

    for k in kinds:
        made = {v.name for op in body[k] for v in op.results}
        inputs = list(dict.fromkeys(n for op in body[k] for n in free_inputs(op)
                                    if n not in made))
        outputs = [n for n in made if (readers.get(n, set()) - {k}) or n in returned]
        sub = Graph(f"{graph.name}.stage{me}.{k}",
                    tuple(Input(Value(n, types[n]), roles.get(n, InputRole()))
                          for n in inputs), tuple(body[k]),
                    tuple(Output(n) for n in outputs), graph.mesh)
        acc = [] if k.startswith("U") else \
            [n for n in outputs + [r[0] for r in recvs[k]] if updates(n)]
        out.programs[(me, k)] = StageProgram(sub, inputs, outputs, recvs[k], sends[k], acc,
                                             _owned(sub, k, acc, made, sends[k]))
    out.made.update(seg_of)


def _count_program(graph: Graph, me: int, ops: list[Op], body: dict[str, list[Op]],
                   out: StagePrograms) -> None:
    """Stage ``me``'s count program: the forward ops the inputs of its ``microbatch_sum``
    ops are made of, from the step's inputs alone. Those on this stage are moved out of
    its forward program where nothing else there reads them (they stay where something
    does: a mask the loss multiplies by); those made on an earlier stage and received
    here (a mask drawn at the top of the step, where the cut put it on the first stage)
    are made again in C from the same inputs, not received: C runs before the schedule."""
    totals = [op for op in ops if op.name == "microbatch_sum"]
    if not totals:
        return
    made = {v.name: op for op in graph.ops if op.name not in ("send", "recv")
            and (op.phase or Phase.forward) is Phase.forward for v in op.results}
    sent = {op.attrs["tag"]: op.inputs[0] for op in graph.ops if op.name == "send"}
    received = {op.results[0].name: sent[op.attrs["tag"]] for op in graph.ops
                if op.name == "recv" and op.attrs["tag"] in sent}
    kinds = {i.name: i.role.kind for i in graph.inputs}
    chosen: dict[int, Op] = {}
    rename: dict[str, str] = {}
    need = [op.inputs[0] for op in totals]
    while need:
        x = got = need.pop()
        while got in received:          # made on another stage: made again here
            got = received[got]
        if got != x:
            rename[x] = got
        op = made.get(got)
        if op is None:
            if kinds.get(got) not in (InputKind.batch, InputKind.hyper, InputKind.other,
                                      InputKind.buffer, InputKind.rng, InputKind.microbatch,
                                      InputKind.param):
                raise DiphomaError(f"pipeline: the count %{got} that stage {me} sums over "
                                   "the microbatches is not made from the step's inputs "
                                   "alone", hint="this is a bug in the pipeline pass; "
                                                 "report it with the model")
            continue
        if id(op) not in chosen:
            chosen[id(op)] = op
            need += free_inputs(op)
    order = {id(op): k for k, op in enumerate(graph.ops)}
    c_body = [op.replace(inputs=tuple(rename.get(x, x) for x in op.inputs))
              for op in sorted(chosen.values(), key=lambda op: order[id(op)])]
    # what the stage's other ops, its sends and the step's results read of its own
    mine = [op for op in body["F"] if id(op) in chosen]
    live = {n for k, b in body.items() for op in b if id(op) not in chosen
            for n in free_inputs(op)}
    live |= {op.inputs[0] for op in ops if op.name == "send"}
    live |= {o.name for o in graph.outputs}
    keep: set[int] = set()
    for op in reversed(mine):
        if any(v.name in live for v in op.results):
            keep.add(id(op))
            live.update(free_inputs(op))
    body["F"] = [op for op in body["F"] if id(op) not in chosen or id(op) in keep]
    types = graph.value_types()
    roles = {i.name: i.role for i in graph.inputs}
    c_made = {v.name for op in c_body for v in op.results}
    inputs = list(dict.fromkeys(n for op in c_body for n in free_inputs(op) if n not in c_made))
    outputs = list(dict.fromkeys(rename.get(op.inputs[0], op.inputs[0]) for op in totals))
    sub = Graph(f"{graph.name}.stage{me}.C",
                tuple(Input(Value(n, types[n]), roles.get(n, InputRole())) for n in inputs),
                tuple(c_body), tuple(Output(n) for n in outputs), graph.mesh)
    out.counts[me] = StageProgram(sub, inputs, outputs)
    out.totals[me] = {op.results[0].name: (rename.get(op.inputs[0], op.inputs[0]),
                                           str(op.attrs["op"])) for op in totals}


def _once_program(graph: Graph, me: int, ops: list[Op], body: dict[str, list[Op]],
                  out: StagePrograms, gather: str, gathered: dict[tuple, str]) -> None:
    """Stage ``me``'s program T, run once before the schedule: ops of its per-microbatch
    programs that would make the same values in every microbatch, M times over.

    - The forward ops that read its totals and nothing made per microbatch (the sum's
      all-reduce over a data-parallel axis, its division by the shares; the constants they
      read are copied).
    - With ``gather="step"``, the all-gathers of the parameters the rank holds as pieces
      (``shard_params``): one gather a step of each, where every microbatch's forward and
      backward gathered it again (a backward's gather of a parameter the forward gathers
      is the same value: it goes, its readers read the forward's). The stage's parameters
      are then whole from before its first forward to after its last backward, as torch's
      pipelines keep FSDP's (``set_reshard_after_backward(False)`` on all backwards but
      the last). A gather whose result is sent or returned stays where it is. A
      parameter an earlier stage of the same rank gathers in its T (``gathered``: by the
      gather's inputs, attributes and type, the value made) is not gathered again: this
      stage's programs read that stage's value (both runtimes keep every T's results for
      the rank's stages), so a rank holds one whole copy."""
    consts = {v.name: op for op in body["F"] if not free_inputs(op) and not op.regions
              and is_pure(op) for v in op.results}
    sent = {op.inputs[0] for op in ops if op.name == "send"}
    returned = {o.name for o in graph.outputs}
    chosen: list[Op] = []
    if me in out.totals:
        have = set(out.totals[me])
        for op in body["F"]:
            ins = free_inputs(op)
            if ins and not op.regions and random_draw(op) is None and \
                    all(n in have or n in consts for n in ins) and \
                    any(n in have for n in ins) and \
                    not any(v.name in sent or v.name in returned for v in op.results):
                chosen.append(op)
                have.update(v.name for v in op.results)
    rename: dict[str, str] = {}
    if gather == "step":
        chosen += _step_gathers(graph, body, sent | returned, rename, gathered)
    if not chosen and not rename:
        return
    moved = {id(op) for op in chosen}
    for k, b in body.items():
        if k.startswith("U"):
            continue
        b[:] = [op if not rename or not any(n in rename for n in op.inputs) else
                op.replace(inputs=tuple(rename.get(n, n) for n in op.inputs))
                for op in b if id(op) not in moved
                and not any(v.name in rename for v in op.results)]
    copies = list({id(consts[n]): consts[n] for op in chosen for n in free_inputs(op)
                   if n in consts}.values())
    order = {id(op): k for k, op in enumerate(graph.ops)}
    t_body = sorted(copies + chosen, key=lambda op: order[id(op)])
    live = {n for b in body.values() for op in b for n in free_inputs(op)} | sent | returned
    body["F"] = [op for op in body["F"] if free_inputs(op)
                 or any(v.name in live for v in op.results) or not is_pure(op)]
    if not chosen:                  # every gather it reads is another stage's
        return
    types = graph.value_types()
    roles = {i.name: i.role for i in graph.inputs}
    made = {v.name for op in t_body for v in op.results}
    inputs = list(dict.fromkeys(n for op in t_body for n in free_inputs(op) if n not in made))
    outputs = [v.name for op in chosen for v in op.results if v.name in live]
    sub = Graph(f"{graph.name}.stage{me}.T",
                tuple(Input(Value(n, types[n]), roles.get(n, InputRole())) for n in inputs),
                tuple(t_body), tuple(Output(n) for n in outputs), graph.mesh)
    out.once[me] = StageProgram(sub, inputs, outputs)


def _step_gathers(graph: Graph, body: dict[str, list[Op]], kept: set[str],
                  rename: dict[str, str], gathered: dict[tuple, str]) -> list[Op]:
    """The all-gathers of parameter inputs in the per-microbatch programs of ``body`` that
    program T may run once a step, the first of each; the results of the others (the same
    parameter gathered again for the backward, or already in ``gathered`` by another stage
    of the rank) go into ``rename`` as the first's. Not one whose result is in ``kept``
    (sent, returned); one an op with regions reads is moved into T as it is, not renamed
    (the region's body would name the value). The chosen ones are added to
    ``gathered``."""
    params = {i.name for i in graph.inputs if i.role.kind is InputKind.param}
    in_regions = {n for b in body.values() for op in b if op.regions
                  for n in free_inputs(op)}
    first: dict[tuple, str] = {}
    chosen: list[Op] = []
    for k, b in body.items():
        if k.startswith("U"):
            continue
        for op in b:
            if op.name != "all_gather" or op.regions or op.attrs.get("async") or \
                    len(op.results) != 1 or not op.inputs or \
                    not all(n in params for n in op.inputs):
                continue
            res = op.results[0]
            if res.name in kept:
                continue
            key = (op.inputs, tuple(sorted((a, str(v)) for a, v in op.attrs.items())),
                   res.type)
            known = first.get(key, gathered.get(key))
            if known is not None and res.name not in in_regions:
                rename[res.name] = known
                continue
            first.setdefault(key, res.name)
            chosen.append(op)
    for key, name in first.items():
        gathered.setdefault(key, name)
    return chosen


def _owned(sub: Graph, kind: str, acc: list[str], made: set[str],
           sends: list[Transfer]) -> list[str]:
    """The summed values of a B or W program the sum may start from without a copy."""
    if kind not in ("B", "W"):
        return []
    base = view_bases(sub)
    sent = {n for n, _, _ in sends}
    bases = [base.get(n, n) for n in acc]
    return [n for n, b in zip(acc, bases)
            if n in made and b in made and n not in sent and bases.count(b) == 1]


def _reduce_the_sums(graph: Graph, ops: list[Op], body: dict[str, list[Op]]) -> None:
    """Move the data-parallel all-reduces and reduce-scatters (sum or mean) of what leaves
    the microbatch (a gradient, the loss) from the per-microbatch programs into the
    update: the update's programs reduce the sum over the microbatches once, where the
    backward reduced each microbatch's share M times (the same result: the reduction is
    linear; M times fewer bytes and calls). torch.distributed.pipelining does the same:
    DDP's ``no_sync`` and FSDP's ``set_requires_gradient_sync(False)`` for every backward
    but the last. Under weight-update sharding the microbatches' sum is then the whole
    local gradient, not a 1/N shard of it, as under FSDP there. Only a reduction whose
    result nothing per microbatch reads and no stage receives, of floats; a bucket, an
    async one, stay where they are."""
    rounds = [k for k in body if k.startswith("U")]
    if not rounds:
        return
    sent = {op.inputs[0] for op in ops if op.name == "send"}
    returned = {o.name for o in graph.outputs}
    # a forward value received per microbatch stays with a program run per microbatch
    received = {op.results[0].name for op in ops if op.name == "recv"
                and (op.phase or Phase.forward) is Phase.forward}
    reader: dict[str, set[str]] = {}
    for k, b in body.items():
        for op in b:
            for n in free_inputs(op):
                reader.setdefault(n, set()).add(k)
    moved: dict[int, str] = {}
    for k, b in body.items():
        if k.startswith("U"):
            continue
        for op in b:
            if op.name not in ("all_reduce", "reduce_scatter") or \
                    op.attrs.get("op") not in ("sum", "avg") or \
                    op.attrs.get("async") or len(op.results) != 1:
                continue
            res = op.results[0]
            where = reader.get(res.name, set())
            if res.name in sent or not res.type.dtype.is_float or \
                    any(n in received for n in op.inputs) or \
                    any(not w.startswith("U") for w in where) or \
                    not (where or res.name in returned):
                continue
            moved[id(op)] = min(where, key=rounds.index) if where else rounds[0]
    if not moved:
        return
    order = {id(op): n for n, op in enumerate(graph.ops)}
    going = [op for k, b in body.items() for op in b if id(op) in moved]
    for k, b in body.items():
        if k.startswith("U"):
            b[:] = sorted(b + [op for op in going if moved[id(op)] == k],
                          key=lambda op: order[id(op)])
        else:
            b[:] = [op for op in b if id(op) not in moved]


def _share_invariants(graph: Graph, body: dict[str, list[Op]]) -> None:
    """Give each update program its own copy of the forward and backward ops it reads that
    are the same in every microbatch (constants and math on the hyperparameters alone:
    the 1 an optimizer's step count adds), so they are computed there rather than handed
    over and summed over the microbatches as gradients are (an integer count averaged
    over M would come out a float)."""
    hyper = {i.name for i in graph.inputs
             if i.role.kind in (InputKind.hyper, InputKind.other)}
    invariant: dict[str, Op] = {}
    for k, b in body.items():
        if k.startswith("U"):
            continue
        for op in b:
            if is_pure(op) and not op.regions and \
                    all(n in invariant or n in hyper for n in free_inputs(op)):
                invariant.update((v.name, op) for v in op.results)
    if not invariant:
        return
    order = {id(op): n for n, op in enumerate(graph.ops)}
    for k, b in body.items():
        if not k.startswith("U"):
            continue
        made = {v.name for op in b for v in op.results}
        need = [n for op in b for n in free_inputs(op) if n in invariant and n not in made]
        copied: dict[int, Op] = {}
        while need:
            op = invariant[need.pop()]
            if id(op) in copied:
                continue
            copied[id(op)] = op
            need.extend(n for n in free_inputs(op) if n in invariant)
        body[k][:0] = sorted(copied.values(), key=lambda op: order[id(op)])


def update_rounds(graph: Graph) -> tuple[dict[int, int], int]:
    """(id(op) -> its round, the number of rounds) for the update ops of a staged graph.

    Round r reads only what rounds before r sent (a global gradient-norm clip: each stage's
    gradient norms go to one stage, which sends the clip factor back), so every rank runs
    round 0 of all its stages, then round 1, ... without waiting on itself."""
    value: dict[str, int] = {}
    sent: dict[int, int] = {}
    op_round: dict[int, int] = {}
    for op in graph.ops:
        if op.phase is not Phase.update:
            continue
        if op.name == "send":
            sent[int(op.attrs["tag"])] = value.get(op.inputs[0], 0)
        elif op.name == "recv":
            value[op.results[0].name] = sent.get(int(op.attrs["tag"]), -1) + 1
        else:
            r = max([value.get(n, 0) for n in free_inputs(op)] + [0])
            op_round[id(op)] = r
            value.update((v.name, r) for v in op.results)
    # then as late as their readers allow: math on the hyperparameters alone (the learning
    # rate's scalars, which a program may keep on the host) runs in the round of the update
    # that reads it rather than crossing from round 0
    readers: dict[str, list[Op]] = {}
    for op in graph.ops:
        for n in free_inputs(op):
            readers.setdefault(n, []).append(op)
    returned = {o.name for o in graph.outputs}
    for op in reversed(graph.ops):
        if id(op) not in op_round:
            continue
        late = [op_round.get(id(r)) for v in op.results for r in readers.get(v.name, ())]
        if late and None not in late and not any(v.name in returned for v in op.results):
            op_round[id(op)] = max(op_round[id(op)], min(late))
    return op_round, 1 + max(op_round.values(), default=0)


__all__ = ["StageProgram", "StagePrograms", "Transfer", "is_staged", "rank_stage_programs",
           "rank_stages", "runs_per_step", "stage_programs", "update_rounds"]
