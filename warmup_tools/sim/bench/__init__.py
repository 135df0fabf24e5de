"""Benchmarks: commands that print figures (ratios of configurations measured in one run)."""
