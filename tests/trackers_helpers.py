"""Helpers shared by tests (moved out of tests/fast/test_trackers.py: no test module imports another)."""

from __future__ import annotations

from tests.job_helpers import tiny_job

TINY = tiny_job(venv="none")
