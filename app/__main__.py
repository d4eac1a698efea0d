"""``python -m app``: the explorer (see app.main)."""

from app.main import main

main()
