"""hpc_hsdp.plan.records: a record behaves as the frozen, keyword-only dataclass it stands for."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import FrozenInstanceError, dataclass, field
from functools import cached_property

import pytest

from hpc_hsdp.plan.records import record

CALLS: list[str] = []


@record
class Point:
    """A record of every feature the package's records use."""

    x: int
    y: int = 2
    tags: tuple[str, ...] = ()
    notes: dict = field(default_factory=dict, compare=False, repr=False)
    label: str | None = field(default=None, metadata={"option": "label"})

    def __post_init__(self) -> None:
        CALLS.append("post_init")
        object.__setattr__(self, "tags", tuple(self.tags))

    @cached_property
    def norm(self) -> int:
        return self.x * self.x + self.y * self.y


@dataclass(frozen=True, kw_only=True)
class PointTwin:
    x: int
    y: int = 2
    tags: tuple[str, ...] = ()
    notes: dict = field(default_factory=dict, compare=False, repr=False)
    label: str | None = field(default=None, metadata={"option": "label"})


@record(kw_only=False)
class Pair:
    first: str
    second: int = 0


def test_a_record_is_built_compared_hashed_and_shown_as_its_dataclass_twin() -> None:
    CALLS.clear()
    point = Point(x=1, tags=["a"], label="p")
    assert CALLS == ["post_init"] and point.tags == ("a",) and point.notes == {}
    twin = PointTwin(x=1, tags=("a",), label="p")
    assert repr(point) == repr(twin).replace("PointTwin", "Point")
    assert point == Point(x=1, tags=("a",), label="p", notes={"ignored": True})
    assert point != Point(x=1, y=3, tags=("a",), label="p") and point != twin
    assert hash(point) == hash(Point(x=1, tags=("a",), label="p")) == hash(dataclasses.astuple(point)[:3] + ("p",))
    assert Point(x=1).notes is not Point(x=1).notes, "a default_factory makes one value per instance"
    assert point.norm == 5 and point.norm == 5


def test_a_record_is_frozen() -> None:
    point = Point(x=1)
    with pytest.raises(FrozenInstanceError, match="cannot assign to field 'x'"):
        point.x = 2
    with pytest.raises(FrozenInstanceError, match="cannot delete field 'y'"):
        del point.y
    with pytest.raises(FrozenInstanceError):
        point.other = 1


def test_dataclass_functions_work_on_a_record() -> None:
    point = Point(x=1, tags=("a",), label="p")
    assert dataclasses.is_dataclass(point)
    assert [f.name for f in dataclasses.fields(Point)] == [f.name for f in dataclasses.fields(PointTwin)]
    assert dataclasses.fields(Point)[4].metadata["option"] == "label"
    assert dataclasses.asdict(point) == dataclasses.asdict(PointTwin(x=1, tags=("a",), label="p"))
    moved = dataclasses.replace(point, y=7)
    assert moved == Point(x=1, y=7, tags=("a",), label="p") and point.y == 2


def test_a_record_survives_pickle_and_copy() -> None:
    point = Point(x=3, tags=("b",))
    assert pickle.loads(pickle.dumps(point)) == point
    assert copy.deepcopy(point) == point and copy.copy(point) == point


def test_wrong_arguments_are_refused_as_a_dataclass_refuses_them() -> None:
    with pytest.raises(TypeError, match=r"Point.__init__\(\) got an unexpected keyword argument 'z'"):
        Point(x=1, z=2)
    with pytest.raises(TypeError, match=r"Point.__init__\(\) missing 1 required argument: 'x'"):
        Point()
    with pytest.raises(TypeError, match="takes 1 positional argument but 2 were given"):
        Point(1)


def test_a_positional_record_takes_its_fields_in_order() -> None:
    assert Pair("a", 2) == Pair(first="a", second=2) == Pair("a", second=2)
    assert Pair("a").second == 0
    with pytest.raises(TypeError, match="multiple values for argument 'first'"):
        Pair("a", first="b")
    with pytest.raises(TypeError, match="takes 3 positional arguments but 4 were given"):
        Pair("a", 1, 2)
