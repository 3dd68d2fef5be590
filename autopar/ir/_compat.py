"""The one place where autopar touches JAX internals.

Everything else imports from here, so a JAX upgrade is a one-file change.
Checked against JAX 0.10.2.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from jax._src import source_info_util  # no public API for eqn source lines
from jax._src.tree_util import broadcast_prefix  # no public API for prefix pytrees
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

__all__ = [
    "broadcast_prefix",
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Var",
    "eqn_source",
    "eqn_name_stack",
    "eqn_frames",
]


def eqn_source(eqn: JaxprEqn) -> str:
    """`file.py:42` of the user frame that created `eqn` (JAX internals skipped)."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "<unknown>"
    return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}"


def eqn_frames(eqn: JaxprEqn) -> Iterator[tuple[str, str]]:
    """(file name, `file.py:LINE`) of the frames that made `eqn`, innermost first, JAX's
    own frames skipped (as `source_info_util.user_frames` does). Each location is
    computed once per code position: a 58k-op step repeats a few hundred of them."""
    tb = eqn.source_info.traceback
    if tb is None:
        return
    for code, lasti in zip(*tb.raw_frames()):
        if source_info_util.is_user_filename(code.co_filename):
            yield _location(code, lasti)


@functools.lru_cache(maxsize=65536)
def _location(code, lasti: int) -> tuple[str, str]:
    frame = source_info_util.raw_frame_to_frame(code, lasti)
    return frame.file_name, f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}"


def eqn_name_stack(eqn: JaxprEqn) -> str:
    """The eqn's name stack as a `/`-separated string (`jvp(GPT)/h_0/mlp`)."""
    return str(eqn.source_info.name_stack)
