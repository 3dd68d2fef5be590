"""Why no layer stack was found where layers look alike: their forward ops are the
same, their backward ops are not (two blocks, the first applied straight to an argument
of the step, whose gradient JAX does not compute; otherwise the first backward op that
differs is named). Run only where `find_stacks` found nothing, for the messages that
say so (`pipeline_stages=`, `remat=`)."""

from __future__ import annotations

from collections import Counter

from autopar.ir.graph import Graph, phases
from autopar.passes.stack_candidates import candidates, runs_of
from autopar.passes.stack_pad import reads_argument
from autopar.passes.stacks import BACKWARD_DIFFERS, _Stack


def why_no_stack(graph: Graph, min_layers: int = 2) -> str | None:
    """Where `find_stacks` finds no stack but some `min_layers` layers of a template have
    the same forward ops and differ only in their backward ops: which, and why; None
    otherwise."""
    phase = phases(graph)
    for template, layers in candidates(graph, phase, min_layers):
        why = _alike_forward(_Stack(graph, phase, template, layers), min_layers)
        if why is not None:
            return why
    return None


def _alike_forward(st: _Stack, min_layers: int) -> str | None:
    """`why_no_stack` for one template: None where `st.stacks` finds a stack, or no
    `min_layers` linked layers have the same forward ops."""
    got = st.keyed()
    if got is None:
        return None
    fblocks, bblocks, keys, linked, _ = got
    layers = list(range(st.n))
    same = lambda a, b: keys[a] == keys[b] and linked[a]  # noqa: E731
    if any(len(r) >= min_layers for r in runs_of(layers, same)):
        return None
    alike = lambda a, b: keys[a][0] == keys[b][0] and linked[a]  # noqa: E731
    run = max(runs_of(layers, alike), key=len)
    if len(run) < min_layers:
        return None
    backs = Counter(keys[k][1] for k in run)
    # the most common backward, or on a tie the longest (a first layer applied to an
    # argument of the step lacks the input gradient's ops)
    common = max(backs, key=lambda b: (backs[b], len(b)))
    odd = [k for k in run if keys[k][1] != common]
    text = (
        f"the {len(run)} layers of {st.template} have the same forward ops, but the "
        f"backward ops of layer {', '.join(str(st.layers[k].index) for k in odd)} differ "
        "from the others'"
    )
    g = st.g
    if odd == [run[0]] and reads_argument(g, st.param, fblocks[run[0]]):  # the hint's case
        return f"{text}, {BACKWARD_DIFFERS}"
    ref = next(k for k in run if keys[k][1] == common)
    mine, theirs = sorted(bblocks[odd[0]]), sorted(bblocks[ref])
    at = next((q for q, (a, b) in enumerate(zip(mine, theirs)) if st.sig(a) != st.sig(b)), None)
    if at is None:  # one is the other's start: the longer one's next op is the first change
        at, mine = min(len(mine), len(theirs)), mine if len(mine) > len(theirs) else theirs
    where = g.nodes[mine[at]].key if at < len(mine) else "its end"
    return (
        f"{text}: {len(bblocks[odd[0]])} ops against {len(bblocks[ref])}, the first that "
        f"differs at {where}; layers whose gradients are computed alike make a stack"
    )
