"""Example models and workloads: `autopar.examples:gpt_small` on the command line."""

from autopar.examples.examples import *  # noqa: F403
from autopar.examples.examples import SUITE, __all__  # noqa: F401
