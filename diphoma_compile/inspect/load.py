"""Loading a user's Python file for ``diphoma inspect`` and finding what in it to plan.

The file was not written for this tool: it is run as a module of its own (its directory on
``sys.path`` so that its sibling imports work, ``if __name__ == "__main__"`` blocks not run);
a file inside a package is imported under its package name, so that its relative imports
work (a transformers ``modeling_*.py``), and a module path is imported. What it defines
is sorted into candidates: nn.Module classes, flax modules, and step
functions that come with an example-inputs function. Errors raised by the user's code are
shown with their type, message and the line of the file they came from."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
import itertools
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from .spec import InspectError

# the names an example-inputs function may have (``<step>_inputs`` is tried first)
INPUT_FUNCS = ("example_inputs", "example_args", "make_example_inputs", "get_example_inputs")
_counter = itertools.count()


Kinds = dict[str, tuple[type, ...]]     # kind name -> a framework's model base classes


@dataclass(frozen=True)
class Candidate:
    """Something in the file that inspect can plan."""

    name: str
    kind: str                 # torch-module, flax-module, nnx-module, step, factory
    obj: Any
    inputs_fn: Callable | None = None     # a step's example-inputs function
    kinds: Kinds = field(default_factory=dict)   # the model kinds it was told apart from

    def describe(self) -> str:
        """One line for the candidate list: kind and signature."""
        what = {"torch-module": "torch nn.Module", "flax-module": "flax.linen Module",
                "nnx-module": "flax.nnx Module", "step": "training step",
                "factory": "function"}[self.kind]
        extra = f" with {self.inputs_fn.__name__}()" if self.inputs_fn else ""
        return f"{self.name:24s} {what}{extra}  {self.name}{_signature(self.obj)}"


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def split_target(target: str) -> tuple[str, str | None]:
    """``path/model.py:GPT`` -> (``path/model.py``, ``GPT``); no NAME -> None."""
    path, sep, name = target.rpartition(":")
    if sep and name.isidentifier() and path:
        return path, name
    return target, None


def user_error(exc: BaseException, path: Path, what: str) -> InspectError:
    """An InspectError for an exception the user's code raised: its type, its message and
    the innermost line of the user's file in the traceback."""
    where = None
    for fs in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(fs.filename) == str(path) or fs.filename.startswith("<inspect"):
            where = f"{os.path.basename(fs.filename)}:{fs.lineno}: {(fs.line or '').strip()}"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    at = f"\n  at {where}" if where else ""
    return InspectError(f"{what} raised {type(exc).__name__}{': ' + first if first else ''}{at}",
                        hint="fix the code (or the expression), then run inspect again")


def inputs_fn_error(exc: BaseException, fn: Callable) -> InspectError:
    """``user_error`` for an exception the file's example-inputs function ``fn`` raised,
    naming it and its line."""
    return user_error(exc, Path(inspect.getfile(fn)).resolve(), f"{fn.__name__}()")


def package_module(path: Path) -> tuple[Path, str] | None:
    """For a file inside a package (its folder has an ``__init__.py``, and so on up): the
    folder above the outermost package and the file's dotted module name, e.g.
    (``site-packages``, ``transformers.models.llama.modeling_llama``); None otherwise."""
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        parts.insert(0, folder.name)
        folder = folder.parent
    if not path.stem.isidentifier() or folder == path.parent:
        return None
    return folder, ".".join(parts)


def _is_module_path(text: str) -> bool:
    return not text.endswith(".py") and all(p.isidentifier() for p in text.split("."))


def load_file(path_text: str) -> ModuleType:
    """The module to plan from: a Python file, run as a fresh module of its own (its folder
    on ``sys.path`` for its sibling imports), or, when the file is part of a package, imported
    under its package name so that its relative imports work; or a module path
    (``transformers.models.llama.modeling_llama``), imported. InspectError when it is
    missing, not a Python file, or raises while it runs."""
    path = Path(path_text).expanduser().resolve()
    if not path.exists():
        if _is_module_path(path_text):
            return _import(path_text, path_text)
        raise InspectError(f"no such file: {path_text}",
                           hint="give the path of a Python file that defines the model, or a "
                                "module path such as package.module:NAME")
    if path.is_dir():
        raise InspectError(f"{path_text} is a directory", hint="give a .py file in it")
    in_package = package_module(path)
    if in_package is not None:
        root, dotted = in_package
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        try:
            module = _import(dotted, path_text, path)
        except InspectError as e:
            # a file that imports its siblings by their bare names was written to run from
            # its own folder, not as part of the package: run it that way below
            if not _sibling_import(e.__cause__, path):
                raise
        else:
            here = Path(module.__file__ or "").resolve()
            if here != path:
                top = dotted.split(".")[0]
                raise InspectError(f"{path_text} is {dotted} of package {top}, but {dotted} "
                                   f"is imported from {here}",
                                   hint=f"run inspect where {top} is the copy you mean (its "
                                        "folder first on PYTHONPATH)")
            return module
    name = f"_diphoma_user_{path.stem}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InspectError(f"{path_text} is not a Python file Python can import",
                           hint="give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module       # dataclasses and pickling look modules up by name
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise InspectError(f"{path_text} does not parse: {e.msg} (line {e.lineno})") from None
    except ImportError as e:
        if "relative import" not in str(e):
            raise user_error(e, path, f"running {path.name}") from e
        err = user_error(e, path, f"running {path.name}")
        raise InspectError(err.message, hint=(
            f"{path.name} imports relative to a package, but {path.parent.name}/ has no "
            "__init__.py: give the module path instead (package.module:NAME, with the "
            "package's folder on PYTHONPATH), or add the __init__.py")) from e
    except (Exception, SystemExit) as e:
        raise user_error(e, path, f"running {path.name}") from e
    return module


