"""A file that imports relative to a package, in a folder that is not one."""

import torch.nn as nn

from .layers import Block  # noqa: F401


class Model(nn.Module):
    pass
