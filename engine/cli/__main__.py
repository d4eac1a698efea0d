"""``python -m engine.cli``: the same as ``python -m engine`` and ``kvscope``."""

import sys

from engine.cli.parser import main

sys.exit(main())
