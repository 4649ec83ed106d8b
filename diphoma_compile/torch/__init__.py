"""PyTorch behind the Framework protocol: capture, the aten<->IR table, lowering and runtimes.
The only package that imports torch."""
