"""Shared fixtures, and the hypothesis profiles every property test runs under.

Profiles (pick one with `--hypothesis-profile NAME` or the env var PAGEDSERVE_HYPOTHESIS_PROFILE):
- `default`: derandomized, so a run on an unrelated change never meets a new failing example;
  property tests run ~100 examples.
- `thorough`: random (a fresh seed each run, printed on failure) and 400 examples: the
  nightly-style search for new counterexamples.
"""
import os
import pathlib
import sys

# Triton kernels in CPU test runs execute in Triton's interpreter (tests/test_triton_attention.py).
# Triton decides that when it is first imported, and importing transformers' models imports it
# (through torch), so the choice is made here, before any test module loads; a GPU run of the
# tests (PAGEDSERVE_TEST_DEVICE=cuda) compiles the kernels instead.
if os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))

settings.register_profile("default", derandomize=True, max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", derandomize=False, max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# `--hypothesis-profile` (hypothesis' own pytest flag) overrides this.
settings.load_profile(os.environ.get("PAGEDSERVE_HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from checkpoints import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
