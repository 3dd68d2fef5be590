"""benchmarks.stages and .stage_model: the stage DP against brute force, the memory budget's
effect on the choices, determinism, and pricing a tiny GPT's pieces."""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import numpy as np
import pytest

import cost_models
from autopar.examples.models import gpt
from benchmarks import baselines
from benchmarks import stage_model as SM
from benchmarks import stages as PL


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def _brute(time_s, fits, end_s, factor):
    S, R, L1 = time_s.shape
    best = math.inf
    for ns in _compositions(L1 - 1, S):
        for rs in itertools.product(range(R), repeat=S):
            if all(fits[i, r, n] for i, (n, r) in enumerate(zip(ns, rs))):
                t = max(time_s[i, r, n] for i, (n, r) in enumerate(zip(ns, rs)))
                e = max(end_s[i, n] for i, n in enumerate(ns))
                best = min(best, factor * t + e)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_stage_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    S, L = int(rng.integers(1, 4)), int(rng.integers(3, 7))
    S = min(S, L)
    n = np.arange(L + 1)
    # per-layer time grows with remat, memory shrinks with it; stages differ (head, in-flight)
    per = rng.uniform(1, 2, (S, 1, 1)) * np.array([1.0, 1.1, 1.3])[None, :, None]
    time_s = per * n[None, None, :] + rng.uniform(0, 3, (S, 1, 1))
    time_s += rng.uniform(0, 0.5, time_s.shape)  # not exactly linear
    mem = rng.uniform(1, 3, (S, 1, 1)) * np.array([3.0, 2.0, 1.0])[None, :, None] * n
    fits = mem <= rng.uniform(4, 12)
    end_s = rng.uniform(0, 1, (S, 1)) * n[None, :] + rng.uniform(0, 2, (S, L + 1))
    factor = float(rng.integers(1, 8))
    res = PL.stage_dp(time_s, fits, end_s, factor)
    brute = _brute(time_s, fits, end_s, factor)
    if math.isinf(brute):
        assert res is None
        return
    assert res is not None and res.objective == pytest.approx(brute)
    assert sum(res.layers) == L and min(res.layers) >= 1
    ns, rs = res.layers, res.remat
    assert all(fits[i, r, k] for i, (k, r) in enumerate(zip(ns, rs)))
    t = max(time_s[i, r, k] for i, (k, r) in enumerate(zip(ns, rs)))
    assert factor * t + max(end_s[i, k] for i, k in enumerate(ns)) == pytest.approx(brute)


# A synthetic model: 16 layers, each 1 ms fwd+bwd and 1 GB of kept activations.
COSTS = SM.LayerCosts(
    tp=1,
    micro=1,
    fb_s=3e-3,
    fwd_s=1e-3,
    selective_s=0.2e-3,
    act_bytes=1e9,
    core_act_bytes=0.5e9,
    input_bytes=0.05e9,
    work_bytes=0.2e9,
    param_bytes=0.5e9,
    opt_bytes=1e9,
    opt_s=1e-4,
    head_fb_s=1e-3,
    head_act_bytes=0.5e9,
    head_param_bytes=0.2e9,
    head_opt_bytes=0.4e9,
    head_opt_s=1e-5,
    send_bytes=0.05e9,
)
SPACE = PL.SearchSpace(model=(1, 2), micro_batch=(1, 2))


def _pricer(tp, micro):
    """COSTS scaled like a real layer: time and activations with micro / tp."""
    f = micro / tp
    return dataclasses.replace(
        COSTS,
        tp=tp,
        micro=micro,
        **{
            k: getattr(COSTS, k) * f
            for k in ("fb_s", "fwd_s", "selective_s", "act_bytes", "core_act_bytes")
        },
        param_bytes=COSTS.param_bytes / tp,
        opt_bytes=COSTS.opt_bytes / tp,
    )


def _search(budget, space=SPACE):
    prof = cost_models.load("a100-80g")
    return PL.search_stages(
        _pricer,
        layers=16,
        batch=32,
        devices=16,
        profile=prof,
        flops=1e15,
        memory_budget=budget,
        space=space,
    )


