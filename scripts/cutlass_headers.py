#!/usr/bin/env python3
"""Puts the pinned CUTLASS/CuTe C++ headers where cmake/cutlass.cmake looks first, third_party/cutlass/include,
unpacked from the nvidia-cutlass wheel, which is not installed as a Python package.

Why not `pip install nvidia-cutlass`: its headers are all openvc uses, and the package declares Python
dependencies (cuda-python, scipy, networkx, pydot, treelib) that the build does not need. Installed without
them (--no-deps), pip prints its resolver ERROR about them on every later install into that environment,
which reads as a failed set-up; installed with them, it pulls in packages nobody uses.

    python3 scripts/cutlass_headers.py [--offline] [REQUIREMENT]

REQUIREMENT is the pin (default: the nvidia-cutlass line of requirements/build.txt). The wheel is taken from
.whl/ when it is there (machines without network: the GPU machine carries .whl/), otherwise downloaded with
`pip download --no-deps` (pip's cache first, --find-links .whl); --offline: .whl/ only. Nothing is done when
third_party/cutlass/include already holds the pinned version (by any route, e.g. a symlink). Only a folder this
script made is replaced: anything else at third_party/cutlass is reported, never deleted.
scripts/setup.sh runs it (through openvc_require), scripts/device/check.sh with --offline.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEST = os.path.join(ROOT, "third_party", "cutlass")
MARKER = "FROM_WHEEL"                           # names the wheel; only a folder holding it is replaced
PREFIX = "cutlass_library/source/include/"      # the headers inside the wheel


def pinned_version(requirement=None):
    """'4.2.0.0' from 'nvidia-cutlass==4.2.0.0' (default: requirements/build.txt's line)."""
    if requirement is None:
        with open(os.path.join(ROOT, "requirements", "build.txt")) as f:
            requirement = next((line for line in f if line.startswith("nvidia-cutlass")), "")
    match = re.match(r"\s*nvidia[-_]cutlass\s*==\s*([0-9][0-9.]*)\s*(#.*)?$", requirement)
    if not match:
        sys.exit(f"cutlass: expected a pin like nvidia-cutlass==4.2.0.0, got {requirement.strip()!r}")
    return match.group(1)


def header_version(include):
    """CUTLASS's MAJOR.MINOR.PATCH from include/cutlass/version.h, or None."""
    try:
        with open(os.path.join(include, "cutlass", "version.h")) as f:
            text = f.read()
    except OSError:
        return None
    parts = [re.search(rf"#define CUTLASS_{p} (\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def cutlass_version(version):
    """The CUTLASS version of a wheel version: nvidia-cutlass 4.2.0.0 ships CUTLASS 4.2.0."""
    return ".".join(version.split(".")[:3])


def in_place(requirement=None):
    """True when third_party/cutlass/include holds the pinned headers."""
    return header_version(os.path.join(DEST, "include")) == cutlass_version(pinned_version(requirement))


def replaceable():
    """Nothing at DEST, an empty folder, or a folder this script made."""
    if not os.path.lexists(DEST):
        return True
    if os.path.islink(DEST) or not os.path.isdir(DEST):
        return False
    return os.path.exists(os.path.join(DEST, MARKER)) or not os.listdir(DEST)


def find_wheel(version, workdir, offline):
    local = os.path.join(ROOT, ".whl")
    found = sorted(glob.glob(os.path.join(local, f"nvidia_cutlass-{version}-*.whl")))
    if found:
        return found[-1]
    if offline:
        sys.exit(f"cutlass: no nvidia_cutlass-{version}-*.whl in {local} (carry .whl/, or third_party/cutlass)")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", workdir]
    if os.path.isdir(local):
        cmd += ["--find-links", local]
    if subprocess.run(cmd + [f"nvidia-cutlass=={version}"]).returncode != 0:
        sys.exit(f"cutlass: pip could not download nvidia-cutlass=={version} (its message is above); offline, put "
                 f"the wheel in {local}/ or set OPENVC_CUTLASS_INCLUDE to a CUTLASS {cutlass_version(version)} "
                 "include folder")
    (wheel,) = glob.glob(os.path.join(workdir, "*.whl"))
    return wheel


def unpack(wheel, into):
    """The headers (and the license) of the wheel into INTO/include, INTO/LICENSE.txt."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if name.startswith(PREFIX) and not name.endswith("/"):
                target = os.path.join("include", name[len(PREFIX):])
            elif name.endswith(".dist-info/licenses/LICENSE.txt"):
                target = "LICENSE.txt"
            else:
                continue
            if ".." in target.split("/"):
                sys.exit(f"cutlass: unexpected path {name!r} in {wheel}")
            path = os.path.join(into, target)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with z.open(info) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
    with open(os.path.join(into, MARKER), "w") as f:
        f.write(os.path.basename(wheel) + "\n")


def main(argv):
    offline = "--offline" in argv
    args = [a for a in argv if a != "--offline"]
    requirement = args[0] if args else None
    version = pinned_version(requirement)
    if in_place(requirement):
        return
    rel = os.path.relpath(DEST, ROOT)
    if not replaceable():
        found = header_version(os.path.join(DEST, "include"))
        sys.exit(f"cutlass: {rel} holds {'CUTLASS ' + found if found else 'no CUTLASS headers'}, not the pinned "
                 f"nvidia-cutlass=={version}, and was not made by this script: move it away (this script then "
                 "unpacks the pinned headers there) or set OPENVC_CUTLASS_INCLUDE")
    os.makedirs(os.path.dirname(DEST), exist_ok=True)
    # Unpacked next to DEST and renamed into place, so that an interrupted run never leaves a partial tree
    # that a later run (or cmake) would take for the headers.
    with tempfile.TemporaryDirectory(dir=os.path.dirname(DEST), prefix=".cutlass-") as work:
        wheel = find_wheel(version, work, offline)
        staged = os.path.join(work, "cutlass")
        unpack(wheel, staged)
        if os.path.lexists(DEST):
            shutil.rmtree(DEST)
        os.replace(staged, DEST)
    print(f"cutlass: CUTLASS headers of {os.path.basename(wheel)} unpacked into {rel}/include "
          "(the wheel is not installed as a Python package)")
    try:   # an environment set up before this script existed still holds the package
        import importlib.metadata as md
        site = md.distribution("nvidia-cutlass").locate_file("")
    except Exception:
        return
    print(f"cutlass: the nvidia-cutlass package in {site} is no longer used by the build; `{sys.executable} -m pip "
          "uninstall -y nvidia-cutlass` ends pip's warnings about its missing dependencies (cuda-python, scipy, ...)")


if __name__ == "__main__":
    main(sys.argv[1:])
