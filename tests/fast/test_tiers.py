"""The test tiers (tests/conftest.py): which tier a test belongs to is read off its folder, its
markers and its fixtures, never off a word that merely appears among its keywords."""

from __future__ import annotations

from pathlib import Path

import conftest
import pytest

FAST = Path(conftest.TESTS) / "fast" / "test_x.py"


class _Item:
    """As much of a collected test as the tier checks read."""

    def __init__(self, path: Path, *, markers=(), keywords=(), fixturenames=()) -> None:
        self.path = path
        self.nodeid = f"{path.relative_to(conftest.ROOT)}::test_x"
        self.markers = set(markers)
        self.keywords = {word: 1 for word in (*keywords, *markers)}
        self.fixturenames = tuple(fixturenames)

    def get_closest_marker(self, name):
        return getattr(pytest.mark, name).mark if name in self.markers else None


@pytest.mark.parametrize("word", ["slurm", "dist", "gpu"])
def test_a_parameter_named_like_a_marker_leaves_a_fast_test_in_its_tier(word):
    """``@pytest.mark.parametrize(..., ids=["slurm", ...])`` makes ``slurm`` a keyword of the test:
    it took a fast test for a cluster test (refused), and a ``gpu`` id would have skipped it."""
    item = _Item(FAST, keywords=(f"test_x[{word}]", word))
    assert conftest._misplaced(item) is None
    assert not conftest._marked(item, word)


@pytest.mark.parametrize(
    ("markers", "fixturenames", "why"),
    [
        (("slurm",), (), "tests/cluster holds exactly the tests that use the dev cluster"),
        ((), ("slurm_cluster",), "tests/cluster holds exactly the tests that use the dev cluster"),
        (("dist",), (), "it belongs in tests/processes"),
    ],
)
def test_a_marker_or_the_clusters_fixture_places_a_test(markers, fixturenames, why):
    assert why in conftest._misplaced(_Item(FAST, markers=markers, fixturenames=fixturenames))
