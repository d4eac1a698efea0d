"""``python -m kvscope``: the CLI (see kvscope.engine.cli); installed, the ``kvscope`` console script."""

import sys

from kvscope.engine.cli import main

sys.exit(main())
