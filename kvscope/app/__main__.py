"""``python -m kvscope.app``: the explorer (see kvscope.app.main)."""

from kvscope.app.main import main

main()
