"""Benchmarks: scripts that print comparison tables (not tests).

Each runs as a module from the repository root (``python -m benchmarks.bench_sqlite``) or as
a script (``python benchmarks/bench_sqlite.py``); either way it imports the asynclock and
``tests.support`` of the project environment (``uv sync`` installs the checkout editable).
"""
