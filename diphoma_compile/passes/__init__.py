"""Passes over the IR: the Pass type, the registry, pipelines, and the built-in passes."""

from . import (  # noqa: F401  (registers the built-in passes)
    comm_fusion, cse, data_parallel, dce, schedule_comm, weight_update_sharding)
from .base import (ENTRY_POINT_GROUP, Pass, PassContext, PassFailure, PassRecord, Pipeline,
                   available_passes, get_pass, parse_spec, register_pass, unregister_pass)

__all__ = ["ENTRY_POINT_GROUP", "Pass", "PassContext", "PassFailure", "PassRecord", "Pipeline",
           "available_passes", "get_pass", "parse_spec", "register_pass", "unregister_pass"]
