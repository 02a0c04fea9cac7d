"""Packaging: the sdist carries every source, the wheel the package (with its benchmarks and CUDA sources),
one version, the extension without a shared CUDA runtime, the first-use build's cache key.

The sdist and a wheel built from it (without the extension, SPECDEC_BUILD_CUDA=0) take seconds. Isolated
builds (pip wheel ., python -m build), installs in a fresh venv and a real first-use compile take minutes:
scripts/check_installs.sh does those.
"""

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import specdec_kernels
from specdec_kernels import _cuda_build, _jit

REPO_ROOT = Path(__file__).resolve().parents[1]


def _build(kind: str, source: Path, output: Path) -> Path:
    """``setuptools.build_meta.build_<kind>`` run in ``source``, as pip and build call it."""
    code = f"from setuptools import build_meta; print(build_meta.build_{kind}({str(output)!r}))"
    result = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "SPECDEC_BUILD_CUDA": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    return output / result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def sdist_and_wheel(tmp_path_factory):
    """The sdist of the checkout, and a wheel built from the unpacked sdist (so the sdist is complete)."""
    output = tmp_path_factory.mktemp("dist")
    sdist = _build("sdist", REPO_ROOT, output)
    with tarfile.open(sdist) as archive:
        archive.extractall(output / "unpacked", filter="data")
    (source,) = (output / "unpacked").iterdir()
    return sdist, _build("wheel", source, output)


def _relative(paths, root: Path) -> set[str]:
    return {path.relative_to(root).as_posix() for path in paths}


def test_sdist_carries_every_source(sdist_and_wheel):
    sdist, _ = sdist_and_wheel
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    wanted = _relative([*REPO_ROOT.glob("csrc/*.cu"), *REPO_ROOT.glob("csrc/bindings/*"),
                        *REPO_ROOT.glob("csrc/include/specdec/*.cuh"), *REPO_ROOT.glob("kernels/*.py"),
                        *REPO_ROOT.glob("bench/*.py"), *REPO_ROOT.glob("specdec_kernels/**/*.py")], REPO_ROOT)
    assert len(wanted) > 40
    assert not wanted - names, sorted(wanted - names)
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "LICENSE", "README.md"} <= names


def test_wheel_carries_the_package_its_benchmarks_and_cuda_sources(sdist_and_wheel):
    _, wheel = sdist_and_wheel
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(archive.read(name).decode() for name in names if name.endswith(".dist-info/METADATA"))
    cuda = _relative([*REPO_ROOT.glob("csrc/*.cu"), *REPO_ROOT.glob("csrc/bindings/*"),
                      *REPO_ROOT.glob("csrc/include/specdec/*.cuh")], REPO_ROOT)
    for name in cuda:
        assert "specdec_kernels/_" + name in names, name
    for name in _relative(REPO_ROOT.glob("kernels/*.py"), REPO_ROOT / "kernels"):
        assert f"specdec_kernels/_kernels/{name}" in names, name
    assert "specdec_kernels/_bench/harness.py" in names
    assert wheel.name.endswith("-py3-none-any.whl")  # built without the extension
    fields = [line.split(": ", 1) for line in metadata.splitlines() if ": " in line]
    assert ["Version", specdec_kernels.__version__] in fields
    assert ["Requires-Dist", "torch>=2.4"] in fields
    assert ["License-Expression", "Apache-2.0"] in fields
    assert not any(key == "Requires-Dist" and value.startswith("numpy") for key, value in fields)
    assert "# specdec-kernels" in metadata  # the README is the long description


def test_installed_wheel_runs_bench_help_and_finds_its_cuda_sources(sdist_and_wheel, tmp_path):
    """The wheel's layout, outside any checkout: the bench CLI and the first-use build's sources are there."""
    _, wheel = sdist_and_wheel
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")
    code = ("import specdec_kernels, sys; from pathlib import Path; from specdec_kernels import _cuda_build; "
            "package = Path(specdec_kernels.__file__).parent; print(package); print(_cuda_build.source_dir(package)); "
            "from specdec_kernels.__main__ import main; sys.exit(main(['bench', '--help']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 0, result.stderr
    package, sources = result.stdout.splitlines()[:2]
    assert Path(package) == tmp_path / "site" / "specdec_kernels"
    assert Path(sources) == tmp_path / "site" / "specdec_kernels" / "_csrc"
    assert "--providers" in result.stdout


def test_version_is_single_sourced():
    assert specdec_kernels.__version__ == importlib.metadata.version("specdec_kernels")
    assert 'version = { attr = "specdec_kernels.__version__" }' in (REPO_ROOT / "pyproject.toml").read_text()
    assert "version=" not in (REPO_ROOT / "setup.py").read_text()


def test_extension_links_no_shared_cuda_runtime():
    spec = importlib.util.find_spec("specdec_kernels._C")
    if spec is None or shutil.which("readelf") is None:
        pytest.skip("the extension is not built here, or readelf is missing")
    dynamic = subprocess.run(["readelf", "-d", spec.origin], capture_output=True, text=True, check=True).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed and not any("libcudart" in line for line in needed), needed
    assert not [line for line in dynamic.splitlines() if "RPATH" in line or "RUNPATH" in line]


def test_first_use_build_says_why_it_cannot(monkeypatch, tmp_path):
    monkeypatch.setenv(_jit.JIT_ENV, "0")
    with pytest.raises(_jit.JitUnavailable, match="SPECDEC_JIT=0"):
        _jit.build_and_load()
    monkeypatch.delenv(_jit.JIT_ENV)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # no bin/nvcc there
    with pytest.raises(_jit.JitUnavailable, match="nvcc was not found"):
        _jit.build_and_load()


def test_first_use_cache_key_follows_sources_and_arches(tmp_path):
    cuda_home = _cuda_build.find_cuda_home()
    if cuda_home is None:
        pytest.skip("nvcc not found")
    csrc = tmp_path / "csrc"
    shutil.copytree(REPO_ROOT / "csrc", csrc)
    key = _jit.build_key(csrc, cuda_home, "9.0a")
    assert key == _jit.build_key(csrc, cuda_home, "9.0a")
    assert key != _jit.build_key(csrc, cuda_home, "8.0;9.0a")
    header = csrc / "include" / "specdec" / "rng.cuh"
    header.write_text(header.read_text() + "\n")
    assert key != _jit.build_key(csrc, cuda_home, "9.0a")
