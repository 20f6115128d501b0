"""nanprobe.Guard in a user's loop: skip exactly the bad step, keep the weights, write a capsule, go on."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import asset
from nanprobe.capsule import list_capsules, read
from nanprobe.reach.entry import load_target
from nanprobe.base.errors import ConfigError, UsageError
from nanprobe.base.report import Status, StepRecord
from nanprobe.live.guard import Guard, GuardTripped

ENTRY = asset("guard_nan.py")
ASSETS_WATCH = Path(__file__).resolve().parents[1] / "assets" / "watch"
BAD = 4


def _state(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def train(t, guard, *, scheduler=True, before=None):
    """The README loop; returns the applied flags. ``before`` collects the pre-step state per step."""
    model, opt, sched = t["model"], t["optimizer"], t.get("scheduler")
    applied = []
    for step, batch in enumerate(t["batches"]):
        if before is not None:
            before.append(_state(model, opt))
        with guard.step(batch):
            opt.zero_grad(set_to_none=True)
            loss = t["loss_fn"](model, batch)
            guard.backward(loss)
        ok = guard.optimizer_step(max_grad_norm=t.get("max_grad_norm"))
        applied.append(ok)
        if ok and scheduler and sched is not None:
            sched.step()
    return applied


def test_nan_step_is_skipped_weights_kept_capsule_written_and_training_goes_on(tmp_path, caplog):
    t = load_target(ENTRY + ":target").target
    t = {"model": t.model, "optimizer": t.optimizer, "scheduler": t.scheduler, "batches": t.batches,
         "loss_fn": t.loss_fn}
    guard = Guard(t["model"], t["optimizer"], scheduler=t["scheduler"], entry=ENTRY + ":target",
                  capsule_dir=tmp_path)
    before: list = []
    with caplog.at_level(logging.WARNING, logger="nanprobe.guard"):
        applied = train(t, guard, before=before)
    assert applied == [i != BAD for i in range(10)]
    # the skipped step left weights, BatchNorm buffers and optimizer state exactly as before it
    after_bad = before[BAD + 1]
    assert _equal(before[BAD][0], after_bad[0]) and _equal(before[BAD][1], after_bad[1])
    # every other step changed the weights, and training ended finite
    assert not _equal(before[BAD - 1][0], before[BAD][0])
    assert all(torch.isfinite(p).all() for p in t["model"].parameters())
    # the scheduler was not stepped on the skipped step: 9 applied steps
    assert t["scheduler"].last_epoch == 9
    # one event, one capsule, one log line with the exact command
    assert [(e.step, e.status, e.reason, e.action) for e in guard.events] == [(BAD, "nonfinite", "loss is nan",
                                                                              "skipped")]
    files = list_capsules(tmp_path)
    assert len(files) == 1 and files[0].name.startswith(f"step{BAD:07d}-rank0-")
    assert guard.events[0].capsule == str(files[0])
    lines = [r.getMessage() for r in caplog.records if r.name == "nanprobe.guard"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert f"step {BAD} update skipped: loss is nan" in lines[0]
    assert lines[0].endswith(f"Replay it: nanprobe run {ENTRY}:target --capsule {files[0]}")


def test_capsule_holds_the_state_before_the_step(tmp_path):
    t = load_target(ENTRY + ":dict_batches").target
    guard = Guard(t.model, t.optimizer, scheduler=t.scheduler, capsule_dir=tmp_path)
    before: list = []
    train({"model": t.model, "optimizer": t.optimizer, "scheduler": t.scheduler, "batches": t.batches,
           "loss_fn": t.loss_fn}, guard, before=before)
    data = torch.load(guard.capsules[0], weights_only=True)   # loads without trusting the file
    assert data["step"] == BAD and data["precision"] == "fp32" and data["status"] == "nonfinite"
    assert _equal(dict(data["model"]), before[BAD][0])
    assert data["optimizers"][0]["state"].keys() == before[BAD][1]["state"].keys()
    assert _equal(data["optimizers"][0]["state"], before[BAD][1]["state"])
    assert [h["step"] for h in data["history"]] == [0, 1, 2, 3]
    assert data["fingerprint"][0] == ["fc1.weight", [16, 4]]
    cap = read(guard.capsules[0])
    assert cap.step == BAD and cap.reason == "loss is nan"


def test_policy_raise_stops_with_weights_untouched(tmp_path):
    t = load_target(ENTRY + ":target").target
    guard = Guard(t.model, t.optimizer, capsule_dir=tmp_path, policy="raise", entry="train.py:target")
    before: list = []
    with pytest.raises(GuardTripped) as info:
        train({"model": t.model, "optimizer": t.optimizer, "batches": t.batches, "loss_fn": t.loss_fn}, guard,
              before=before)
    assert info.value.event.step == BAD and info.value.event.action == "raised"
    assert "--capsule" in info.value.message and "policy 'raise'" in info.value.message
    assert len(before) == BAD + 1 and _equal(before[BAD][0], t.model.state_dict())
    assert len(list_capsules(tmp_path)) == 1


def test_policy_record_applies_the_update_and_still_writes_a_capsule(tmp_path):
    t = load_target(ENTRY + ":target").target
    guard = Guard(t.model, t.optimizer, capsule_dir=tmp_path, policy="record")
    flags = train({"model": t.model, "optimizer": t.optimizer, "batches": t.batches[:BAD + 1],
                   "loss_fn": t.loss_fn}, guard)
    assert flags == [True] * (BAD + 1)
    assert guard.events[0].action == "recorded"
    assert not all(torch.isfinite(p).all() for p in t.model.parameters())   # what happens without the guard
    assert len(list_capsules(tmp_path)) == 1


def _tiny(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _batches(n, nan_at=(), scale_at=None, scale=1.0):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        x = torch.randn(8, 4, generator=g)
        if i in nan_at:
            x[0, 0] = float("nan")
        out.append((x, torch.randint(0, 3, (8,), generator=g), scale if i == scale_at else 1.0))
    return out


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1]) * batch[2]


def test_too_many_consecutive_skips_raise(tmp_path):
    model, opt = _tiny()
    guard = Guard(model, opt, capsule_dir=tmp_path, config={"max_consecutive_skips": 3, "max_capsules": 2})
    data = {"model": model, "optimizer": opt, "batches": _batches(10, nan_at=range(2, 10)), "loss_fn": _loss}
    with pytest.raises(GuardTripped) as info:
        train(data, guard)
    assert [e.step for e in guard.events] == [2, 3, 4]
    assert [e.action for e in guard.events] == ["skipped", "skipped", "raised"]
    assert "3 bad steps in a row" in info.value.message
    # max_capsules=2 keeps the first bad step's capsule and the newest
    assert [p.name[:11] for p in list_capsules(tmp_path)] == ["step0000002", "step0000004"]


def test_loss_spike_is_skipped(tmp_path):
    model, opt = _tiny()
    guard = Guard(model, opt, capsule_dir=tmp_path, config={"min_history": 5, "loss_spike_factor": 10.0})
    data = {"model": model, "optimizer": opt, "batches": _batches(12, scale_at=8, scale=1000.0), "loss_fn": _loss}
    flags = train(data, guard)
    assert flags == [i != 8 for i in range(12)]
    (event,) = guard.events
    assert event.status == "spike" and event.reason.startswith("loss spike:") and "running median" in event.reason
    assert read(event.capsule).status.value == "spike"


def test_fp16_grad_scaler_early_skips_are_not_failures(tmp_path, caplog):
    model, opt = _tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)   # overflows until it backs off
    guard = Guard(model, opt, scaler=scaler, precision="fp16", capsule_dir=tmp_path,
                  config={"max_scaler_skips": 40})
    w0 = copy.deepcopy(model.state_dict())
    flags = []
    with caplog.at_level(logging.WARNING, logger="nanprobe.guard"):
        for batch in _batches(30):
            with guard.step(batch):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = _loss(model, batch)
                guard.backward(loss)
            flags.append(guard.optimizer_step())
    assert flags[:10] == [False] * 10 and sum(flags) >= 5   # the scaler's normal back-off, then training
    assert scaler.get_scale() <= 2.0 ** 40 / 2 ** 10
    assert guard.events == [] and list_capsules(tmp_path) == []
    assert not [r for r in caplog.records if r.name == "nanprobe.guard"]
    assert not _equal(w0, model.state_dict())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_nan_loss_with_scaler_keeps_the_scale(tmp_path):
    model, opt = _tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    guard = Guard(model, opt, scaler=scaler, precision="fp16", capsule_dir=tmp_path)
    scales = []
    for batch in _batches(6, nan_at={3}):
        with guard.step(batch):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(model, batch)
            guard.backward(loss)
        guard.optimizer_step(max_grad_norm=1.0)
        scales.append(scaler.get_scale())
    assert [e.step for e in guard.events] == [3]
    assert scales[3] == scales[2]              # the guard's skip leaves the GradScaler alone
    cap = torch.load(guard.capsules[0], weights_only=True)
    assert cap["grad_scaler"] is True and cap["scalers"][0]["scale"] == scales[2] and cap["max_grad_norm"] == 1.0


def test_too_many_scaler_skips_are_a_failure(tmp_path):
    model, opt = _tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    guard = Guard(model, opt, scaler=scaler, precision="fp16", capsule_dir=tmp_path, config={"max_scaler_skips": 2})
    for batch in _batches(3):
        with guard.step(batch):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(model, batch)
            guard.backward(loss)
        guard.optimizer_step()
    (event,) = guard.events
    assert event.step == 2 and event.reason.startswith("GradScaler skipped 3 steps in a row")


def test_update_that_corrupts_weights_is_named_at_the_next_check(tmp_path):
    """check_every=2: a NaN at an unchecked step gets applied; the next check sees non-finite weights."""
    model, opt = _tiny()
    guard = Guard(model, opt, capsule_dir=tmp_path, check_every=2)
    data = {"model": model, "optimizer": opt, "batches": _batches(6, nan_at={3}), "loss_fn": _loss}
    with pytest.raises(GuardTripped) as info:
        train(data, guard)
    event = info.value.event
    assert event.step == 4 and "weights were already non-finite" in event.reason
    assert event.capsule is None and event.command.endswith("--at 3")
    assert "the weights are non-finite" in info.value.message


def test_step_number_forms_and_no_context(tmp_path):
    model, opt = _tiny()
    guard = Guard(model, opt, capsule_dir=tmp_path, start_step=100)
    batches = _batches(3, nan_at={1})
    with guard.step(batches[0]) as n:
        _loss(model, batches[0]).backward()     # plain backward (the fix snippet's form) also works
    assert n == 100 and guard.optimizer_step() and guard.step_index == 101
    with guard.step(7, batches[1]) as n:
        guard.backward(_loss(model, batches[1]))
    assert n == 7 and not guard.optimizer_step()
    assert read(guard.capsules[0]).step == 7
    # without guard.step: the gradient norm is still checked; the capsule says it has no batch
    opt.zero_grad()
    _loss(model, batches[1]).backward()
    assert guard.optimizer_step() is False and guard.events[-1].step == 8
    assert guard.events[-1].reason == "gradient norm is nan"
    assert torch.load(guard.capsules[-1], weights_only=True)["batch_missing"] is True


def test_disabled_guard_is_the_plain_loop(tmp_path):
    model, opt = _tiny()
    guard = Guard(model, opt, capsule_dir=tmp_path, enabled=False)
    flags = train({"model": model, "optimizer": opt, "batches": _batches(3, nan_at={1}), "loss_fn": _loss}, guard)
    assert flags == [True, True, True] and guard.events == []
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    assert not tmp_path.exists() or list_capsules(tmp_path) == []


def test_state_dict_round_trip(tmp_path):
    model, opt = _tiny()
    guard = Guard(model, opt, capsule_dir=tmp_path, config={"min_history": 3})
    train({"model": model, "optimizer": opt, "batches": _batches(6, nan_at={2}), "loss_fn": _loss}, guard)
    state = guard.state_dict()
    path = tmp_path / "guard.pt"
    torch.save(state, path)
    restored = Guard(model, opt, capsule_dir=tmp_path, config={"min_history": 3})
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert repr(restored.state_dict()) == repr(state)   # (the history holds a NaN loss)
    assert restored.step_index == 6 and guard.step_index == 6
    # the spike statistics came back too: both guards judge the same loss the same way
    median = sorted(state["losses"])[len(state["losses"]) // 2]

    def verdict(g, loss):
        return g.core.judge.judge(StepRecord(step=6, loss=loss, grad_norm=None, lr=None, update_ratio=None,
                                             finite=True), True)
    assert verdict(guard, median * 1000) == verdict(restored, median * 1000)
    assert verdict(restored, median * 1000)[0] is Status.SPIKE
    assert verdict(restored, median) == (Status.FINITE, None)


def test_bad_arguments_are_usage_errors(tmp_path):
    model, opt = _tiny()
    with pytest.raises(ConfigError, match="guard.policy must be one of"):
        Guard(model, opt, policy="explode")
    with pytest.raises(UsageError, match="check_every"):
        Guard(model, opt, check_every=0)
    with pytest.raises(UsageError, match="not a precision"):
        Guard(model, opt, precision="fp8")
    with pytest.raises(UsageError, match="torch.nn.Module"):
        Guard("model", opt)
    with pytest.raises(TypeError):
        Guard(model, opt).step(1, 2, 3)


@pytest.mark.parametrize("uses_host_rng", [False, True])
def test_capsule_rng_is_the_state_at_step_start(tmp_path, uses_host_rng):
    """rng_states auto: Python/numpy RNG copied per step only when a probe saw the step draw from them;
    either way the capsule holds the states at the start of the bad step."""
    import random

    import numpy as np

    model, opt = _tiny()
    guard = Guard(model, opt, capsule_dir=tmp_path)

    def loss_fn(m, b):
        if uses_host_rng:
            _ = random.random() + np.random.rand()    # e.g. a stochastic-depth coin flip
        return _loss(m, b)

    starts = {}
    for step, batch in enumerate(_batches(7, nan_at={6})):
        random.random()
        np.random.rand()                              # the data pipeline draws between steps
        starts[step] = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
        with guard.step(batch):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss_fn(model, batch))
        guard.optimizer_step()
    assert guard.core.rngs.host_used is uses_host_rng
    rng = torch.load(guard.capsules[0], weights_only=True)["rng"]
    torch_state, py_state, np_keys = starts[6]
    assert torch.equal(rng["torch"], torch_state)
    assert rng["python"][1] == list(py_state[1]) and rng["numpy"][1] == np_keys


def test_clipping_with_two_param_groups_is_bitwise_the_users_own(tmp_path):
    """Param groups listed in another order than model.parameters(): the Guard's global norm sums the
    gradients in the user's order (clip_grad_norm_(model.parameters())), so the weights stay bitwise equal."""
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
        opt = torch.optim.SGD([{"params": m[4].parameters(), "lr": 0.05},
                               {"params": [*m[0].parameters(), *m[2].parameters()], "lr": 0.1}])
        return m, opt
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g) * 10, torch.randint(0, 3, (16,), generator=g)) for _ in range(20)]
    plain, plain_opt = make()
    clipped = 0
    for x, y in data:
        plain_opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        clipped += float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)) > 0.5
        plain_opt.step()
    assert clipped >= 10   # the clipping really acts
    model, opt = make()
    guard = Guard(model, opt, capsule_dir=tmp_path)
    for x, y in data:
        with guard.step((x, y)):
            opt.zero_grad()
            guard.backward(F.cross_entropy(model(x), y))
        assert guard.optimizer_step(max_grad_norm=0.5)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))


