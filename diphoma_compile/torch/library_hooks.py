"""What other libraries ask of a tracer, answered while a step is traced.

Hugging Face transformers asks ``is_tracing(tensor)`` before taking a shortcut that reads
tensor data on the host (``masking_utils``: whether a padding mask or packed positions
can be skipped, seen with ``use_cache=False``, gradient checkpointing or an explicit
``attention_mask``). It recognises dynamo, torch.jit, fx proxies and FakeTensors, not a
FunctionalTensor over a FakeTensor, which is what a step's tensors are here
(``capture.py``): without this its eager shortcut asks the trace for data it does not
have. Patched only where the library is already imported, and only for the trace."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

from torch._subclasses.functional_tensor import FunctionalTensor


def _traced_too(is_fake: Any) -> Any:
    def is_fake_tensor(x: Any) -> bool:
        return isinstance(x, FunctionalTensor) or is_fake(x)
    return is_fake_tensor


@contextlib.contextmanager
def tracing_known_to_libraries() -> Iterator[None]:
    """During the trace: transformers' ``is_fake_tensor`` (read by its ``is_tracing``)
    also recognises the step's FunctionalTensors."""
    with contextlib.ExitStack() as stack:
        utils = sys.modules.get("transformers.utils.import_utils")
        if utils is not None and callable(getattr(utils, "is_fake_tensor", None)):
            stack.enter_context(mock.patch.object(utils, "is_fake_tensor",
                                                  _traced_too(utils.is_fake_tensor)))
        yield
