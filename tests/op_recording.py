"""The torch ops a call issues, with named Triton launchers counted as one entry each.

Under the interpreter a Triton launch copies its tensors through torch ops
that a GPU launch does not issue, so each launcher named here runs with the
dispatch mode off and is recorded by its name instead.
"""

from __future__ import annotations

import contextlib

import pytest
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


@contextlib.contextmanager
def recorded_ops(module, launcher_names):
    """Yields a list that fills with ``aten.*``/``specdec.*`` op names and the names of ``module``'s launchers."""
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def counted(name, original):
        def launch(*args, **kwargs):
            seen.append(name)
            with _disable_current_modes():
                return original(*args, **kwargs)
        return launch

    patch = pytest.MonkeyPatch()
    for name in launcher_names:
        patch.setattr(module, name, counted(name, getattr(module, name)))
    try:
        with Record():
            yield seen
    finally:
        patch.undo()
