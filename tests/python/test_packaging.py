"""Packaging: the sdist (built with `python -m build --sdist`) holds the sources and the license files
and installs to a working package; one version source; requirements pins agree with pyproject; the
code parses as the oldest Python that pyproject allows.

The sdist tests are marked ``slow`` (installing the sdist compiles the CUDA library, under a minute on
two cores); they skip where the `build` frontend is not installed (requirements/test.txt has it)."""
import ast
import email.parser
import glob
import os
import re
import subprocess
import sys
import tarfile

import pytest

import open_vc_attn

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# Sources the build needs, every tracked file under them must be in the sdist.
SOURCE_DIRS = ("include", "src", "bindings", "cmake", "python")
REQUIRED = ("pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE", "NOTICE", "PKG-INFO",
            "python/open_vc_attn/__init__.py", "python/open_vc_attn/py.typed", "cmake/cutlass.cmake",
            "include/openvc/attention.h", "bindings/CMakeLists.txt")
NEVER = re.compile(r"(^|/)(build|\.venv|\.git|__pycache__|\.pytest_cache|dist)(/|$)|\.so$")


def _pyproject():
    tomllib = pytest.importorskip("tomllib")          # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _tracked_files():
    """Files git tracks in ROOT, or None outside a git checkout (e.g. tests run from an unpacked sdist)."""
    try:
        res = subprocess.run(["git", "-C", ROOT, "ls-files"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return set(res.stdout.split()) if res.returncode == 0 and res.stdout else None


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    pytest.importorskip("build", reason="the `build` frontend is not installed (requirements/test.txt)")
    pytest.importorskip("scikit_build_core")
    if not os.path.exists(os.path.join(ROOT, "pyproject.toml")):
        pytest.skip("not run from a source tree")
    out = tmp_path_factory.mktemp("dist")
    # No isolation: the build requirements are installed (requirements/build.txt) and no network is needed;
    # no dependency check: nvidia-cutlass is not installed, its headers are unpacked (scripts/cutlass_headers.py).
    res = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
                          "--outdir", str(out), ROOT], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = glob.glob(str(out / "*.tar.gz"))
    return path


def _members(path):
    with tarfile.open(path) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
        top = names[0].split("/")[0]
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    return top, {n[len(top) + 1:] for n in names}, pkg_info


@pytest.mark.slow
def test_sdist_contents_and_metadata(sdist):
    top, files, pkg_info = _members(sdist)
    assert top == f"open_vc_attn-{open_vc_attn.__version__}"
    assert [f for f in REQUIRED if f not in files] == []
    assert sorted(f for f in files if NEVER.search(f)) == []
    tracked = _tracked_files()
    if tracked is not None:
        wanted = {f for f in tracked if f.startswith(SOURCE_DIRS) and os.path.exists(os.path.join(ROOT, f))}
        assert sorted(wanted - files) == []
    meta = email.parser.Parser().parsestr(pkg_info)
    assert meta["Name"] == "open-vc-attn" and meta["Version"] == open_vc_attn.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert sorted(meta.get_all("License-File")) == ["LICENSE", "NOTICE"]
    assert meta["Requires-Python"] == ">=3.9"
    assert {"torch", "test", "bench"} <= set(meta.get_all("Provides-Extra"))
    assert "Typing :: Typed" in meta.get_all("Classifier")


# The set-up's CUTLASS headers (scripts/cutlass_headers.py): the sdist leaves the git-ignored third_party/ out,
# so its build is pointed at them.
THIRD_PARTY_CUTLASS = os.path.join(ROOT, "third_party", "cutlass", "include")


def _cutlass_headers_available():
    import importlib.util
    return (bool(os.environ.get("OPENVC_CUTLASS_INCLUDE")) or os.path.isdir(os.path.join(THIRD_PARTY_CUTLASS, "cute"))
            or importlib.util.find_spec("cutlass_library") is not None)


@pytest.mark.slow
@pytest.mark.skipif(not _cutlass_headers_available(),
                    reason="CUTLASS headers not found (bash scripts/setup.sh unpacks them into third_party/cutlass, "
                           "or set OPENVC_CUTLASS_INCLUDE): the offline sdist build needs them")
def test_sdist_installs_a_working_package(sdist, tmp_path):
    """pip builds the sdist (CMake, nvcc) into a separate folder; that copy runs the CPU reference."""
    target = tmp_path / "site"
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    if not env.get("OPENVC_CUTLASS_INCLUDE") and os.path.isdir(os.path.join(THIRD_PARTY_CUTLASS, "cute")):
        env["OPENVC_CUTLASS_INCLUDE"] = THIRD_PARTY_CUTLASS
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
                          "--target", str(target), sdist], capture_output=True, text=True, timeout=1200, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (dist_info,) = glob.glob(str(target / "open_vc_attn-*.dist-info"))
    assert sorted(os.listdir(os.path.join(dist_info, "licenses"))) == ["LICENSE", "NOTICE"]
    assert os.path.exists(target / "open_vc_attn" / "py.typed")
    code = ("import numpy as np, open_vc_attn\n"
            "from open_vc_attn import reference\n"
            "assert open_vc_attn.__file__.startswith(%r), open_vc_attn.__file__\n"
            "rng = np.random.default_rng(0)\n"
            "q, k, v = (reference.to_bfloat16_values(rng.normal(size=(1, 300, 2, 128)).astype(np.float32))"
            " for _ in range(3))\n"
            "print(open_vc_attn.__version__, reference.error_metrics(reference.attention(q, k, v),"
            " reference.attention_exact(q, k, v))['rel_l2'])\n") % str(target)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(target)), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    version, rel_l2 = res.stdout.split()
    assert version == open_vc_attn.__version__ and 0 < float(rel_l2) < 0.08


