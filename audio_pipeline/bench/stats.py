"""Statistics the benchmarks report."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` by nearest rank (no interpolation: a value that occurred)."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]
