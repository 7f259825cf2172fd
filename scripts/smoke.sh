#!/usr/bin/env bash
# The main job: set up, build, install, and run the smoke check. With a Hopper GPU and torch it runs
# the GPU kernels against the CPU reference; without one it runs the CPU reference end to end and
# says that the GPU path was skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
open-vc-attn-check --smoke "$@"
