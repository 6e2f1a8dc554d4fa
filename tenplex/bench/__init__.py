"""Benchmarks run by ``tenplex bench``. Each prints JSON with a same-run baseline; none is a timed test.

May import: every tenplex layer.
"""
