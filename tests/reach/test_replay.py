"""Replay reaches the exact state the user's loop had before step N."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanprobe.base.config import load_config
from nanprobe.base.errors import TargetError
from nanprobe.base.precision import Precision
from nanprobe.reach.replay import NoBadStep, reach
from nanprobe.base.report import Status
from nanprobe.locate.rerun import run_step
from nanprobe.reach.target import Target

CFG = load_config().replay


class Noisy(nn.Module):
    """Dropout and BatchNorm: RNG and buffers must be replayed exactly."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.drop(self.bn(self.lin(x))))


def make(seed=0, **kw):
    torch.manual_seed(seed)
    model = Noisy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(6, 4, generator=g), "y": torch.randn(6, 1, generator=g)} for _ in range(8)]
    return Target(model=model, loss_fn=lambda m, b: F.mse_loss(m(b["x"]), b["y"]), batches=batches,
                  optimizer=opt, scheduler=sched, max_grad_norm=1.0, **kw)


def users_loop(target: Target, steps: int):
    for step, batch in zip(range(steps), target.batches):
        target.optimizer.zero_grad(set_to_none=True)
        loss = target.loss_fn(target.model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.model.parameters(), target.max_grad_norm)
        target.optimizer.step()
        target.scheduler.step()


def test_state_before_step_is_bitwise_the_users():
    ref = make()
    users_loop(ref, 5)
    user_rng = torch.get_rng_state()
    t = make()
    reached = reach(t, at=5, precision=Precision.FP32, cfg=CFG, where="t")
    reached.restore()
    for (k, a), (_, b) in zip(ref.model.state_dict().items(), t.model.state_dict().items()):
        assert torch.equal(a, b), k
    assert t.scheduler.get_last_lr() == ref.scheduler.get_last_lr()
    sa, sb = ref.optimizer.state_dict()["state"], t.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    assert torch.equal(torch.get_rng_state(), user_rng)
    assert reached.step == 5 and len(reached.history) == 5


def test_reruns_are_deterministic_and_leave_objects_unchanged():
    t = make()
    reached = reach(t, at=3, precision=Precision.FP32, cfg=CFG, where="t")
    before = copy.deepcopy(t.model.state_dict())
    a = run_step(t, reached, Precision.FP32, where="t", instrument=True)
    b = run_step(t, reached, Precision.FP32, where="t", instrument=False)
    assert a.record.loss == b.record.loss and a.record.grad_norm == b.record.grad_norm
    assert all(torch.equal(v, t.model.state_dict()[k]) for k, v in before.items())


def test_load_state_starts_from_the_users_checkpoint():
    ckpt = {}
    ref = make()
    users_loop(ref, 4)
    ckpt["model"] = copy.deepcopy(ref.model.state_dict())
    ckpt["opt"] = copy.deepcopy(ref.optimizer.state_dict())
    ckpt["sched"] = ref.scheduler.state_dict()
    calls = []

    def load_state(step):
        calls.append(step)
        t.model.load_state_dict(ckpt["model"])
        t.optimizer.load_state_dict(ckpt["opt"])
        t.scheduler.load_state_dict(ckpt["sched"])
        return 4

    t = make()
    t.load_state = load_state
    reached = reach(t, at=6, precision=Precision.FP32, cfg=CFG, where="t")
    assert calls == [6]
    assert reached.step == 6 and [h.step for h in reached.history] == [4, 5]
    assert "load_state(6) -> step 4" in reached.reached_by


def test_load_state_must_return_a_step_at_or_before():
    t = make()
    t.load_state = lambda step: step + 1
    with pytest.raises(TargetError, match="load_state"):
        reach(t, at=2, precision=Precision.FP32, cfg=CFG, where="t")


def test_first_bad_step_and_at_always_diagnoses_the_step_asked_for():
    t = make()
    t.batches[4]["x"][0, 0] = float("nan")
    reached = reach(t, at=None, precision=Precision.FP32, cfg=CFG, where="t")
    assert reached.step == 4 and reached.status is Status.NONFINITE and "loss is nan" in reached.reason
    t = make()
    t.batches[4]["x"][0, 0] = float("nan")
    reached = reach(t, at=6, precision=Precision.FP32, cfg=CFG, where="t")
    assert reached.step == 6 and [r.step for r in reached.earlier] == [4, 5]
    assert any("step 4 was already bad" in n and "--at 4" in n for n in reached.notes)