def _lbfgs_run(guard_dir, nan_at=()):
    """LBFGS (its step() evaluates the closure several times): the plain loop, or the guarded one."""
    model, _ = _tiny()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    guard = Guard(model, opt, capsule_dir=guard_dir) if guard_dir else None
    applied = []
    for batch in _batches(6, nan_at=nan_at):
        def closure(batch=batch):
            opt.zero_grad()
            loss = _loss(model, batch)
            loss.backward()
            return loss
        if guard is None:
            opt.step(closure)
            continue
        with guard.step(batch):
            applied.append(guard.optimizer_step(closure=closure))
    return model, guard, applied


def test_closure_optimizer_healthy_is_the_plain_loop_and_a_bad_first_evaluation_is_skipped(tmp_path):
    plain, _, _ = _lbfgs_run(None)
    guarded, guard, applied = _lbfgs_run(tmp_path)
    assert applied == [True] * 6 and guard.events == []
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), guarded.state_dict().values()))
    model, guard, applied = _lbfgs_run(tmp_path, nan_at={3})
    assert applied == [True, True, True, False, True, True]
    assert [(e.step, e.reason, e.action) for e in guard.events] == [(3, "loss is nan", "skipped")]
    assert all(torch.isfinite(p).all() for p in model.parameters()) and read(guard.events[0].capsule).step == 3
    with pytest.raises(UsageError, match=r"LBFGS.step\(\) needs a closure"):
        guard.optimizer_step()


