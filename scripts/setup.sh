#!/usr/bin/env bash
# Set-up for the development scripts (install.sh, smoke.sh and test.sh source this file): picks the
# Python environment, checks the build tools (one line with the fix for each missing one) and installs
# the pinned requirements that are not installed yet. It never reinstalls what is present (the GPU
# machine's environment has no network) and never runs apt-get.
#
# The Python environment, first match wins:
#   $PYTHON                       that interpreter, used as it is
#   an active venv or conda env   $VIRTUAL_ENV or $CONDA_PREFIX, or a python3 whose sys.prefix differs
#                                 from sys.base_prefix (a venv's python3 first on PATH)
#   otherwise                     the project venv $OPENVC_VENV (default .venv), created from python3
#                                 when absent, reused when present (a PEP 668 system Python stays clean)
# Wheels in .whl/ are offered to pip too (--find-links), for a machine without network.
# nvidia-cutlass is not installed as a Python package: scripts/cutlass_headers.py unpacks its wheel's
# C++ headers, all the build uses, into the git-ignored third_party/cutlass/include (cmake/cutlass.cmake
# looks there first). Installed with --no-deps, pip would report its missing dependencies (cuda-python,
# scipy, ...) as an ERROR on this and every later pip install into the environment.
#
#   bash scripts/setup.sh [REQUIREMENTS_FILE ...]    (default: requirements/build.txt)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

_setup_fail() { echo "setup: $*" >&2; exit 1; }

_version_at_least() {  # MAJOR.MINOR >= MAJOR.MINOR
  [ -n "$1" ] && [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]
}

# Sets PY to the interpreter to build and install with (creates the project venv when needed).
openvc_python() {
  local base venv
  if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    PY=$VIRTUAL_ENV/bin/python
  elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
    PY=$CONDA_PREFIX/bin/python
  else
    base=$(command -v python3 || true)
    [ -n "$base" ] || _setup_fail "python3 not found: apt-get install python3 (3.9 or newer)"
    if "$base" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
      PY=$base                                   # a venv's interpreter, not activated
    else
      venv=${OPENVC_VENV:-.venv}
      case $venv in /*) ;; *) venv=$PWD/$venv ;; esac
      if [ ! -x "$venv/bin/python" ]; then
        "$base" -c 'import sys; sys.exit(sys.version_info < (3, 9))' ||
          _setup_fail "$base is Python $("$base" -V 2>&1 | cut -d' ' -f2), openvc needs 3.9 or newer"
        "$base" -c 'import venv, ensurepip' 2>/dev/null ||
          _setup_fail "$base cannot create a virtual environment (no venv/ensurepip): apt-get install python3-venv"
        echo "setup: creating the project virtual environment $venv (from $base)"
        "$base" -m venv --clear "$venv"
      fi
      PY=$venv/bin/python
    fi
  fi
  command -v "$PY" >/dev/null || _setup_fail "PYTHON=$PY is not an executable"
  export PY
  # An environment's own tools (cmake, ninja, console scripts) come first, as if it were activated.
  if [ -f "$(dirname "$PY")/activate" ]; then PATH=$(cd "$(dirname "$PY")" && pwd):$PATH; export PATH; fi
}

# Checks what building open_vc_attn needs besides Python packages.
openvc_check_tools() {
  local ver inc cuda_bin nvcc
  "$PY" -m pip --version >/dev/null 2>&1 ||
    _setup_fail "$PY has no pip: $PY -m ensurepip --upgrade (Debian's system Python: apt-get install python3-pip)"
  "$PY" -c 'import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(sys.prefix == sys.base_prefix and os.path.exists(marker))' ||
    _setup_fail "$PY is an externally managed system Python (PEP 668): unset PYTHON to use the project venv"
  inc=$("$PY" -c 'import os, sysconfig; print(os.path.join(sysconfig.get_paths()["include"], "Python.h"))')
  ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ -f "$inc" ] || _setup_fail "Python headers missing ($inc): apt-get install python$ver-dev"
  if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null; then
    for cuda_bin in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
      if [ -x "$cuda_bin/nvcc" ]; then export PATH=$cuda_bin:$PATH; break; fi
    done
  fi
  nvcc=${CUDACXX:-nvcc}
  command -v "$nvcc" >/dev/null ||
    _setup_fail "nvcc not found: install the CUDA toolkit 12.8 or newer and put its bin/ on PATH (or set CUDACXX)"
  ver=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
  _version_at_least "$ver" 12.8 || _setup_fail "nvcc $ver is too old: install the CUDA toolkit 12.8 or newer"
  command -v cmake >/dev/null || _setup_fail "cmake not found: apt-get install cmake (3.24 or newer), or pip install cmake"
  ver=$(cmake --version | sed -n 's/^cmake version \([0-9]*\.[0-9]*\).*/\1/p')
  _version_at_least "$ver" 3.24 || _setup_fail "cmake $ver is too old: pip install 'cmake>=3.24'"
  command -v "${CXX:-c++}" >/dev/null || _setup_fail "no C++ compiler: apt-get install g++"
}