def test_healthy_replay_raises_no_bad_step():
    with pytest.raises(NoBadStep) as info:
        reach(make(), at=None, precision=Precision.FP32, cfg=CFG, where="t")
    assert info.value.steps == 8


def test_loss_spike_is_flagged():
    t = make()
    for b in t.batches[6:]:
        b["y"] *= 1e4
    reached = reach(t, at=None, precision=Precision.FP32, cfg=CFG, where="t")
    assert reached.step == 6 and reached.status is Status.SPIKE and "loss spike" in reached.reason


def test_gradscaler_early_skips_are_not_failures():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g) * 4, torch.randn(8, 1, generator=g) * 4) for _ in range(12)]
    t = Target(model=model, loss_fn=lambda m, b: F.mse_loss(m(b[0]).float(), b[1]), batches=batches,
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-5), precision="fp16", grad_scaler=True)
    # the initial scale 65536 makes early scaled backwards overflow fp16: GradScaler skips and backs off
    reached = reach(t, at=11, precision=Precision.FP16, cfg=CFG, where="t")
    skipped = [h.step for h in reached.history if h.skipped]
    assert len(skipped) >= 2, "the scenario must include GradScaler skips"
    assert reached.status is Status.FINITE and reached.reason is None


def _scaler_target(scale: float, steps: int = 30) -> Target:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g) * scale, torch.randn(8, 1, generator=g) * scale) for _ in range(steps)]
    return Target(model=model, loss_fn=lambda m, b: F.mse_loss(m(b[0]).float(), b[1]), batches=batches,
                  optimizer=torch.optim.SGD(model.parameters(), lr=1e-5), precision="fp16", grad_scaler=True)


def test_gradscaler_warm_up_with_many_skips_is_healthy():
    # the scale backs off from 65536 to 64 over 10 skips in a row (more than the old limit of 8), then
    # training goes on with one more skip at 64: the scaler's warm-up, not a storm
    with pytest.raises(NoBadStep) as info:
        reach(_scaler_target(30.0, steps=14), at=None, precision=Precision.FP16, cfg=CFG, where="t")
    skipped = [h.step for h in info.value.history if h.skipped]
    assert skipped == [*range(10), 12] and info.value.history[-1].scale == 32.0


def test_gradscaler_skip_storm_is_a_failure():
    # gradients beyond fp16 even unscaled: the scale falls below 1 and the scaler still skips
    reached = reach(_scaler_target(1000.0), at=None, precision=Precision.FP16, cfg=CFG, where="t")
    assert reached.status is Status.NONFINITE
    assert reached.reason.startswith("GradScaler skip storm: step skipped at loss scale 0.5 (< 1)")
    assert reached.step == 17 and all(h.skipped for h in reached.history)


def test_python_random_is_restored():
    t = make()
    reached = reach(t, at=2, precision=Precision.FP32, cfg=CFG, where="t")
    random.random()
    reached.restore()
    state = random.getstate()
    reached.restore()
    assert random.getstate() == state
    assert not math.isnan(reached.record.loss)


def test_state_already_nonfinite_is_explained_not_left_blank():
    from nanprobe.pipeline.diagnose import diagnose_target
    from nanprobe.reach.entry import Loaded

    t = make()

    def load_state(step):  # a checkpoint whose weights are already NaN
        with torch.no_grad():
            t.model.out.weight[0, 0] = float("nan")
        return step

    t.load_state = load_state
    report = diagnose_target(Loaded(target=t, entry="t", module="t", function="t", path=None, lineno=None), at=2)
    assert report.status is Status.NONFINITE and report.origin is None
    top = report.top
    assert top is not None and top.cause.value == "lr_spike" and top.module == "out"
    assert "already non-finite before step 2" in top.evidence[0]
