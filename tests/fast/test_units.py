"""hpc_hsdp.plan.units: every formatter's text, pinned as plan, prepare-data, status and the report print it."""

from __future__ import annotations

import math

import pytest

from hpc_hsdp.plan.units import byte_unit, duration, format_bytes, human_bytes, human_count, seconds, si


def test_format_bytes_is_binary_with_two_decimals():
    values = [0, 512, 1023, 1024, 1536, 2**20 * 3.5, 2**30 * 80, 2**40 * 2.25, 2**50, -2048]
    assert [format_bytes(v) for v in values] == [
        "0 B",
        "512 B",
        "1023 B",
        "1.00 KiB",
        "1.50 KiB",
        "3.50 MiB",
        "80.00 GiB",
        "2.25 TiB",
        "1024.00 TiB",
        "-2.00 KiB",
    ]


@pytest.mark.parametrize(
    ("values", "unit"),
    [([], (1, "bytes")), ([512], (1, "bytes")), ([512, -3 * 2**20], (2**20, "MiB")), ([2**30 * 80], (2**30, "GiB"))],
)
def test_byte_unit_suits_the_largest_value(values, unit):
    assert byte_unit(values) == unit


def test_the_decimal_progress_units():
    assert [human_bytes(v) for v in [0, 999, 1000, 1234567, 5.5e9, 7.2e12, 3e15]] == [
        "0 B",
        "999 B",
        "1.0 KB",
        "1.2 MB",
        "5.5 GB",
        "7.2 TB",
        "3000.0 TB",
    ]
    assert [human_count(v) for v in [0, 999.4, 1000, 3.4e6, 2.5e9, 4e12]] == [
        "0",
        "999",
        "1.00K",
        "3.40M",
        "2.50G",
        "4000.00G",
    ]


def test_si_and_seconds_keep_three_significant_digits():
    assert [si(v) for v in [0, 0.000123, 0.5, 12.345, 999, 1000, 1234567, -2.5e9, 3e12]] == [
        "0",
        "0.000123",
        "0.5",
        "12.3",
        "999",
        "1k",
        "1.23M",
        "-2.5G",
        "3T",
    ]
    assert [seconds(v) for v in [0, 0.0125, 0.999, 1, 12.34, -0.5]] == [
        "0 ms",
        "12.5 ms",
        "999 ms",
        "1 s",
        "12.3 s",
        "-500 ms",
    ]


def test_duration_rounds_to_whole_seconds_and_says_what_it_cannot_know():
    assert [duration(v) for v in [None, math.nan, math.inf, -5, 0, 59.6, 3725, 90000]] == [
        "?",
        "?",
        "?",
        "0s",
        "0s",
        "1m00s",
        "1h02m",
        "1d01h",
    ]
