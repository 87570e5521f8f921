"""Runnable examples built on tq_jax; not part of the installed library.

Import them from the repository root (``python -m examples.smollm2 ...``; the tests
find them through pytest's ``pythonpath = ["."]``).
"""