def test_one_version_source():
    """pyproject takes the version from __init__.py (scikit-build-core's regex provider) and CMake reads
    the same line: neither states a version of its own."""
    meta = _pyproject()
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["scikit-build"]["metadata"]["version"]["input"] == "python/open_vc_attn/__init__.py"
    with open(os.path.join(ROOT, "python", "open_vc_attn", "__init__.py")) as f:
        assert re.findall(r'^__version__ = "([^"]+)"$', f.read(), re.M) == [open_vc_attn.__version__]
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake = f.read()
    assert re.search(r"project\(openvc VERSION \$\{OPENVC_VERSION\}", cmake)
    assert "python/open_vc_attn/__init__.py" in cmake and not re.search(r"VERSION \d", cmake.split("project(")[1])


def test_requirements_pins_agree_with_pyproject():
    packaging = pytest.importorskip("packaging.requirements")
    meta = _pyproject()

    def parse(lines):     # the lines that apply to this interpreter (environment markers)
        reqs = [packaging.Requirement(x.split("#")[0].strip()) for x in lines if x.split("#")[0].strip()]
        return {r.name: r for r in reqs if r.marker is None or r.marker.evaluate()}
    with open(os.path.join(ROOT, "requirements", "build.txt")) as f:
        pins = parse(f)
    with open(os.path.join(ROOT, "requirements", "test.txt")) as f:
        pins.update(parse(f))
    declared = [packaging.Requirement(x) for x in meta["build-system"]["requires"] + meta["project"]["dependencies"]
                + meta["project"]["optional-dependencies"]["torch"]]
    for req in declared:
        assert req.name in pins, f"{req.name} is not pinned in requirements/"
        (spec,) = [s for s in pins[req.name].specifier if s.operator in ("==", ">=")]
        assert req.specifier.contains(spec.version), f"{pins[req.name]} does not satisfy pyproject's {req}"


def test_code_parses_as_the_oldest_supported_python():
    """requires-python says 3.9: no newer syntax (match, except*, PEP 695) in the package or the tests."""
    files = glob.glob(os.path.join(ROOT, "python", "**", "*.py"), recursive=True) + \
        glob.glob(os.path.join(ROOT, "tests", "python", "*.py")) + glob.glob(os.path.join(ROOT, "scripts", "*.py"))
    assert len(files) > 20
    for path in files:
        with open(path) as f:
            ast.parse(f.read(), filename=path, feature_version=(3, 9))


def test_license_is_the_apache_2_text():
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    with open(os.path.join(ROOT, "NOTICE")) as f:
        notice = f.read()
    for credit in ("arXiv:2609.15810", "Open-VC Attention", "MachGen", "FlashAttention-3", "SageAttention"):
        assert credit in notice
