"""The README's Python examples run as written (on the 8 simulated CPU devices), and the
NNX one trains: its model's parameters change in place."""

from __future__ import annotations

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_examples_run():
    blocks = python_blocks()
    assert len(blocks) == 2, "the README has a linen and an NNX example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md:linen", "exec"), scope)  # noqa: S102
    kernel = lambda: np.asarray(scope["net"].l1.kernel[...]).copy()
    plan = scope["fast"].plan(scope["params"], scope["opt_state"], scope["x"], scope["y"])
    assert plan.cost.step_s > 0
    exec(compile(blocks[1], "README.md:nnx", "exec"), scope)  # noqa: S102
    before = kernel()
    scope["nnx_fast"](scope["net"], scope["optimizer"], scope["x"], scope["y"])
    assert not np.allclose(before, kernel()), "the NNX step did not update the model"
