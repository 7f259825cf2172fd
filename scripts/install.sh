#!/usr/bin/env bash
# Development install: builds libopenvc and the nanobind module and installs open_vc_attn into the
# environment scripts/setup.sh picks (the project venv .venv unless PYTHON, a venv or a conda env is
# active). No build isolation, so the build reuses the installed, pinned build requirements and a
# rebuild is incremental (build/py-*). The normal install for users is `pip install .`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
openvc_python
openvc_check_tools
openvc_require requirements/build.txt
echo "install: building and installing open_vc_attn into $PY (CUDA build: a few minutes the first time)"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# -v shows CMake's and the compiler's progress during the long first build.
"$PY" -m pip install -v --no-build-isolation .
