"""Passes over the IR: the Pass type and registry (base), spec strings (spec), the Pipeline
(pipeline), the default pipeline (defaults) and the built-in passes, one module each."""

from . import (  # noqa: F401  (registers the built-in passes)
    comm_fusion, cse, data_parallel, dce, pipeline_parallel, quantize_grads,
    quantize_weight_diff, schedule_comm, shard_params, tensor_parallel, weight_update_sharding)
from .base import (ENTRY_POINT_GROUP, Decision, Pass, PassContext, PassFailure, PassRecord,
                   available_passes, get_pass, register_pass, unregister_pass)
from .comm_fusion import CommFusionRecord
from .data_parallel import DataParallelRecord
from .pipeline import Pipeline
from .pipeline_parallel import PipelineRecord
from .quantize_grads import QuantizeGradsRecord
from .quantize_weight_diff import QuantizeWeightDiffRecord
from .schedule_comm import ScheduleCommRecord
from .shard_params import ShardParamsRecord
from .spec import parse_spec
from .tensor_parallel import TensorParallelRecord
from .weight_update_sharding import WeightUpdateShardingRecord

__all__ = ["ENTRY_POINT_GROUP", "CommFusionRecord", "DataParallelRecord", "Decision", "Pass",
           "PassContext", "PassFailure", "PassRecord", "Pipeline", "PipelineRecord",
           "QuantizeGradsRecord", "QuantizeWeightDiffRecord", "ScheduleCommRecord",
           "ShardParamsRecord", "TensorParallelRecord", "WeightUpdateShardingRecord",
           "available_passes", "get_pass", "parse_spec", "register_pass", "unregister_pass"]
