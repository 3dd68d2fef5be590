"""User-facing errors. Each names the user's code, the shapes, and what to do."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """The function could not be traced into autopar's IR."""


class MeshError(AutoparError):
    """The mesh is malformed or does not match the available devices."""


class MemoryBudgetError(AutoparError):
    """No plan found fits the memory budget."""


class PlanError(AutoparError):
    """A plan file is unreadable or does not match the function."""


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
