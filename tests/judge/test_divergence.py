"""The divergence model: noise vs divergence, early divergence, GradScaler's scale trajectory; the
replay/smoke Judge and the in-loop Guard decide the same on the same history."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import example
from nanprobe.base.config import GuardConfig, ReplayConfig, load_config
from nanprobe.judge.divergence import Divergence, Judge, Rules
from nanprobe.reach.entry import load_target
from nanprobe.live.guard import Guard
from nanprobe.base.report import Status, StepRecord
from nanprobe.pipeline.smoke import _smoke_replay_config


def _heavy(n: int, seed: int = 0) -> list[float]:
    """Batch losses of a regression with Pareto(1.5)-scaled noise: 10x-100x excursions that recover."""
    rng = random.Random(seed)
    return [3.0 * (1 + abs(rng.gauss(0, 1)) * rng.random() ** (-1 / 1.5)) ** 2 / 4 for _ in range(n)]


def _quiet(n: int, start: float = 2.0, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [start * 0.97 ** i * (1 + 0.05 * rng.gauss(0, 1)) for i in range(n)]


HEAVY = _heavy(60)
QUIET = _quiet(40)

# name: (losses, gradient norms (None: a constant 1.0), first step judged bad or None, what the reason says)
SERIES = {
    "heavy tails recover": (HEAVY, None, None, None),
    "quiet run, one extreme batch": (QUIET[:30] + [QUIET[30] * 500] + QUIET[31:], None, 30, "far outside"),
    "heavy tails, then a climb that stays": (HEAVY[:40] + [HEAVY[39] * 40 * 2 ** i for i in range(6)], None, 42,
                                            "3 steps in a row since step 40"),
    "runaway at step 1 (no history)": ([3.9, 390.0, 4e4], None, 1, "first losses"),
    "loss near zero jumps 20x": (_quiet(30, 1.0) + [0.4 ** 6 * 20] + _quiet(10, 0.4 ** 6), None, None, None),
    # converged from 2.3 to 1e-4; three harder batches at 2e-3: 20x, but 0.1% of where the loss started
    "converged loss, a harder stretch": ([2.3 * 0.6 ** i for i in range(20)] + _quiet(30, 1e-4, seed=3)[:30:1]
                                         + [2e-3, 2.2e-3, 1.9e-3] + _quiet(5, 1e-4, seed=4), None, None, None),
    "loss crosses zero": ([0.3, 0.2, 0.1, 0.02, -0.05, 0.01, -0.1, 0.05, -0.02, 0.2, -0.15, 0.03, 0.22, -0.19,
                           0.04, 0.0, 0.1], None, None, None),
    "gradient norm explodes in a quiet run": ([1.0] * 20, [1.0 + 0.01 * (i % 3) for i in range(15)]
                                              + [300.0, 1.0, 1.0, 1.0, 1.0], 15, "gradient-norm spike"),
}


def _records(losses, norms):
    norms = norms or [1.0] * len(losses)
    return [StepRecord(step=i, loss=l, grad_norm=n, lr=1e-3, update_ratio=None, finite=True)
            for i, (l, n) in enumerate(zip(losses, norms))]


def _judge_first_bad(judge: Judge, records) -> tuple[int | None, str | None]:
    for r in records:
        status, reason = judge.judge(r, True)
        if status is not Status.FINITE:
            return r.step, reason
        judge.add(r)
    return None, None


@pytest.mark.parametrize("name", list(SERIES), ids=list(SERIES))
def test_judge_tells_divergence_from_noise(name):
    losses, norms, bad, says = SERIES[name]
    step, reason = _judge_first_bad(Judge(load_config().replay), _records(losses, norms))
    assert step == bad, reason
    if says:
        assert says in reason


def _guard(cfg: GuardConfig) -> Guard:
    model = nn.Linear(2, 1)
    return Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)


@pytest.mark.parametrize("name", list(SERIES), ids=list(SERIES))
def test_guard_and_judge_decide_the_same_on_the_same_history(name):
    """Smoke's judge runs on the guard's thresholds: step by step the same verdict, and the guard's
    device-side cut-offs (used for the all-reduced flag) say the same as its host-side verdict."""
    losses, norms, _, _ = SERIES[name]
    cfg = load_config()
    judge = Judge(_smoke_replay_config(cfg))
    core = _guard(cfg.guard).core
    for r in _records(losses, norms):
        status, reason = judge.judge(r, True)
        t_loss, t_norm = core.thresholds()
        flagged = r.loss > t_loss or r.grad_norm > t_norm
        g_status, g_reason = core.judge.judge(r, True)
        assert (g_status, g_reason) == (status, reason), r.step
        assert flagged == (status is Status.SPIKE), r.step
        if status is not Status.FINITE:
            break
        judge.add(r)
        core.judge.add(r)


def _scaled(skips_then: list[tuple[bool, float]]):
    return [StepRecord(step=i, loss=1.0, grad_norm=math.inf if s else 1.0, lr=1e-3, update_ratio=None,
                       finite=True, skipped=s, scale=scale) for i, (s, scale) in enumerate(skips_then)]


SCALER = {
    # 17 skips from 65536 down to 1 are the back-off, whatever a skip counter says
    "warm-up from 65536 to 1, then training": ([(True, 2.0 ** (16 - i)) for i in range(17)] + [(False, 1.0)] * 5,
                                               None),
    "still skipping below scale 1": ([(True, 2.0 ** (16 - i)) for i in range(19)], 17),
    "after training worked, the scale falls 1024x": ([(True, 2.0 ** 16), (False, 2.0 ** 15)] * 3
                                                     + [(True, 2.0 ** (15 - i)) for i in range(12)], 16),
    "isolated skips after warm-up": ([(True, 65536.0), (True, 32768.0)] + [(False, 16384.0)] * 3
                                     + [(True, 16384.0), (False, 8192.0)] * 10, None),
}


@pytest.mark.parametrize("name", list(SCALER), ids=list(SCALER))
def test_gradscaler_is_judged_by_its_scale(name):
    steps, bad = SCALER[name]
    step, reason = _judge_first_bad(Judge(load_config().replay), _scaled(steps))
    assert step == bad, reason
    if bad is not None:
        assert reason.startswith("GradScaler skip storm")


def test_update_ratio_far_above_healthy_is_a_spike_without_history():
    judge = Judge(load_config().replay)
    rec = StepRecord(step=0, loss=2.0, grad_norm=0.3, lr=20.0, update_ratio=22.0, finite=True)
    status, reason = judge.judge(rec, True)
    assert status is Status.SPIKE and reason.startswith("update spike: |dw|/|w| = 22")
    ok = StepRecord(step=0, loss=2.0, grad_norm=0.3, lr=1e-3, update_ratio=0.003, finite=True)
    assert Judge(load_config().replay).judge(ok, True) == (Status.FINITE, None)


def _band(values: list[float]):
    """The loss series' band over ``values`` (no rise floor, the band formed at the last value)."""
    div = Divergence(Rules(min_history=len(values), loss_factor=10.0, z=6.0, extreme_factor=100.0, extreme_z=10.0,
                           rise_floor=0.0))
    for v in values:
        div.add(v, None)
    return div.loss


