"""kvbm benchmarks: ``kvbm bench tiers | manager | long-doc-qa`` (see :mod:`kvbm.cli.bench`).

Benchmarks are not tests: they measure this machine, print a table, and write JSON (and PNG plots).
Every run works in its own temp dirs, bucket prefix and shared-memory pools and removes them afterwards.
"""
