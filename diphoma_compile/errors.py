"""The DiphomaError hierarchy: every user-facing failure says what is wrong and what to do."""

from __future__ import annotations

import os
import traceback


class DiphomaError(Exception):
    """Base class of every error diphoma_compile raises on purpose."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


def user_line(exc: BaseException, internal: tuple[str, ...]) -> str | None:
    """``file:line: code`` of the innermost frame of the user's code in ``exc``'s
    traceback, for a frontend's error: frames under ``internal`` (the framework, this
    package) are skipped, and installed packages (site-packages) count as the user's code
    only when no frame of the user's own files is there (a model from a library, called
    from the user's step)."""
    own = lib = None
    for fs in traceback.extract_tb(exc.__traceback__):
        if fs.filename.startswith(internal) or fs.filename.startswith("<"):
            continue
        text = f"{os.path.basename(fs.filename)}:{fs.lineno}: {(fs.line or '').strip()}"
        if "site-packages" in fs.filename or "dist-packages" in fs.filename:
            lib = text
        else:
            own = text
    return own or lib


def no_keywords(kwargs: dict) -> None:
    """DiphomaError for a compiled step called with keyword arguments: its arguments are
    bound by position, as the example's were."""
    if kwargs:
        raise DiphomaError(f"the compiled step is called with keyword arguments "
                           f"({', '.join(kwargs)}); it takes its arguments by position, as "
                           "the example arguments were given",
                           hint="call it as step(model, opt, batch), in the order of the "
                                "example arguments")


class DiphomaWarning(UserWarning):
    """A plan that runs but differs from the single-device step in a way the user should
    know of (a forward that combines examples of the batch, split over devices)."""


class IRError(DiphomaError):
    """Something is wrong with an IR graph."""


class IRParseError(IRError):
    """IR text that does not parse; carries the line and column."""

    def __init__(self, message: str, *, line: int, col: int, source_line: str,
                 hint: str | None = None) -> None:
        self.line = line
        self.col = col
        caret = " " * max(col - 1, 0) + "^"
        super().__init__(f"line {line}, col {col}: {message}\n  | {source_line}\n  | {caret}",
                         hint=hint)


class IRVerifyError(IRError):
    """A graph that breaks an IR invariant; the message shows the op and its neighbours."""

    def __init__(self, message: str, *, op_path: str | None = None, context: str = "",
                 hint: str | None = None) -> None:
        self.op_path = op_path
        self.reason = message
        text = message if not context else f"{message}\n{context}"
        super().__init__(text, hint=hint)


class UnknownOpError(IRError):
    """An op name that is not in the op vocabulary."""


class PassError(DiphomaError):
    """A pass failed, or its output did not verify."""

    def __init__(self, message: str, *, pass_name: str, before: tuple[str, ...] = (),
                 hint: str | None = None) -> None:
        self.pass_name = pass_name
        self.before = before
        super().__init__(message, hint=hint)


class PassSpecError(DiphomaError):
    """A pipeline spec string that names an unknown pass or a bad option."""


class MeshError(DiphomaError):
    """A mesh that is malformed or does not fit the program or the world."""


class FrontendError(DiphomaError):
    """A step that a frontend cannot trace: the construct and where it came from."""


class UnsupportedOpError(FrontendError):
    """A framework op with no mapping into the IR (and no opaque fallback)."""


class BackendError(DiphomaError):
    """An IR graph that a backend cannot turn into a runnable program, or a call that does
    not match the graph's signature."""
