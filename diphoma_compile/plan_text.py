"""The plan as text: a summary a person reads first, then tables (tensors, collectives)
and the decisions the passes recorded (what stayed replicated and why)."""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan


def human(n: float) -> str:
    """Bytes as B / KB / MB / GB (powers of 1000, like the benchmarks)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _ratio(part: int, whole: int) -> str:
    if not whole or part == whole:
        return ""
    return f" (1/{whole / part:.2f} of {human(whole)})" if part else f" (of {human(whole)})"


def _table(rows: list[list[str]], head: list[str]) -> list[str]:
    widths = [max(len(str(r[k])) for r in [head, *rows]) for k in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return ["  " + fmt.format(*head).rstrip()] + ["  " + fmt.format(*r).rstrip() for r in rows]


def _group(name: str) -> str:
    """A layer-agnostic key: numbers in a name become #, so repeated layers group."""
    return re.sub(r"(?<=[._/])\d+(?=[._/])", "#", name)


def render(plan: Plan, max_rows: int = 60) -> str:
    """The text report of ``plan``."""
    m = plan.memory
    mesh = ", ".join(f"{a}={n}" for a, n in plan.mesh.items()) or "one device"
    kinds = Counter(c.kind for c in plan.collectives if c.kind != "take_shard")
    lines = [
        f"plan for @{plan.graph} on mesh {mesh}",
        f"passes: {', '.join(plan.passes) or 'none'}",
        "per device:",
        f"  parameters       {human(m.params)}{_ratio(m.params, m.single_device_params)}",
        f"  gradients        {human(m.grads)}{_ratio(m.grads, m.single_device_grads)}",
        f"  optimizer state  {human(m.opt_state)}"
        f"{_ratio(m.opt_state, m.single_device_opt_state)}",
        f"communication per step per device: {human(plan.comm_bytes_per_step)} in "
        f"{sum(kinds.values())} collectives"
        + (" (" + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) + ")"
           if kinds else ""),
        "",
        "tensors:",
    ]
    rows = [[t.name, t.role, f"{t.dtype}{list(t.shape)}", t.placement,
             human(t.bytes_per_device)] for t in plan.tensors]
    lines += _table(_fold(rows, max_rows), ["name", "role", "type", "placement",
                                            "bytes/device"])
    lines += ["", "collectives:"]
    crow = [[c.kind, c.axis, c.reduction or "", c.value, c.serves, human(c.bytes_per_device)]
            for c in plan.collectives]
    lines += _table(_fold(crow, max_rows), ["kind", "axis", "op", "value", "for",
                                            "bytes/device"]) if crow else ["  none"]
    wus = plan.notes.get("weight-update-sharding", {})
    if wus.get("replicated"):
        lines += ["", "kept whole in the update:"]
        lines += [f"  {what}: {why}" for what, why in wus["replicated"]]
    if wus.get("expanded"):
        lines += ["", f"expanded to shard: {len(wus['expanded'])} op(s) "
                      f"({', '.join(sorted(set(wus['expanded'])))})"]
    if wus.get("grads_left_sharded"):
        lines += ["", "gradient outputs left sharded (no full .grad): "
                  + ", ".join(wus["grads_left_sharded"])]
    return "\n".join(lines) + "\n"


def _fold(rows: list[list[str]], max_rows: int) -> list[list[str]]:
    """At most ``max_rows`` rows: repeated layers (same name but for layer numbers, same
    type and placement) fold into one row with a count."""
    if len(rows) <= max_rows:
        return rows
    groups: dict[tuple, list[list[str]]] = {}
    for r in rows:
        groups.setdefault((_group(r[0]), *r[1:]), []).append(r)
    out = []
    for key, rs in groups.items():
        if len(rs) == 1:
            out.append(rs[0])
        else:
            out.append([f"{key[0]} (x{len(rs)})", *key[1:]])
    if len(out) > max_rows:
        out = out[:max_rows] + [[f"... {len(out) - max_rows} more rows",
                                 *[""] * (len(rows[0]) - 1)]]
    return out