def _sibling_import(e: BaseException | None, path: Path) -> bool:
    """Whether ``e`` is a failed import of a module that sits next to ``path``."""
    if not isinstance(e, ModuleNotFoundError) or not e.name:
        return False
    top = e.name.split(".")[0]
    return (path.parent / f"{top}.py").is_file() or (path.parent / top).is_dir()


def _import(dotted: str, shown: str, path: Path | None = None) -> ModuleType:
    """``import dotted``; InspectError when there is no such module or it raises."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())     # as ``python -m`` would: modules of this folder
    try:
        return importlib.import_module(dotted)
    except SyntaxError as e:
        raise InspectError(f"{e.filename or shown} does not parse: {e.msg} "
                           f"(line {e.lineno})") from None
    except ModuleNotFoundError as e:
        if e.name and (dotted == e.name or dotted.startswith(e.name + ".")):
            raise InspectError(f"no such file or module: {shown}",
                               hint="give the path of a Python file, or the module path of "
                                    "an importable module (package.module:NAME)") from None
        raise user_error(e, path or _origin(dotted), f"importing {shown}") from e
    except (Exception, SystemExit) as e:
        raise user_error(e, path or _origin(dotted), f"importing {shown}") from e


def _origin(dotted: str) -> Path:
    """The file of module ``dotted`` (for pointing at its line), without running it again."""
    module = sys.modules.get(dotted)
    return Path(getattr(module, "__file__", None) or dotted).resolve()


def example_args(made: Any, fn: Callable) -> tuple:
    """What a file's example-inputs function ``fn`` returned, as the step's arguments: a
    tuple or list of them; InspectError naming ``fn`` for anything else (None: a function
    that forgot its return)."""
    if isinstance(made, (tuple, list)) and made:
        return tuple(made)
    name = getattr(fn, "__name__", "example_inputs")
    raise InspectError(f"{name}() returned {made!r:.80}, not the step's example arguments",
                       hint=f"make {name}() return them as a tuple, e.g. return model, opt, "
                            "batch (PyTorch) or params, opt_state, batch (JAX)")


def _inputs_fn(module: ModuleType, step: str) -> Callable | None:
    for n in (f"{step}_inputs", f"{step}_example_inputs", *INPUT_FUNCS):
        fn = getattr(module, n, None)
        if callable(fn) and not isinstance(fn, type):
            return fn
    return None


def _defined_here(module: ModuleType) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items()
            if getattr(v, "__module__", None) == module.__name__ and not k.startswith("_")}


def _referenced_classes(module: ModuleType, names: set[str]) -> set[str]:
    """Module classes that another module class of the file uses (its building blocks)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return set()
    used: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and sub.id in names and sub.id != node.name:
                    used.add(sub.id)
    return used


def kind_of(obj: Any, kinds: Kinds) -> str | None:
    """The kind of a model class (a subclass of one of ``kinds``' base classes), else None."""
    if isinstance(obj, type):
        for kind, classes in kinds.items():
            if issubclass(obj, classes) and obj not in classes:
                return kind
    return None


def candidates(module: ModuleType, kinds: Kinds) -> list[Candidate]:
    """What the file defines that inspect can plan: steps with example inputs first, then
    the module classes no other module class of the file is built from."""
    here = _defined_here(module)
    steps = [Candidate(n, "step", f, _inputs_fn(module, n), kinds) for n, f in here.items()
             if inspect.isfunction(f) and "step" in n.lower() and _inputs_fn(module, n)]
    mods = {n: k for n, v in here.items() if (k := kind_of(v, kinds))}
    blocks = _referenced_classes(module, set(mods))
    roots = [Candidate(n, k, here[n], kinds=kinds) for n, k in mods.items() if n not in blocks]
    return steps + roots


