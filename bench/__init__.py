"""Benchmarks and their reports."""
