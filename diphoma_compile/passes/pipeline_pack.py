"""Pack the scalars one pipeline stage sends another in the update into one message.

A global gradient-norm clip under a pipeline sends every gradient's norm from its stage to
the stage that totals them: one scalar send/recv pair per gradient. Here each group of
update-phase scalar pairs between the same two stages (same dtype, no placement) becomes
one pair: the sender reshapes each scalar to [1] and concatenates them, the receiver slices
them back out, so the stage sends one message per peer instead of one per gradient. A group
is packed only when every reader of its values comes after its last pair in program order
(the packed message is sent there); otherwise it is left as it is."""

from __future__ import annotations

from collections import defaultdict

from ..ir.core import Attrs, Op, Phase, Value
from ..ir.types import TensorType


def pack_update_scalars(ops: list[Op], names) -> list[Op]:
    """``ops`` with the update's scalar send/recv pairs between two stages packed;
    ``names`` makes fresh value names."""
    recv_at = {op.attrs["tag"]: k for k, op in enumerate(ops) if op.name == "recv"}
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for k, op in enumerate(ops):
        if op.name != "send" or op.phase is not Phase.update:
            continue
        j = recv_at[op.attrs["tag"]]
        t = ops[j].results[0].type
        if t.shape == () and not t.placements:
            groups[(op.stage, ops[j].stage, op.attrs["axis"], str(t.dtype))].append((k, j))
    first_read: dict[str, int] = {}
    for k, op in enumerate(ops):
        for n in op.inputs:
            first_read.setdefault(n, k)
    drop: set[int] = set()
    insert: dict[int, list[Op]] = {}
    for (src, dst, _axis, _), pairs in groups.items():
        if len(pairs) < 2:
            continue
        at = max(j for _, j in pairs)
        got = [ops[j].results[0] for _, j in pairs]
        if any(first_read.get(v.name, len(ops)) <= at for v in got):
            continue
        send0, recv0 = ops[pairs[0][0]], ops[pairs[0][1]]
        dtype = got[0].type.dtype
        row = TensorType((1,), dtype)
        flat = []
        new: list[Op] = []
        for k, _ in pairs:
            v = Value(names(f"{ops[k].inputs[0]}.row"), row)
            new.append(Op("reshape", (ops[k].inputs[0],), (v,), phase=Phase.update,
                          stage=src, loc=ops[k].loc))
            flat.append(v.name)
        packed = Value(names("norms.packed"), TensorType((len(pairs),), dtype))
        new.append(Op("concat", tuple(flat), (packed,), Attrs(dim=0), phase=Phase.update,
                      stage=src, loc=send0.loc))
        new.append(send0.replace(inputs=(packed.name,)))
        there = Value(names(f"{packed.name}.s{dst}"), packed.type)
        new.append(Op("recv", (), (there,), recv0.attrs, phase=Phase.update, stage=dst,
                      loc=recv0.loc))
        for i, v in enumerate(got):
            piece = Value(names(f"{v.name}.row"), row)
            new.append(Op("slice", (there.name,), (piece,),
                          Attrs(starts=(i,), limits=(i + 1,)), phase=Phase.update, stage=dst,
                          loc=recv0.loc))
            new.append(Op("reshape", (piece.name,), (v,), phase=Phase.update, stage=dst,
                          loc=recv0.loc))
        drop.update(k for pair in pairs for k in pair)
        insert[at] = new
    out: list[Op] = []
    for k, op in enumerate(ops):
        if k not in drop:
            out.append(op)
        out.extend(insert.get(k, ()))
    return out
