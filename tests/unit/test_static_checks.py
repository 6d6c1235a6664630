"""The code base stays clean under its two static checkers (both in the `dev` extra, which the test command installs).

`mypy dora planner` checks the types of the shipped packages (the configuration is in pyproject.toml);
`ruff check` lints everything, tests and benchmarks included.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_mypy_finds_no_type_errors(tmp_path):
    done = _run("mypy", "--cache-dir", str(tmp_path / "mypy-cache"), "dora", "planner")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_finds_no_lint_errors(tmp_path):
    done = _run("ruff", "check", "--no-cache", "dora", "planner", "bench", "tests", "hatch_build.py")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
