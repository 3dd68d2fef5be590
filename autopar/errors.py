"""User-facing errors. Each names the user's code, the shapes, and what to do.

Every class names its section of docs/troubleshooting.md in `doc`, and its message
ends with that link, as JAX's errors end with theirs: a raise site writes only the
message. `message` is the text without the link, for quoting one error in another
(a failure listed in a `MemoryBudgetError`, a note in a plan's warnings)."""

from __future__ import annotations

import os
import sys

DOCS = "docs/troubleshooting.md"
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_level() -> int:
    """The `stacklevel` that points a `warnings.warn` made by the caller of this at the
    user's line: the first frame outside autopar (its `.plan()`, its call of a
    parallelized function), however deep in autopar the warning is raised."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose. Raised as itself for an
    option value autopar does not know (`precision=`, `remat=`, `engine=`) or arguments
    that do not bind to the function (a missing one, one for `**kwargs`, a donated one
    passed again)."""

    doc: str | None = "option-and-argument-errors"

    def __init_subclass__(cls, **kwargs):
        # A subclass names its own section or carries no link (one defined elsewhere
        # does not inherit a section about something else).
        super().__init_subclass__(**kwargs)
        if "doc" not in cls.__dict__:
            cls.doc = None

    @property
    def message(self) -> str:
        """The message as raised, without the docs link."""
        return super().__str__()

    def __str__(self) -> str:
        text = self.message
        return f"{text} (see {DOCS}#{self.doc})" if self.doc else text


class CaptureError(AutoparError):
    """The function could not be traced into autopar's IR: it does not run under
    `jax.jit` with these arguments (a Python value used concretely, a string leaf, a
    sharding constraint naming an axis the mesh lacks)."""

    doc = "capture-errors"


class MeshError(AutoparError):
    """The mesh is malformed (a size that is not a positive int, an empty dict, an
    unknown form), needs more devices than there are, or the specs given against it
    name axes it does not have or do not divide the shapes (`in_specs=`, a
    `with_sharding_constraint` built on another mesh)."""

    doc = "mesh-errors"


class PipelineError(AutoparError):
    """A pipeline request the function or the mesh does not allow: `pipeline_stages`
    without a mesh axis `"stage"` of that size or with no loop over layers,
    `pipeline_schedule` unknown or (for 1F1B) not matching how the step splits, or a
    layer loop that cannot run micro-batch by micro-batch."""

    doc = "pipeline-errors"


class MicrobatchError(AutoparError):
    """Micro-batching does not apply: a `grad_accumulation` or `microbatches` count that
    is not a positive int or does not divide the batch, a step with no batch argument,
    or one that computes something else at the micro-batch size."""

    doc = "micro-batch-errors"


class MemoryBudgetError(AutoparError):
    """No plan found fits the memory budget."""

    doc = "memory-budget-errors"


class PlanError(AutoparError):
    """A plan file is unreadable or does not match the function."""

    doc = "plan-errors"


class UsageError(AutoparError):
    """Bad command-line input (an option value, a device count, a missing make_args)."""

    doc = "command-line-errors"


class TargetError(AutoparError):
    """A TARGET (`file.py:factory` / `module:factory`) could not be loaded."""

    doc = "command-line-errors"


class RenderError(AutoparError):
    """The picture cannot be made (bad output name, nothing to draw)."""

    doc = "command-line-errors"


class CheckpointError(AutoparError):
    """A checkpoint is missing, or does not match the state or shardings asked for."""

    doc = "checkpoint-and-multi-host-errors"


class DistributedError(AutoparError):
    """The multi-process runtime could not start, or processes disagree."""

    doc = "checkpoint-and-multi-host-errors"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def did_you_mean(name: object, choices) -> str:
    """` (did you mean 'data'?)` when `name` is a near miss of one of `choices` (by
    `difflib.get_close_matches`, case-insensitively), else `""`: appended to a message
    about an unknown option value or axis name."""
    import difflib

    if not isinstance(name, str):
        return ""
    choices = [c for c in choices if isinstance(c, str)]
    lower = {c.lower(): c for c in choices}
    if name.lower() in lower and lower[name.lower()] != name:
        return f" (did you mean {lower[name.lower()]!r}?)"
    close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.6)
    return f" (did you mean {lower[close[0]]!r}?)" if close else ""


# the last line of a MemoryBudgetError; `compile.step` adds the options the call left unused
BUDGET_HINT = "Raise memory_budget, use more devices, or shrink the batch."
