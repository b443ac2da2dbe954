"""Outside tools some tests need (a `prometheus` binary, Chromium, Playwright): missing on a
developer's machine, such a test skips and says what to install; under CI (`CI=true`, as CI
services set it) it fails instead, because a CI run that skips a whole file goes green
having checked nothing."""
from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_tool(found: bool, message: str) -> None:
    """Skip (locally) or fail (CI=true) the calling test or fixture with `message` unless `found`."""
    if found:
        return
    if in_ci():
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)
