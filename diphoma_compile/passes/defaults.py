"""The default pass pipeline of ``parallelize`` and ``diphoma inspect``."""

from __future__ import annotations

# compression presets: the passes each adds after weight-update sharding (opt-in: on a fast
# link quantizing can cost more time than the bytes it saves)
COMPRESSION = {
    "sdp4bit": ("quantize-grads{{axis={axis}, bits=4, intra-bits=8, group=128, hadamard=32, "
                "levels=auto}},quantize-weight-diff{{axis={axis}, bits=4, group=2048, "
                "rounding=stochastic}}"),
}


def default_passes(axis: str, grad_bytes: int | None = None, *, layout: str = "flat",
                   shard_params: bool = False, compression: str | None = None,
                   local: int = 0, counts: str = "global") -> str:
    """Data parallelism plus weight-update sharding over ``axis`` (``layout`` is what the
    backend runs: flat shards, or whole dimensions where shardings need even splits and flat
    shards for tensors with none), with
    ``shard_params`` the parameters held as shards too (ZeRO-3 / FSDP class), then
    communication fusion and scheduling. Given the gradient bytes, buckets are a quarter of
    them (so the first can overlap the rest of backward), between 1 and 25 MB.
    ``compression`` names a preset of ``COMPRESSION`` (SDP4Bit's quantized gradients and
    weight differences), run after weight-update sharding; ``local`` devices per node (a
    mesh with a node axis) gives its gradients two hops. ``counts``: data-parallel's
    (``local`` under a pipeline, whose microbatches each divide by their own count)."""
    dp = f"axis={axis}" + ("" if counts == "global" else f", counts={counts}")
    spec = (f"dce,data-parallel{{{dp}}},"
            f"weight-update-sharding{{axis={axis}, layout={layout}}},dce")
    if compression is not None:
        preset = COMPRESSION[compression].format(axis=axis)
        if local:
            preset = preset.replace("levels=auto", f"levels=2, local={local}")
        spec += "," + preset + ",dce"
    if shard_params:
        spec += f",shard-params{{axis={axis}}},dce"
    if grad_bytes is None:
        return spec
    return spec + f",comm-fusion{{bucket-mb={bucket_mb(grad_bytes):g}}},schedule-comm"


def bucket_mb(grad_bytes: int) -> float:
    """The default bucket size for a model with this many bytes of gradients."""
    return round(min(25.0, max(1.0, grad_bytes / 4 / 1e6)), 1)
