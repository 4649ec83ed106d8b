"""``python -m diphoma_compile``: the command line."""

from .cli import run

run()
