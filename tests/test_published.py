"""benchmarks.published: the papers' FLOP formulas and the composition on a tiny config."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cost_models
from benchmarks import published as P


def _anchor(name):
    return next(a for a in P.ANCHORS if a.name == name)


def test_param_count_matches_table1_sizes():
    # Megatron eq. (2) reproduces the sizes the paper's Table 1 names.
    for name, billions in [("megatron-7.5B", 7.5), ("megatron-39.1B", 39.1)]:
        assert P.params_count(_anchor(name)) / 1e9 == pytest.approx(billions, abs=0.05)
    assert P.params_count(_anchor("megatron-145.6B")) / 1e9 == pytest.approx(145.6, abs=0.1)


def test_korthikanti_mfu_from_published_step():
    # 72 B s l h^2 (1 + s/6h + V/12lh) / (13.75 s x 64 x 312 TFLOP/s) is the paper's 51.4 %.
    a = _anchor("korthikanti-175B")
    mfu = P.model_flops(a.batch, a.seq, a.layers, a.hidden, a.vocab) / (
        P.published_step_s(a) * a.gpus * P.A100_BF16_PEAK
    )
    assert mfu == pytest.approx(0.514, abs=0.001)


def test_tflops_to_step_time_roundtrip():
    a = _anchor("megatron-145.6B")
    step = P.published_step_s(a)
    flops = P.megatron_flops(a.batch, a.seq, a.layers, a.hidden, a.vocab)
    assert flops / (step * a.gpus) == pytest.approx(148e12)
    # eq. (3) is 4/3 of the model FLOPs in the layers (recompute) and the same logits.
    assert P.megatron_flops(1, 2048, 1, 4096, 0) == pytest.approx(
        4 / 3 * P.model_flops(1, 2048, 1, 4096, 0)
    )


def test_every_anchor_is_consistent():
    for a in P.ANCHORS:
        a.check()
    assert _anchor("megatron-145.6B").microbatches == 96  # 2304 / (24 DP x b 1)


TINY = P.Anchor("tiny", "test", 4, 64, 4, 2, 2, 8, 8, 1, "full", tflops=1.0, seq=32, vocab=256)


def test_composition_on_tiny_config():
    prof = cost_models.load("a100-80g")
    t = P.price(TINY, prof)
    p, m = TINY.pp, TINY.microbatches
    assert TINY.dp == 2 and m == 4
    assert t["layer_fb_s"] > 0 and t["recompute_s"] > 0 and t["head_fb_s"] > 0
    assert t["recompute_s"] < t["layer_fb_s"]  # one forward < forward + backward
    per_mb = (TINY.layers // p) * (t["layer_fb_s"] + t["recompute_s"]) + t["head_fb_s"]
    assert t["t_microbatch_s"] == pytest.approx(per_mb + t["p2p_s"])
    assert t["pipeline_s"] == pytest.approx((m + p - 1) * t["t_microbatch_s"])
    assert t["step_s"] == pytest.approx(t["pipeline_s"] + t["dp_allreduce_s"] + t["optimizer_s"])
    # the DP group is data x (model inside) = 2 GPUs 2 apart: one node, NVLink
    lat = prof.intra_latency
    bw = prof.intra_bandwidth * prof.intra_link_efficiency
    assert t["dp_allreduce_s"] == pytest.approx(lat + 2 * (1 / 2) * t["dp_grad_bytes"] / bw)
    # without a pipeline there is no bubble and no send
    flat = P.price(dataclasses.replace(TINY, pp=1, gpus=4), prof)
    assert flat["p2p_s"] == 0 and flat["bubble_s"] == 0


def test_effective_factor_scales_the_peak():
    prof = cost_models.load("a100-80g")
    q = P.with_factors(prof, compute=2.0, hbm=0.5)
    assert q.compute_efficiency == 1.0 and q.hbm_efficiency == 0.5
    assert q.flops_for("bfloat16") == pytest.approx(2 * prof.flops_for("bfloat16"))


def test_fit_recovers_known_factors():
    # T = base + slopes @ (x - x0) with data generated at x*: the fit returns x*.
    rng = np.random.default_rng(0)
    slopes = rng.uniform(0.5, 2.0, (5, 2))
    x0, xs = np.array([1.6, 1.25]), np.array([1.3, 2.0])
    base = rng.uniform(5, 10, 5)
    pub = base + slopes @ (xs - x0)
    assert P.fit_linear(base, slopes, pub, x0) == pytest.approx(xs)
    # bounded to x >= 1 (efficiency <= 1) when the optimum is outside
    xb = P.fit_linear(base, slopes, base + slopes @ (np.array([0.5, 2.0]) - x0), x0, np.ones(2))
    assert xb[0] == pytest.approx(1.0)
