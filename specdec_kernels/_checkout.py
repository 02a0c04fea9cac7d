"""Importing the package from a source checkout after a non-editable install.

Python puts the working directory first on ``sys.path``, so from a checkout's
root ``import specdec_kernels`` finds the checkout's ``specdec_kernels/``,
not the installed copy. That folder lacks three subpackages, which the
install maps from folders beside it (``pyproject.toml``'s ``package-dir``):
``_kernels`` (``kernels/``), ``_bench`` (``bench/``) and ``_csrc``
(``csrc/``); and it lacks the built extension ``_C``, which ``pip install
--no-build-isolation .`` puts in site-packages. :func:`install` adds a
finder that maps the three folders to the checkout's own (so the kernels
that run are the checkout's, as its Python code is) and, when the checkout
holds no ``_C`` of its own, finds the installed distribution's. Installed
packages hold their subpackages themselves, so the finder does nothing
there.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

PACKAGE = "specdec_kernels"
CHECKOUT_FOLDERS = {f"{PACKAGE}._kernels": "kernels", f"{PACKAGE}._bench": "bench", f"{PACKAGE}._csrc": "csrc"}
EXTENSION = f"{PACKAGE}._C"


def checkout_root(package_dir: Path) -> Path | None:
    """The checkout holding ``package_dir``, or ``None`` when the package is installed."""
    root = package_dir.parent
    if (root / "pyproject.toml").is_file() and (root / "kernels" / "__init__.py").is_file() \
            and not (package_dir / "_kernels").exists():
        return root
    return None


def installed_extension(package_dir: Path) -> Path | None:
    """The installed distribution's ``_C`` library when it lies outside ``package_dir``, else ``None``."""
    try:
        files = importlib.metadata.distribution(PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        parts = Path(str(file)).parts
        if len(parts) == 2 and parts[0] == PACKAGE and parts[1].startswith("_C.") and parts[1].endswith(".so"):
            path = Path(str(file.locate())).resolve()
            if path.parent != package_dir and path.is_file():
                return path
    return None


class CheckoutFinder:
    """``sys.meta_path`` finder for the checkout's folders and the installed extension."""

    def __init__(self, package_dir: Path, root: Path):
        self.package_dir = package_dir
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name in CHECKOUT_FOLDERS:
            folder = self.root / CHECKOUT_FOLDERS[name]
            if not (folder / "__init__.py").is_file():  # csrc/ holds sources only: a namespace package
                spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
                spec.submodule_search_locations = [str(folder)]
                return spec
            return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])
        if name == EXTENSION and not any(self.package_dir.glob("_C.*.so")):
            library = installed_extension(self.package_dir)
            if library is not None:
                return importlib.util.spec_from_file_location(
                    name, library, loader=importlib.machinery.ExtensionFileLoader(name, str(library)))
        return None


def install() -> None:
    """Put a :class:`CheckoutFinder` first on ``sys.meta_path`` when this package is a checkout's."""
    package_dir = Path(__file__).resolve().parent
    root = checkout_root(package_dir)
    if root is not None and not any(isinstance(finder, CheckoutFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder(package_dir, root))
