"""PyTorch behind the Framework protocol: capture, the aten<->IR table, lowering and runtimes.
The only package that imports torch."""

# the flops, bytes and strategies of the aten ops kept opaque, registered with the IR as soon
# as any part of the torch package is used (trace, inspect, a runtime)
from . import op_rules  # noqa: F401
