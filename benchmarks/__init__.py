"""Runnable benchmarks: each prints a table and writes JSON (and a plot) under benchmarks/results."""
