"""Pipeline spec strings: ``"dce,data-parallel{axis=dp},comm-fusion{bucket-mb=25}"`` read
into pass instances, each option converted by the type of its dataclass field."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from ..errors import PassSpecError
from .base import Pass, get_pass, kebab

_SPEC_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_\-]*)|(?P<punct>[{},=])"
                         r"|(?P<value>[^{},=\s]+))")


def _coerce(pass_cls: type[Pass], key: str, raw: str) -> Any:
    fields = {kebab(f.name): f for f in dataclasses.fields(pass_cls)}
    f = fields.get(key)
    if f is None:
        known = ", ".join(fields) or "none"
        raise PassSpecError(f"pass {pass_cls.name!r} has no option {key!r} (options: {known})")
    hint_t = typing.get_type_hints(pass_cls).get(f.name, str)
    try:
        if hint_t is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if hint_t in (int, float, str):
            return hint_t(raw)
        return raw
    except ValueError:
        raise PassSpecError(f"option {key}={raw!r} of pass {pass_cls.name!r} should be "
                            f"{getattr(hint_t, '__name__', hint_t)}") from None


def parse_spec(spec: str) -> list[Pass]:
    """``"dce,cse,comm-fusion{bucket-mb=25}"`` -> pass instances, options typed."""
    if not isinstance(spec, str):
        raise PassSpecError(f"a pass spec is a string of passes, not {type(spec).__name__} "
                            f"{spec!r}", hint="e.g. passes=\"dce,data-parallel{axis=dp}\"; "
                                             "join a list with ','.join(...)")
    toks: list[tuple[str, str, int]] = []
    pos = 0
    while pos < len(spec):
        if spec[pos:].strip() == "":
            break
        m = _SPEC_TOKEN.match(spec, pos)
        if m is None:
            raise PassSpecError(f"cannot read pass spec {spec!r} at position {pos}")
        kind = m.lastgroup
        toks.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    passes: list[Pass] = []
    i = 0

    def err(msg: str, at: int) -> PassSpecError:
        return PassSpecError(f"{msg} in pass spec {spec!r} at position {at}",
                             hint="write passes as name or name{option=value, ...}, "
                                  "separated by commas")
    while i < len(toks):
        kind, text, at = toks[i]
        if kind != "name":
            raise err(f"expected a pass name, found {text!r}", at)
        cls = get_pass(text)
        i += 1
        opts: dict[str, Any] = {}
        if i < len(toks) and toks[i][1] == "{":
            i += 1
            while i < len(toks) and toks[i][1] != "}":
                if i + 2 >= len(toks) or toks[i][0] != "name" or toks[i + 1][1] != "=":
                    raise err("expected option=value", toks[i][2])
                key, raw = toks[i][1], toks[i + 2][1]
                if toks[i + 2][0] == "punct":
                    raise err(f"option {key!r} has no value", toks[i + 2][2])
                if kebab(key) in opts:
                    raise err(f"option {key!r} is given twice", toks[i][2])
                opts[kebab(key)] = _coerce(cls, kebab(key), raw)
                i += 3
                if i < len(toks) and toks[i][1] == ",":
                    i += 1
            if i >= len(toks):
                raise err("unclosed '{'", len(spec))
            i += 1
        passes.append(cls(**{k.replace("-", "_"): v for k, v in opts.items()}))
        if i < len(toks):
            if toks[i][1] != ",":
                raise err(f"expected ',' between passes, found {toks[i][1]!r}", toks[i][2])
            i += 1
            if i == len(toks):
                raise err("trailing ','", toks[i - 1][2])
    return passes
