#!/usr/bin/env bash
# Create .venv and install the project with its dev extras.
#
# torch is the one heavy dependency and gets special care:
# - if the system Python already has torch (a GPU image ships its own CUDA build),
#   the venv sees it through --system-site-packages and nothing is reinstalled;
# - otherwise we ask for exactly torch==2.13.0, which pip takes from the CPU wheel
#   on disk; an unpinned `torch` would pull a multi-GB CUDA build from the index.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: reusing the system torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
    "$PYTHON" -m venv --system-site-packages "$VENV"
else
    "$PYTHON" -m venv "$VENV"
    echo "setup: installing torch==2.13.0 (CPU build)"
    "$VENV/bin/pip" install --quiet "torch==2.13.0"
fi
"$VENV/bin/pip" install --quiet -e ".[dev]"
echo "setup: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
