"""``python -m kvscope``: see kvscope.engine.cli."""

import sys

from kvscope.engine.cli import main

sys.exit(main())