def test_band_is_a_ratio_band_for_positive_values_and_linear_across_zero():
    b = _band([1.0, 2.0, 4.0, 1.0, 2.0])
    assert b.log and b.median == pytest.approx(2.0) and b.candidate > 20.0 and b.extreme > 200.0
    lin = _band([-0.1, 0.1, 0.0, 0.2, -0.2])
    assert not lin.log and lin.median == 0.0 and lin.candidate > 0.2


def test_new_thresholds_are_configurable_and_documented():
    cfg = load_config()
    assert isinstance(cfg.replay, ReplayConfig) and cfg.replay.persist_steps == cfg.guard.persist_steps == 3
    lines = open(example("../configs/default.yaml")).read().splitlines()
    for key in ("spike_z", "extreme_factor", "extreme_z", "persist_steps", "runaway_factor", "baseline_steps",
                "rise_floor", "update_ratio_limit", "min_scale", "max_scale_drop", "update_ratio_high"):
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(key + ":"))
        comment = [lines[i]]
        while re.match(r" {20,}#", lines[i + len(comment)]):      # the comment's continuation lines
            comment.append(lines[i + len(comment)])
        assert "#" in comment[0] and comment[-1].rstrip().endswith(")"), comment   # a comment ending in its unit


def _guarded_first_event(name: str, steps: int):
    """Train the example in the README's guarded loop; the guard's first event (or None)."""
    t = load_target(example(name) + ":target").target
    scaler = torch.amp.GradScaler("cpu") if t.grad_scaler is True else None
    guard = Guard(t.model, t.optimizer, scaler=scaler, scheduler=t.scheduler, precision=t.precision.value,
                  config={"max_capsules": 0})
    dtype = t.precision.dtype if t.precision.low else None
    for step, batch in zip(range(steps), t.batches):
        with guard.step(batch):
            t.optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = t.loss_fn(t.model, batch)
            guard.backward(loss)
        if guard.optimizer_step(max_grad_norm=t.max_grad_norm) and t.scheduler is not None:
            t.scheduler.step()
        if guard.events:
            return guard.events[0]
    return None


# example, steps: the guard in the user's loop stops where smoke does, for the same reason
GUARDED = [("control_heavy_tailed_loss.py", 60), ("control_gradscaler_warmup.py", 40),
           ("control_batchnorm_batch2.py", 80), ("adamw_lr_too_high.py", 12), ("spike_unit_mixup_batch.py", 40),
           ("fp16_scaler_skip_storm.py", 24)]


@pytest.mark.parametrize("name, steps", GUARDED, ids=[g[0] for g in GUARDED])
def test_guard_in_the_users_loop_agrees_with_smoke(name, steps, tmp_path):
    from nanprobe.pipeline.smoke import smoke
    event = _guarded_first_event(name, steps)
    result = smoke(example(name) + ":target", steps=steps, capsule_dir=tmp_path)
    if result.healthy:
        assert event is None, event
    else:
        assert event is not None and (event.step, event.status) == (result.report.step, result.report.status.value)
        assert event.reason in "\n".join(result.report.top.evidence)