def test_budget_forces_remat_zero_and_stages():
    roomy = _search(1e12)
    assert set(roomy.remat) == {"none"}
    assert roomy.memory_bytes <= 1e12
    # step = (M + S - 1) x bottleneck + end, and every candidate within the budget
    t = roomy.terms
    M, S = roomy.config.micro_batches, roomy.config.stages
    assert roomy.step_s == pytest.approx((M + S - 1) * t.bottleneck_s + t.end_s)
    steps = [roomy.step_s]
    for budget in (20e9, 8e9, 5e9):
        plan = _search(budget)
        assert max(plan.memory_by_stage) <= budget
        assert all(c.memory_bytes <= budget for c in plan.candidates if c.fits)
        steps.append(plan.step_s)
    assert steps == sorted(steps)  # a tighter budget never speeds the step up
    tight = _search(5e9)
    assert "full" in tight.remat and tight.config.stages > roomy.config.stages
    with pytest.raises(ValueError, match="no pipeline plan fits"):
        _search(1e8)


def test_remat_only_budget_picks_remat():
    # one stage, one mesh shape, no ZeRO: only remat can make it fit
    space = PL.SearchSpace(stages=(1,), model=(1,), micro_batch=(1,), zero=(0,))
    roomy, mid, tight = (_search(b, space) for b in (1e12, 45e9, 40e9))
    assert (roomy.remat, mid.remat, tight.remat) == (("none",), ("selective",), ("full",))
    assert roomy.step_s < mid.step_s < tight.step_s
    assert roomy.memory_bytes > 45e9 >= mid.memory_bytes > 40e9 >= tight.memory_bytes


def test_even_split():
    plan = _search(8e9, dataclasses.replace(SPACE, even=True, stages=(2, 4, 8)))
    sizes = {b - a for a, b in plan.stages}
    assert sizes == {16 // plan.config.stages}
    assert plan.step_s >= _search(8e9, dataclasses.replace(SPACE, stages=(2, 4, 8))).step_s


def test_gpipe_holds_every_microbatch():
    cfg = PL.Config(4, 2, 2, 1, 8, "1f1b", 0)
    assert [PL.inflight(cfg, i) for i in range(4)] == [4, 3, 2, 1]
    g = dataclasses.replace(cfg, schedule="gpipe")
    assert [PL.inflight(g, i) for i in range(4)] == [8] * 4
    m1 = PL.stage_memory(COSTS, cfg, 0, 4, "none")
    mg = PL.stage_memory(COSTS, g, 0, 4, "none")
    assert mg.activations > m1.activations and mg.params == m1.params
    z3 = PL.stage_memory(COSTS, dataclasses.replace(cfg, zero=3), 1, 4, "none")
    assert z3.params < m1.params and z3.grads < m1.grads and z3.optimizer < m1.optimizer


def test_search_is_deterministic():
    a, b = _search(6e9), _search(6e9)
    assert a == b and a.table() == b.table()
    assert len(a.table()) == len(PL.configs(16, 32, 16, 8, SPACE))


def test_megatron_specs_match_baselines():
    cfg = gpt.GPTConfig(layers=2, hidden=64, heads=4, seq=16, vocab=128, batch_size=4)
    args = gpt.abstract_args(cfg)
    mesh = {"data": 2, "model": 4}
    ours = SM.megatron_specs(args, mesh)
    theirs = baselines.specs(baselines.BASELINES["megatron"], args, mesh)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    assert jax.tree_util.tree_leaves(ours) == jax.tree_util.tree_leaves(theirs)


@pytest.mark.parametrize("scan", [False, True])
def test_shape_from_args(scan):
    cfg = gpt.GPTConfig(
        layers=3, hidden=64, heads=4, seq=16, vocab=128, batch_size=4, scan_layers=scan
    )
    assert SM.GPTShape.from_args(*gpt.abstract_args(cfg), heads=4) == SM.GPTShape.from_config(cfg)


def test_prices_a_tiny_gpt():
    prof = cost_models.load("a100-80g")
    shape = SM.GPTShape(layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    c = SM.price_gpt_layers(shape, 2, 1, prof)
    assert c.fb_s > c.fwd_s > c.selective_s > 0 and c.head_fb_s > 0
    assert c.act_bytes > c.core_act_bytes > 0 and c.act_bytes > c.input_bytes
    assert c.param_bytes > 0 and c.opt_bytes == pytest.approx(2 * c.param_bytes, rel=0.01)
    plan = PL.search_gpt(
        shape, 4, prof, space=PL.SearchSpace(model=(1, 2), micro_batch=(1,), zero=(0,))
    )
    assert sum(b - a for a, b in plan.stages) == 4 and 0 < plan.mfu < 1
