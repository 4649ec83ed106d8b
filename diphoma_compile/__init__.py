"""diphoma_compile: turns a single-device training step into a distributed program."""

from .api import ParallelStep, compile, parallelize, trace
from .errors import DiphomaError
from .mesh import Mesh

__version__ = "0.1.0"
__all__ = ["DiphomaError", "Mesh", "ParallelStep", "__version__", "compile", "parallelize",
           "trace"]
