"""Packaging: the sdist carries every source, the wheel the package (with its benchmarks and CUDA sources),
one version, the extension without a shared CUDA runtime, the user-cache build's key and that no call compiles,
and imports from a checkout's root after a non-editable install.

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

# Longer than the suite's 300 s a test (pyproject.toml): builds an sdist and a wheel (up to 300 s) and runs
# subprocesses of up to 300 s.
pytestmark = pytest.mark.timeout(900)

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
                        *REPO_ROOT.glob("bench/*.py"), *REPO_ROOT.glob("specdec_kernels/**/*.py"),
                        # the tests, and what they run (tests/test_paged_example.py runs examples/)
                        *REPO_ROOT.glob("tests/*.py"), *REPO_ROOT.glob("examples/*.py")], REPO_ROOT)
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


def test_build_says_why_it_cannot(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # no bin/nvcc there
    monkeypatch.setattr(_cuda_build, "find_cuda_home", lambda: None)
    for step in (_jit.build_and_load, _jit.load_built):
        with pytest.raises(_jit.JitUnavailable, match="nvcc was not found.*python -m specdec_kernels build"):
            step()


def test_no_call_compiles_the_extension(monkeypatch, tmp_path):
    """Without an installed extension the backend choice loads a cached build or reports the build command;
    it never compiles (minutes, unannounced, inside a serving process)."""
    if _cuda_build.find_cuda_home() is None:
        pytest.skip("nvcc not found: the cache key names its version")
    from specdec_kernels import _extension

    def compile_attempted(*args, **kwargs):
        raise AssertionError("an op call started a compile")

    monkeypatch.setenv(_jit.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_jit, "_build", compile_attempted)
    monkeypatch.setattr(_extension, "_import_installed", lambda: "specdec_kernels._C is not built")
    monkeypatch.setattr(_extension, "_cached", {})
    error = _extension.ensure_loaded()
    assert error is not None and "run python -m specdec_kernels build" in error, error
    assert not any(tmp_path.iterdir())  # nothing was written to the cache either


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


# Imports in a child process as a user's would resolve them after a non-editable install: the working directory
# first, then the installed copy; the editable install of this venv's checkout is taken out of the way.
_WITHOUT_EDITABLE_INSTALL = ("import sys; sys.meta_path[:] = [finder for finder in sys.meta_path "
                             "if 'editable' not in getattr(finder, '__name__', type(finder).__name__).lower()]; ")


def _fake_checkout(tmp_path: Path) -> Path:
    """A copy of the checkout's Python, kernels and sources, without any built extension."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copytree(REPO_ROOT / "specdec_kernels", checkout / "specdec_kernels",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for folder in ("kernels", "bench", "csrc"):
        shutil.copytree(REPO_ROOT / folder, checkout / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", checkout)
    return checkout


def test_checkout_root_runs_its_own_kernels_and_the_installed_extension(sdist_and_wheel, tmp_path):
    """From a checkout's root after `pip install .`: its kernels run (Triton and reference agree), and the
    extension built by the install is found although the checkout has none."""
    _, wheel = sdist_and_wheel
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    built = importlib.util.find_spec("specdec_kernels._C")
    if built is not None:  # as pip install --no-build-isolation . would have installed it
        shutil.copy(built.origin, site / "specdec_kernels")
        (record,) = site.glob("specdec_kernels-*.dist-info/RECORD")
        record.write_text(record.read_text() + f"specdec_kernels/{Path(built.origin).name},,\n")
    checkout = _fake_checkout(tmp_path)
    code = _WITHOUT_EDITABLE_INSTALL + """
import torch, specdec_kernels as sk, specdec_kernels._kernels as kernels, specdec_kernels._bench as bench
print(sk.__file__); print(kernels.__file__); print(bench.__file__)
torch.manual_seed(0)
target = torch.softmax(torch.randn(3, 4, 50), -1)
draft = torch.softmax(torch.randn(3, 3, 50), -1)
ids = torch.multinomial(draft.reshape(-1, 50), 1).reshape(3, 3)
runs = [sk.chain_verify(ids, target, draft, seed=7, backend=name) for name in ("reference", "triton")]
assert all(torch.equal(a, b) for a, b in zip(*runs)), runs
print(sk.cuda_extension_available())
if sk.cuda_extension_available():
    import specdec_kernels._C as extension
    print(extension.__file__)
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    assert torch.equal(sk.build_tree(parents, backend="reference").mask,
                       torch.ops.specdec_C.build_tree(parents, None, None)[0])
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(site), "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert Path(lines[0]) == checkout / "specdec_kernels" / "__init__.py"
    assert Path(lines[1]) == checkout / "kernels" / "__init__.py"
    assert Path(lines[2]) == checkout / "bench" / "__init__.py"
    assert lines[3] == str(built is not None)
    if built is not None:
        assert Path(lines[4]).parent == site / "specdec_kernels"


def test_setup_script_never_deletes_a_venv_it_did_not_make(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "keep").write_text("a user's file")
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "setup_env.sh")], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "SPECDEC_VENV": str(venv)})
    assert result.returncode == 1 and "was not made by scripts/setup_env.sh" in result.stderr, result.stderr
    assert (venv / "bin" / "keep").read_text() == "a user's file"
