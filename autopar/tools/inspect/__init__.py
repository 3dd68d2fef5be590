"""Reading plans: the reports behind `autopar inspect`, `autopar diff` and `autopar explain`.

Everything here works on a `Plan` alone (loaded from its JSON file, no function
needed), except `explain_alternatives`, which prices every strategy an op could have
had on the search problem rebuilt from the traced function.

    format   seconds, bytes, layer/phase of a key, per-device sizes, split pictures
    tables   `Table` and its text, Markdown and HTML renderers
    report   `autopar inspect`
    diff     `autopar diff`
    explain  `autopar explain`
"""

from autopar.tools.inspect.diff import diff_plans, render_diff
from autopar.tools.inspect.explain import (
    Alternative,
    explain,
    explain_alternatives,
    explain_op,
    find_ops,
    plan_choice,
    rebuild_problem,
    render_alternatives,
)
from autopar.tools.inspect.format import (
    comm_key,
    layer_of_op,
    layer_of_path,
    param_args,
    phase_of_op,
)
from autopar.tools.inspect.report import inspect_summary, render_inspect
from autopar.tools.inspect.tables import Table, render

__all__ = [
    "Alternative",
    "Table",
    "comm_key",
    "diff_plans",
    "explain",
    "explain_alternatives",
    "explain_op",
    "find_ops",
    "inspect_summary",
    "layer_of_op",
    "layer_of_path",
    "param_args",
    "phase_of_op",
    "plan_choice",
    "rebuild_problem",
    "render",
    "render_alternatives",
    "render_diff",
    "render_inspect",
]
