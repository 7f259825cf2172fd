#!/usr/bin/env bash
# The main job: set up, build, install, and run the smoke check (open-vc-attn-check --smoke). With a
# Hopper GPU and torch it runs the GPU kernels against the CPU reference; without them it runs the CPU
# reference end to end and says in one line why the GPU path was skipped and how to get it.
# Needs no GoogleTest and runs no apt-get; arguments go to open-vc-attn-check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/setup.sh
openvc_python
"$PY" -m open_vc_attn.cli.check --smoke "$@"
