"""No test can hang: pytest-timeout is loaded and the project's configuration gives every test a limit."""

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_every_test_has_a_time_limit(request):
    assert request.config.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed (scripts/setup_env.sh)"
    assert float(request.config.getini("timeout")) > 0
    # The thread method also ends a wait spinning in C++ or in a kernel, where a signal would never be handled.
    assert request.config.getini("timeout_method") == "thread"


def test_every_ci_phase_runs_under_a_limit():
    """Each command of .ci/run that can run for minutes (set-up, the dry run, the Triton 3.6 compile, both test
    phases) goes through its `bounded` helper, which names the phase whose limit passed."""
    script = (REPO_ROOT / ".ci" / "run").read_text()
    for command in ("bash scripts/setup_env.sh", "bash bench/gpu_check.sh --dry-run", "bash -c compile_with_triton36",
                    "python -m pytest"):
        lines = [line for line in script.splitlines() if command in line and not line.lstrip().startswith("#")]
        assert lines and all(re.search(r"\bbounded\b", line) for line in lines), (command, lines)
