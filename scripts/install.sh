#!/usr/bin/env bash
# Builds and installs the Python package open_vc_attn (libopenvc + the nanobind module) from this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
"$PY" -m pip install -q --no-build-isolation .
