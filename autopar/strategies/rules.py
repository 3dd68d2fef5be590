"""Importing this module registers every rule family."""

from autopar.strategies import control, elementwise, indexing, linalg, reductions, shapes  # noqa: F401
