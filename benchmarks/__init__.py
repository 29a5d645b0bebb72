"""Benchmark suites for bench.py; each module exposes run(args) -> list[dict]."""
