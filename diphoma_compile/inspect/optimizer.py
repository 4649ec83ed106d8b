"""``--optimizer``: a name from the framework's table of defaults, or an expression evaluated
in the user's file, checked to be that framework's optimizer type."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from .load import evaluate
from .spec import InspectError


def choose_optimizer(how: str, table: Mapping[str, tuple[str, Callable[..., Any]]],
                     make_args: tuple, module: ModuleType, names: dict[str, Any],
                     kind: type, kind_text: str, example: str) -> tuple[Any, str]:
    """(optimizer, how the report names it): ``table[how]`` made with ``make_args``, or the
    expression ``how`` evaluated with ``names`` in scope; InspectError when the expression
    gives something other than a ``kind``."""
    if how.lower() in table:
        text, make = table[how.lower()]
        return make(*make_args), text
    if how.isidentifier() and how not in vars(module) and how not in names:
        near = difflib.get_close_matches(how.lower(), list(table), n=1)
        raise InspectError(f"--optimizer {how!r} is not one of " + ", ".join(table),
                           hint=(f"did you mean {near[0]}? " if near else "") +
                                f"or give an expression {example}")
    quoted = re.search(r"'.*'", example)
    opt = evaluate(how, module, "--optimizer", names,
                   example=f"--optimizer {quoted.group(0) if quoted else example}")
    if not isinstance(opt, kind):
        raise InspectError(f"--optimizer {how!r} gave a {type(opt).__name__}, not "
                           f"{kind_text}",
                           hint="one of " + ", ".join(table) + f", or an expression {example}")
    return opt, how