def test_the_model_and_optimizer_copy_and_save_as_usual_under_a_guard(tmp_path):
    import io
    import pickle

    from torch.optim.swa_utils import AveragedModel

    model, opt = _tiny()
    guard = Guard(model, opt, capsule_dir=tmp_path)
    averaged = AveragedModel(model)
    for batch in _batches(3):
        with guard.step(batch):
            opt.zero_grad()
            guard.backward(_loss(model, batch))
        guard.optimizer_step()
        averaged.update_parameters(copy.deepcopy(model))
        torch.save(model, io.BytesIO())
        pickle.loads(pickle.dumps((model, opt)))
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert guard.events == []


@pytest.mark.parametrize("flag", [{}, {"foreach": True}, {"fused": True}], ids=["for-loop", "foreach", "fused"])
def test_an_update_that_makes_weights_non_finite_is_named_at_its_own_step(tmp_path, flag):
    """AdamW eps=0: rows of an embedding first used at step 6 whose gradient is 0 get 0/0 from the update
    of step 6 (its loss and gradients are finite). The guard names step 6, the parameter, LR and eps."""
    import runpy
    import sys

    sys.path.insert(0, str(ASSETS_WATCH))
    Net = runpy.run_path(str(ASSETS_WATCH / "eps_zero.py"))["Net"]
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0, **flag)
    guard = Guard(model, opt, capsule_dir=tmp_path)
    with pytest.raises(GuardTripped) as info:
        for step in range(10):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            with guard.step((x, y)):
                opt.zero_grad()
                guard.backward(((model(x, torch.tensor([0, 1, 2, 0]).repeat(2) if step >= 6 else None) - y) ** 2)
                               .mean())
            guard.optimizer_step()
            assert step < 6 or not all(torch.isfinite(p).all() for p in model.parameters())   # the oracle
    event = info.value.event
    assert (event.step, event.action, event.command) == (6, "raised", "nanprobe run ENTRY --at 6")
    assert event.reason.startswith("the AdamW update of step 6 made the weights non-finite: ")
    assert "of kind.weight (lr=0.01, eps=0); its Adam second moment has" in event.reason


