"""``python -m diphoma_compile``: the command line."""

import sys

from .cli import main

sys.exit(main())
