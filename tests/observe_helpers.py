"""Helpers shared by tests (moved out of tests/fast/test_observe.py: no test module imports another)."""

from __future__ import annotations

NODES = ["n1", "n1", "n2", "n2"]
