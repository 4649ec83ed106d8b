"""The default pass pipeline of ``parallelize`` and ``diphoma inspect``."""

from __future__ import annotations


def default_passes(axis: str, grad_bytes: int | None = None, *, layout: str = "flat",
                   shard_params: bool = False) -> str:
    """Data parallelism plus weight-update sharding over ``axis`` (``layout`` is what the
    backend runs: flat shards, or whole dimensions where shardings need even splits), with
    ``shard_params`` the parameters held as shards too (ZeRO-3 / FSDP class), then
    communication fusion and scheduling. Given the gradient bytes, buckets are a quarter of
    them (so the first can overlap the rest of backward), between 1 and 25 MB."""
    spec = (f"dce,data-parallel{{axis={axis}}},"
            f"weight-update-sharding{{axis={axis}, layout={layout}}},dce")
    if shard_params:
        spec += f",shard-params{{axis={axis}}},dce"
    if grad_bytes is None:
        return spec
    return spec + f",comm-fusion{{bucket-mb={bucket_mb(grad_bytes):g}}},schedule-comm"


def bucket_mb(grad_bytes: int) -> float:
    """The default bucket size for a model with this many bytes of gradients."""
    return round(min(25.0, max(1.0, grad_bytes / 4 / 1e6)), 1)
