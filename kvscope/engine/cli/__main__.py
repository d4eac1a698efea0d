"""``python -m kvscope.engine.cli``: the same as ``python -m kvscope`` and ``kvscope``."""

import sys

from kvscope.engine.cli.parser import main

sys.exit(main())