class _Spare(nn.Module):
    """A linear layer and a spare weight its forward never lets through (``torch.where`` picks the other
    branch, so an infinite spare changes neither the loss nor any gradient): only reading the weights
    sees it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.spare = nn.Parameter(torch.ones(8, 1))

    def forward(self, x):
        y = self.lin(x)
        return torch.where(torch.zeros_like(y, dtype=torch.bool), self.spare, y)


@pytest.mark.parametrize("every", [1, 4])
def test_weights_are_read_every_k_updates_and_a_late_read_names_the_range(tmp_path, every):
    """SGD (an update nanprobe can bound) with guard.check_updates_every=k: the spare weight's group gets
    lr=1e38 at step 5 (weight decay 10 sends it to -inf; the loss stays finite). Read after every update it
    is named at step 5; read every 4th update (steps 0, 4, 8), at step 8 with the range 5-8."""
    from nanprobe.base.config import Config, GuardConfig

    torch.manual_seed(0)
    model = _Spare()
    opt = torch.optim.SGD([{"params": model.lin.parameters()},
                           {"params": [model.spare], "weight_decay": 10.0}], lr=1e-2)
    guard = Guard(model, opt, config=Config(guard=GuardConfig(check_updates_every=every,
                                                              capsule_dir=str(tmp_path))))
    with pytest.raises(GuardTripped) as info:
        for step in range(12):
            if step == 5:
                opt.param_groups[1]["lr"] = 1e38
            x = torch.randn(8, 4)
            with guard.step(x):
                opt.zero_grad()
                loss = ((model(x) - 1) ** 2).mean()
                guard.backward(loss)
                assert torch.isfinite(loss)
            guard.optimizer_step()
    event = info.value.event
    named = 5 if every == 1 else 8
    assert event.step == named and event.command == f"nanprobe run ENTRY --at {named}"
    assert event.reason.startswith(f"the SGD update of step {named} made the weights non-finite: ")
    assert "of spare (lr=1e+38" in event.reason
    assert ("one of the updates of steps 5-8 made them non-finite" in event.reason) == (every == 4)


def test_an_update_a_forward_then_uses_is_named_at_its_step_between_reads(tmp_path):
    """Weights read every 10 updates (after steps 0, 10, ...), an LR of 1e38 with weight decay 100 at
    step 6 only: step 7's loss is non-finite, that bad step reads the weights, and the update of step 6
    is named (not step 7's data), with the range of updates not read since step 0's."""
    from nanprobe.base.config import Config, GuardConfig

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = Guard(model, opt, config=Config(guard=GuardConfig(check_updates_every=10, capsule_dir=str(tmp_path))))
    with pytest.raises(GuardTripped) as info:
        for step in range(10):
            opt.param_groups[0]["lr"] = 1e38 if step == 6 else 1e-2
            opt.param_groups[0]["weight_decay"] = 100.0 if step == 6 else 0.0
            x = torch.randn(8, 4)
            with guard.step(x):
                opt.zero_grad()
                guard.backward(((model(x) - 1) ** 2).mean())
            guard.optimizer_step()
    event = info.value.event
    assert event.step == 6 and event.reason.startswith("the SGD update of step 6 made the weights non-finite: ")
    assert "one of the updates of steps 1-6 made them non-finite; this report names the last, step 6" in event.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_weights_whose_squares_overflow_are_finite(tmp_path, dtype):
    """An embedding with a finite "never used" sentinel row at the dtype's edge (1e38; fp16: 6e4): its sum of
    squares overflows, the weights do not. Read after every update, they never stop the run."""
    from nanprobe.base.config import Config, GuardConfig

    torch.manual_seed(0)
    edge = 1e38 if dtype != torch.float16 else 6e4
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 1)).to(dtype)
    with torch.no_grad():
        model[0].weight[9] = edge
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, config=Config(guard=GuardConfig(check_updates_every=1, capsule_dir=str(tmp_path))))
    for step in range(6):
        x = torch.randint(0, 9, (16, 2))
        with guard.step(x):
            opt.zero_grad()
            guard.backward(((model(x).float() - 1) ** 2).mean())
        assert guard.optimizer_step(), step
    assert float(model[0].weight[9, 0].detach()) == pytest.approx(edge, rel=1e-2) and not list(tmp_path.iterdir())


def test_the_live_monitor_measures_the_update_applied_between_checks(tmp_path):
    """A live step is closed at its check, before its update: the update of the step before a monitored one is
    measured at the monitored check (|dw|/|w| and its cosine with -grad, which only explains a flagged step: one
    gradient against Adam's momentum is no precursor live), and the record of that step gets its |dw|/|w|."""
    model, opt = _tiny()
    guard = Guard(model, opt, capsule_dir=tmp_path)
    train({"model": model, "optimizer": opt, "batches": _batches(25), "loss_fn": _loss}, guard)
    series = guard.monitor.trend.series
    assert [s for s, _ in series["update/ratio"]] == [10, 20] == [s for s, _ in series["update/cosine"]]
    assert all(0 < r < 0.5 for _, r in series["update/ratio"])
    measured = {h.step: h.update_ratio for h in guard.core.history if h.update_ratio is not None}
    assert set(measured) <= {9, 19} and 19 in measured


def test_a_yaml_config_file_sets_the_guards_monitor_too(tmp_path):
    """Guard(config="file.yaml") read the guard section of the file but took the monitor's from the defaults."""
    path = tmp_path / "nanprobe.yaml"
    path.write_text("guard:\n  check_every: 1\nmonitor:\n  live_every: 3\n")
    model, opt = _tiny()
    guard = Guard(model, opt, config=str(path), capsule_dir=tmp_path)
    assert guard.monitor is not None and guard.monitor.every == 3
