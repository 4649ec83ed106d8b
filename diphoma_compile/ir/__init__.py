"""The framework-neutral IR: types, ops, graphs, the text form, the verifier, analyses."""

from .core import (Attrs, Graph, Input, InputKind, InputRole, NameSupply, Op, Output, OutputKind,
                   OutputRole, Phase, Region, Value, walk_ops)
from .ops import OPS, Category, OpDef, is_effectful, is_pure, op_def, register_op
from .parser import parse
from .printer import print_graph
from .types import (FLAT, REPLICATE, DType, FlatShard, Partial, Placement, Replicate, Shard,
                    TensorType)
from .verify import verify

__all__ = [
    "Attrs", "Category", "DType", "FLAT", "FlatShard", "Graph", "Input", "InputKind",
    "InputRole", "NameSupply", "OPS", "Op", "OpDef", "Output", "OutputKind", "OutputRole",
    "Partial", "Phase", "Placement", "REPLICATE", "Region", "Replicate", "Shard", "TensorType",
    "Value", "is_effectful", "is_pure", "op_def", "parse", "print_graph", "register_op",
    "verify", "walk_ops",
]