def resolve(module: ModuleType, path: str, name: str | None, kinds: Kinds
            ) -> Candidate | None:
    """The candidate called ``name`` (any module class, factory or step of the file), the
    single candidate when ``name`` is None; InspectError listing the candidates otherwise.
    None when there is nothing to resolve but ``--init`` will say what to build."""
    found = candidates(module, kinds)
    if name is None:
        steps = [c for c in found if c.kind == "step"]
        pick = steps if steps else found
        if len(pick) == 1:
            return pick[0]
        if not pick:
            return None
        raise InspectError(f"{os.path.basename(path)} defines several things to plan; "
                           "name one as PATH:NAME:\n" + _listing(pick))
    obj = getattr(module, name, None)
    if obj is None:
        close = difflib.get_close_matches(name, [n for n in vars(module)
                                                 if not n.startswith("_")], n=3)
        hint = f"did you mean {', '.join(close)}?" if close else None
        listing = ("\n" + _listing(found)) if found else ""
        raise InspectError(f"{os.path.basename(path)} has no {name!r}" +
                           (f"; it defines:{listing}" if listing else ""), hint=hint)
    kind = kind_of(obj, kinds)
    if kind is not None:
        return Candidate(name, kind, obj, kinds=kinds)
    if inspect.isfunction(obj) and "step" in name.lower():
        fn = _inputs_fn(module, name)
        if fn is None:
            raise InspectError(
                f"{name} looks like a training step, but {os.path.basename(path)} defines "
                "no function that makes its example inputs",
                hint=f"define {name}_inputs() or example_inputs() returning the step's "
                     "arguments, or name the model class instead")
        return Candidate(name, "step", obj, fn, kinds)
    if callable(obj):
        return Candidate(name, "factory", obj, kinds=kinds)
    raise InspectError(f"{name} in {os.path.basename(path)} is a {type(obj).__name__}, not "
                       "a module class, a function that builds a model, or a step",
                       hint="name a model class (PATH:GPT) or pass --init EXPR")


def _listing(cands: list[Candidate]) -> str:
    return "\n".join("  " + c.describe() for c in cands)


def evaluate(expr: str, module: ModuleType, what: str, extra: dict[str, Any] | None = None,
             example: str = "--init 'GPT(GPTConfig())'") -> Any:
    """Evaluate a Python expression in the file's namespace (plus ``extra`` names); an
    InspectError with the expression's own error when it does not parse or raises
    (``example``: a well-formed use of the option, for the hint)."""
    try:
        code = compile(expr, f"<inspect {what}>", "eval")
    except SyntaxError as e:
        raise InspectError(f"{what} {expr!r} does not parse: {e.msg}",
                           hint=f"give a Python expression, e.g. {example}") from None
    scope = dict(vars(module))
    scope.update(extra or {})
    try:
        return eval(code, scope)  # noqa: S307 - the user's own expression, on purpose
    except Exception as e:
        raise user_error(e, Path(module.__file__ or "").resolve(), f"{what} {expr!r}") from e


CONFIG_SUFFIXES = ("Config", "Args", "Params")


def _required(obj: Any) -> list[inspect.Parameter]:
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p for p in params if p.default is p.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _annotated_class(p: inspect.Parameter, module: ModuleType) -> str | None:
    """The name of the class ``p`` is annotated with (``config: GPTConfig``), also when the
    annotation is a string; None for no annotation or one that is not a plain class."""
    ann = p.annotation
    if ann is p.empty:
        return None
    if isinstance(ann, str):
        ann = vars(module).get(ann) if ann.isidentifier() else None
    return ann.__name__ if isinstance(ann, type) and ann.__module__ != "builtins" else None


def init_example(cand: Candidate, module: ModuleType) -> str:
    """An ``--init`` expression to suggest for a class that needs arguments: the config
    class its ``__init__`` is annotated with, or the one config class the file defines
    (a class named ...Config/Args/Params that is not itself a model), as
    ``GPT(GPTConfig())``; else the arguments by name, ``NeedsArgs(width=..., depth=...)``."""
    needed = _required(cand.obj)
    annotated = [c for p in needed if (c := _annotated_class(p, module))]
    if len(needed) == 1 and annotated:
        return f"{cand.name}({annotated[0]}())"
    configs = [n for n, v in _defined_here(module).items()
               if isinstance(v, type) and n.endswith(CONFIG_SUFFIXES) and v is not cand.obj
               and kind_of(v, cand.kinds) is None]
    if len(needed) == 1 and len(configs) == 1:
        return f"{cand.name}({configs[0]}())"
    args = ", ".join(f"{p.name}=..." for p in needed)
    return f"{cand.name}({args or '...'})"


def construct(cand: Candidate, module: ModuleType) -> Any:
    """``NAME()``: a model class or factory called without arguments; InspectError saying
    which arguments it needs (use --init) when it takes some."""
    try:
        inspect.signature(cand.obj).bind()
    except TypeError:
        example = init_example(cand, module)
        raise InspectError(f"{cand.name}{_signature(cand.obj)} needs arguments to build",
                           hint=f"pass --init EXPR, e.g. --init '{example}'") from None
    except ValueError:
        pass
    try:
        return cand.obj()
    except Exception as e:
        raise user_error(e, Path(module.__file__ or "").resolve(), f"{cand.name}()") from e
