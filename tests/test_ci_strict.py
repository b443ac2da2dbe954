"""CI must not go green with a file skipped for want of an outside tool: under CI=true a missing
`prometheus` or Chromium fails tests/test_prometheus.py, the dashboard's browser test and `.ci/run`
itself; without CI they skip (the tests) or carry on (the script), as before."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from required_tools import require_tool

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception),
                                         ("false", pytest.skip.Exception)])
def test_require_tool_skips_locally_and_fails_under_ci(ci, outcome, monkeypatch):
    monkeypatch.setenv("CI", ci)
    require_tool(True, "present")  # nothing happens
    with pytest.raises(outcome, match="no frobnicator"):
        require_tool(False, "no frobnicator on PATH")


def _pytest_without_tools(args: list[str], ci: str | None, tmp_path) -> subprocess.CompletedProcess:
    """pytest in a child whose PATH has only this Python's folder: no prometheus, no chromium."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PAGEDSERVE_CHROMIUM", "PATH")}
    env.update(PATH=str(Path(sys.executable).parent), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)


# Both files in one child per setting: each child pays pytest's and torch's start-up (~9 s here).
MISSING = [("tests/test_prometheus.py", "no `prometheus` binary on PATH"),
           ("tests/test_dashboard.py", "the dashboard's browser test needs Chromium")]


def test_missing_tool_fails_the_file_under_ci_and_skips_it_elsewhere(tmp_path):
    args = [path for path, _ in MISSING] + ["-k", "prometheus or browser"]
    strict = _pytest_without_tools(args, "true", tmp_path)
    assert strict.returncode != 0, strict.stdout[-2000:]
    for _, message in MISSING:
        assert f"CI=true and {message}" in strict.stdout, (message, strict.stdout[-2000:])
    assert any(word in strict.stdout.splitlines()[-1] for word in ("failed", "error")), strict.stdout[-2000:]
    local = _pytest_without_tools(args, None, tmp_path)
    assert local.returncode == 0, local.stdout[-2000:]
    assert "skipped" in local.stdout.splitlines()[-1], local.stdout[-2000:]
    for _, message in MISSING:
        assert message in local.stdout, (message, local.stdout[-2000:])


def _fake_tools(bin_dir: Path, calls: Path) -> None:
    """apt-get that cannot install prometheus (and installs anything else), a chromium, a root
    `id`, and a python3 that only records that it was run."""
    bin_dir.mkdir()
    scripts = {
        "apt-get": 'case "$*" in *prometheus*) echo "E: Unable to locate package prometheus" >&2; exit 100;; esac',
        "id": "echo 0",
        "chromium": "exit 0",
        "python3": f'echo "python3 $*" >> {calls}',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    (bin_dir / "dirname").symlink_to("/usr/bin/dirname")


@pytest.mark.parametrize("ci", ["true", None])
def test_ci_run_fails_when_prometheus_cannot_be_installed_under_ci(ci, tmp_path):
    calls = tmp_path / "calls.txt"
    _fake_tools(tmp_path / "bin", calls)
    env = {"PATH": str(tmp_path / "bin"), "HOME": str(tmp_path)}
    if ci is not None:
        env["CI"] = ci
    run = subprocess.run(["/bin/bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True,
                         timeout=60)
    if ci == "true":
        assert run.returncode == 1, run.stdout + run.stderr
        assert "apt-get could not install prometheus" in run.stderr and "CI=true needs it" in run.stderr
        assert not calls.exists()  # stopped before installing anything or running the tests
    else:
        assert run.returncode == 0, run.stdout + run.stderr
        assert "its tests will skip" in run.stdout
        assert "python3 -m pytest -q tests" in calls.read_text()
