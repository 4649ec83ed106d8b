"""Passes over the IR: the Pass type, the registry, pipelines, and the built-in passes."""

from . import cse, data_parallel, dce, weight_update_sharding  # noqa: F401  (registers the built-ins)
from .base import (ENTRY_POINT_GROUP, Pass, PassContext, PassFailure, PassRecord, Pipeline,
                   available_passes, get_pass, parse_spec, register_pass, unregister_pass)

__all__ = ["ENTRY_POINT_GROUP", "Pass", "PassContext", "PassFailure", "PassRecord", "Pipeline",
           "available_passes", "get_pass", "parse_spec", "register_pass", "unregister_pass"]
