"""Benchmarks: each prints one table with its baseline measured in the same run."""