# Fails early, naming the folders and the sizes, when the disk cannot hold what pip is about to
# install: PyPI's torch wheel brings its CUDA libraries (~5 GB installed, with ~2.5 GB of downloads
# held in the temporary folder meanwhile), and pip's own "No space left on device" says neither.
openvc_check_space() {
  local site
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" - "$site" "${TMPDIR:-/tmp}" "$(grep -c '^torch' <<<"$1" || true)" <<'EOF' || exit 1
import os, shutil, sys
site, tmp, torch = sys.argv[1], sys.argv[2], sys.argv[3] != "0"
need = {site: 5.5 if torch else 0.5, tmp: 3.0 if torch else 0.5}   # GB per folder
by_disk = {}
for path, gb in need.items():   # the two folders may be on one file system: their needs add up
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    disk = by_disk.setdefault(os.stat(probe).st_dev, [probe, 0.0, []])
    disk[1] += gb
    disk[2].append(path)
for probe, gb, paths in by_disk.values():
    free = shutil.disk_usage(probe).free / 2**30
    if free < gb:
        sys.exit(f"setup: installing needs about {gb:.1f} GB free for {' and '.join(paths)}, "
                 f"{free:.1f} GB are free there: free some space, or set OPENVC_VENV and TMPDIR "
                 "to folders on a larger disk")
EOF
}

# Installs the lines of the given requirements files (those whose environment marker holds) whose
# distribution is not installed at all. An installed one is kept whatever its version (a differing
# == pin is reported): the GPU machine's torch 2.11.0+cu130 must not be replaced. nvidia-cutlass counts
# as present when third_party/cutlass/include holds its pinned headers or $OPENVC_CUTLASS_INCLUDE
# names other ones (cmake/cutlass.cmake checks their version). With --tolerant a failed install (no
# network) is reported and the tests that need the package skip; under CI (CI set) every failure
# stops the run, so a green CI ran everything.
openvc_require() {
  local tolerant=0 missing list line reqs=() cutlass= find=() ok=1
  if [ "${1:-}" = --tolerant ]; then tolerant=1; shift; fi
  missing=$("$PY" - "$@" <<'EOF'
import importlib.metadata as md, os, sys
try:
    from packaging.requirements import Requirement
except ImportError:   # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
sys.path.insert(0, "scripts")
import cutlass_headers
for path in sys.argv[1:]:
    for line in open(path):
        req = line.split("#", 1)[0].strip()
        if not req:
            continue
        r = Requirement(req)
        if r.marker and not r.marker.evaluate():
            continue
        if r.name == "nvidia-cutlass":   # headers only, never an installed package (see the top)
            if not os.environ.get("OPENVC_CUTLASS_INCLUDE") and not cutlass_headers.in_place(req):
                print(req)
            continue
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            print(req)
            continue
        pins = [s.version for s in r.specifier if s.operator == "=="]
        if pins and have.split("+")[0] != pins[0]:
            print(f"setup: {r.name} {have} is installed, {req} is pinned: keeping {have}", file=sys.stderr)
EOF
  )
  [ -n "$missing" ] || return 0
  list=$(tr '\n' ' ' <<<"$missing")
  openvc_check_space "$missing"
  while IFS= read -r line; do   # one requirement per line (a line may hold spaces, e.g. a marker)
    case $line in nvidia-cutlass*) cutlass=$line ;; *) reqs+=("$line") ;; esac
  done <<<"$missing"
  if [ -n "$cutlass" ]; then
    echo "setup: unpacking the CUTLASS headers of $cutlass into third_party/cutlass/include"
    "$PY" scripts/cutlass_headers.py "$cutlass" || ok=0
  fi
  if [ -d .whl ]; then find=(--find-links .whl); fi
  if [ ${#reqs[@]} -gt 0 ]; then
    echo "setup: installing into $PY: ${reqs[*]}"
    "$PY" -m pip install --progress-bar off "${find[@]}" "${reqs[@]}" || ok=0
  fi
  if [ "$ok" = 0 ]; then
    if [ "$tolerant" = 1 ] && [ -z "${CI:-}" ]; then
      echo "setup: could not install ${list}(offline?): the tests that need them will skip" >&2
    else
      _setup_fail "pip could not install ${list}(its message is above)"
    fi
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then   # run, not sourced
  openvc_python
  openvc_check_tools
  if [ $# -eq 0 ]; then set -- requirements/build.txt; fi
  openvc_require "$@"
  echo "setup: ready ($PY)"
fi
