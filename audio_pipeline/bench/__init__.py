"""Benchmarks: each reports ratios against a baseline measured in the same run (never timed tests)."""
