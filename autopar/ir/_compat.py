"""The one place where autopar touches JAX internals.

Everything else imports from here, so a JAX upgrade is a one-file change.
Checked against JAX 0.10.2.
"""

from __future__ import annotations

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
]


def eqn_source(eqn: JaxprEqn) -> str:
    """`file.py:42` of the user frame that created `eqn` (JAX internals skipped)."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "<unknown>"
    return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}"


def eqn_name_stack(eqn: JaxprEqn) -> str:
    """The eqn's name stack as a `/`-separated string (`jvp(GPT)/h_0/mlp`)."""
    return str(eqn.source_info.name_stack)
