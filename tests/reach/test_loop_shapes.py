"""Replay fidelity on real loop shapes: the state nanprobe reaches before step N is bitwise the plain
loop's (shuffled DataLoader with workers over epochs, a submodule in eval mode, fp16 + GradScaler
with skips and a scheduler, accumulation, a two-optimizer GAN step_fn, an RNN carrying its hidden
state); a planted NaN is found at the plain loop's step with the right sample; a loss that raises
on a NaN is a data finding; a rerun that cannot reproduce the replayed step says so; capsules from
accumulation and step_fn loops replay exactly the step ``--at k`` diagnoses."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from conftest import asset
from nanprobe import diagnose
from nanprobe.capsule import list_capsules
from nanprobe.surface.cli import app
from nanprobe.base.config import load_config
from nanprobe.pipeline.diagnose import diagnose_target
from nanprobe.reach.entry import load_target
from nanprobe.live.guard import Guard
from nanprobe.base.precision import Precision
from nanprobe.reach.replay import reach
from nanprobe.pipeline.smoke import smoke
from nanprobe.reach.target import named, validate

LOOPS = asset("loops.py")
CFG = load_config()


def _module():
    spec = importlib.util.spec_from_file_location("loops_plain", LOOPS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _state(target) -> dict[str, torch.Tensor]:
    """Everything a step reads besides its batch, flattened into named tensors."""
    get = (lambda k: target[k]) if isinstance(target, dict) else (lambda k: getattr(target, k))
    model = get("model")
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    out["flags"] = torch.tensor([m.training for m in model.modules()])
    for name, opt in named(get("optimizer"), "optimizer"):
        for i, s in opt.state_dict()["state"].items():
            for k, v in s.items():
                out[f"{name}.{i}.{k}"] = torch.as_tensor(v)
        out[f"{name}.lr"] = torch.tensor([g["lr"] for g in opt.param_groups])
    sched = get("scheduler") if (isinstance(target, dict) and "scheduler" in target) or \
        (not isinstance(target, dict) and target.scheduler is not None) else None
    if sched is not None:
        out["scheduler.last_epoch"] = torch.tensor(sched.last_epoch)
    return out


def _assert_equal(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), k


SHAPES = [("shuffled", 23), ("frozen_bn", 11), ("fp16_scaler", 14), ("accumulate", 4), ("gan", 9), ("rnn", 7)]


@pytest.mark.parametrize("name, at", SHAPES, ids=[s[0] for s in SHAPES])
def test_state_before_step_n_is_bitwise_the_plain_loops(name, at):
    mod = _module()
    ref = mod.TARGETS[name]({})
    extra = mod.PLAIN[name](ref, at)
    ref_rng = torch.get_rng_state()    # the plain loop stopped right after fetching step N's first batch
    loaded = load_target(f"{LOOPS}:{name}")
    t = loaded.target
    reached = reach(t, at=at, precision=t.precision, cfg=CFG.replay, where="t")
    assert reached.step == at and reached.record is not None and math.isfinite(reached.record.loss)
    _assert_equal(_state(t), _state(ref))
    assert torch.equal(reached.recorded.rng_after[0]["torch"], ref_rng)
    if name == "fp16_scaler":
        assert extra["skips"] >= 2, "the scenario must include GradScaler skips"
        assert reached.loop.scaler.get_scale() == extra["scale"]
        assert t.scheduler.last_epoch == at     # stepped on skipped steps too, as PyTorch's AMP recipe does
    if name == "rnn":
        assert torch.equal(t.step_fn.hidden(), ref["step_fn"].hidden())
    if name == "frozen_bn":
        assert t.model.encoder[1].training is False and t.model.training is True


# where the NaN is planted (dataset index, or (step, row) for list batches) for each shape
NANS = [("shuffled", 37), ("frozen_bn", 5), ("fp16_scaler", 11 * 8 + 3), ("accumulate", 26), ("gan", 20),
        ("rnn", (5, 2)), ("hand_lr", 30)]


def _first_bad(mod, name, nan_at):
    """Run the plain loop and note the first step whose batch holds the planted NaN: (step, micro, row)."""
    found = []

    def watch(step, micro, batch):
        if found:
            return
        if isinstance(batch, dict):
            rows = (batch["index"] == nan_at).nonzero().flatten().tolist()
            if rows:
                found.append((step, micro, rows[0]))
        elif isinstance(nan_at, tuple):
            if step == nan_at[0]:
                found.append((step, micro, nan_at[1]))
        else:
            s, row = divmod(nan_at, 8)
            if step == s:
                found.append((step, micro, row))

    if name == "hand_lr":   # its plain loop is the step_fn with micro-batches; the step is where the NaN batch lands
        ref = mod.hand_lr({"nan_at": nan_at})
        loader = ref["batches"]
        for i, batch in enumerate(loader):
            watch(i // 2, i % 2, batch)
        return found[0]
    ref = mod.TARGETS[name]({"nan_at": nan_at})
    mod.PLAIN[name](ref, 40, watch)
    return found[0]


@pytest.mark.parametrize("name, nan_at", NANS, ids=[n[0] for n in NANS])
def test_planted_nan_is_found_at_the_plain_loops_step_with_the_right_sample(name, nan_at):
    step, micro, row = _first_bad(_module(), name, nan_at)
    loaded = load_target(f"{LOOPS}:{name}", config={"nan_at": nan_at})
    report = diagnose_target(loaded, config=CFG)
    assert report.exit_code == 1 and report.step == step, (report.step, step, report.notes)
    top = report.top
    assert top.cause.value == "data" and top.phase.value == "input", [f.to_json() for f in report.findings]
    problem = report.extra["data_problems"][0]
    assert problem["code"] == "nonfinite" and problem["samples"] == [row]
    if loaded.target.accumulate > 1:
        assert problem["micro"] == micro
    assert report.fidelity.reproduced is True


def test_a_nan_that_makes_the_loss_raise_is_a_data_finding_with_exit_1(tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["run", f"{LOOPS}:bce_raises_nan", "--json", str(out)])
    assert result.exit_code == 1, result.output
    data = json.loads(out.read_text())
    assert data["findings"][0]["cause"] == "data" and "raised" in data["error"]
    problem = data["data_problems"][0]
    assert problem["code"] == "nonfinite" and problem["key"] == "batch['x']"
    mod = _module()
    step, _, row = _first_bad_plain_loss(mod, 13)
    assert data["step"] == step and problem["samples"] == [row]
    assert data["fidelity"]["reproduced"] is True


def _first_bad_plain_loss(mod, nan_at):
    ref = mod.bce_raises({"nan_at": nan_at})
    found = []

    def watch(step, micro, batch):
        rows = (batch["index"] == nan_at).nonzero().flatten().tolist()
        if rows and not found:
            found.append((step, micro, rows[0]))
    try:
        mod.plain_shuffled(dict(ref, scheduler=mod._NoSched(), max_grad_norm=1e9, epochs=1), 40, watch)
    except (RuntimeError, ValueError):
        pass   # the plain loop dies there, as the user's did
    return found[0]


def test_a_label_out_of_range_that_raises_is_a_data_finding():
    report = diagnose(f"{LOOPS}:shuffled_bad_label")
    assert report.exit_code == 1
    top = report.top
    assert top.cause.value == "data"
    codes = {p["code"] for p in report.extra["data_problems"]}
    assert "label_out_of_range" in codes
    assert "is not a class" in top.fixes[0].title          # not "clean NaNs": there are none
    assert all(f.cause.value != "lr_spike" or f.confidence < 0.3 for f in report.findings)


def test_a_plain_bug_at_step_0_stays_exit_2_with_the_users_line(tmp_path):
    script = tmp_path / "bug.py"
    script.write_text("import torch\n\ndef target():\n    m = torch.nn.Linear(2, 1)\n"
                      "    return {'model': m, 'loss_fn': lambda m, b: m(b).sum() + undefined_name,\n"
                      "            'batches': [torch.ones(3, 2)] * 3}\n")
    result = CliRunner().invoke(app, ["run", f"{script}:target"])
    assert result.exit_code == 2 and "NameError" in result.output and "bug.py:5" in result.output
    assert "Traceback" not in result.output


def test_a_step_that_keeps_state_where_nanprobe_cannot_see_it_is_reported():
    report = diagnose(f"{LOOPS}:rnn_global_state", at=6)
    fid = report.fidelity
    assert fid.reproduced is False and fid.tolerance == "bitwise"
    assert any("carries state between calls" in r for r in fid.reasons)
    assert any("does not reproduce" in n for n in report.notes)
    data = report.to_json()["fidelity"]
    assert data["reproduced"] is False and data["reruns"][0]["match"] is False


def test_the_same_rnn_with_its_state_in_a_closure_reproduces():
    report = diagnose(f"{LOOPS}:rnn", at=6)
    assert report.status.value == "finite" and report.fidelity.reproduced is True


def _key(report):
    top = report.top
    return (report.step, report.status.value, top.cause.value, top.phase.value, top.module,
            report.origin.op if report.origin else None, report.extra["data_problems"][0]["samples"]
            if report.extra["data_problems"] else None)


def test_guard_capsule_under_accumulation_replays_the_step_at_k(tmp_path, monkeypatch):
    nan_at = 26
    entry = f"{LOOPS}:accumulate_nan"
    t = load_target(entry).target
    mod_k = t.accumulate
    guard = Guard(t.model, t.optimizer, entry=entry, capsule_dir=tmp_path / "caps")
    for _ in range(t.epochs):
        n = len(t.batches)
        for i, batch in enumerate(t.batches):
            if i % mod_k == 0:
                t.optimizer.zero_grad(set_to_none=True)
            with guard.step(batch):
                guard.backward(t.loss_fn(t.model, batch))
            if (i + 1) % mod_k == 0 or i + 1 == n:
                guard.optimizer_step(max_grad_norm=t.max_grad_norm)
    capsule = list_capsules(tmp_path / "caps")[0]    # the NaN item comes back every epoch: the first capsule
    data = torch.load(capsule, weights_only=True)
    assert len(data["micro_batches"]) in (2, 4) and len(data["micro_rng"]) == len(data["micro_batches"])
    from_capsule = diagnose(entry, capsule=str(capsule))
    monkeypatch.chdir(tmp_path)
    by_replay = diagnose(entry, at=from_capsule.step)
    assert _key(from_capsule) == _key(by_replay)
    assert from_capsule.top.cause.value == "data"
    assert from_capsule.extra["data_problems"][0].get("micro") == by_replay.extra["data_problems"][0].get("micro")
    assert from_capsule.fidelity.reproduced is True and by_replay.fidelity.reproduced is True
    step, micro, row = _first_bad(_module(), "accumulate", nan_at)
    assert from_capsule.step == step and from_capsule.extra["data_problems"][0]["samples"] == [row]


def test_guard_capsule_of_a_step_fn_loop_replays_the_step_at_k(tmp_path, monkeypatch):
    """The user's guarded loop does by hand what the entrypoint's step_fn does (hand-set LR, micro-batches)."""
    import sys

    entry = f"{LOOPS}:hand_lr_nan"
    t = load_target(entry).target
    users = sys.modules[t.step_fn.__module__]
    guard = Guard(t.model, t.optimizer, entry=entry, capsule_dir=tmp_path / "caps")
    step = 0
    for i, batch in enumerate(t.batches):
        if i % 2 == 0:
            for g in t.optimizer.param_groups:
                g["lr"] = t.step_fn.get_lr(step)
        with guard.step(batch):
            guard.backward(users.ce_loss(t.model, batch) / 2)
        if i % 2 == 1:
            guard.optimizer_step(max_grad_norm=1.0)
            t.optimizer.zero_grad(set_to_none=True)
            step += 1
    capsule = list_capsules(tmp_path / "caps")[0]
    from_capsule = diagnose(entry, capsule=str(capsule))
    monkeypatch.chdir(tmp_path)
    by_replay = diagnose(entry, at=from_capsule.step)
    assert _key(from_capsule) == _key(by_replay)
    assert from_capsule.top.cause.value == "data" and from_capsule.fidelity.reproduced is True
    assert from_capsule.step == _first_bad(_module(), "hand_lr", 30)[0]


def test_smoke_capsule_of_a_gan_step_fn_replays_the_step_at_k(tmp_path, monkeypatch):
    entry = f"{LOOPS}:gan_nan"
    result = smoke(entry, steps=20, capsule_dir=tmp_path / "caps")
    assert result.exit_code == 1 and result.capsule
    from_capsule = diagnose(entry, capsule=result.capsule)
    monkeypatch.chdir(tmp_path)
    by_replay = diagnose(entry, at=result.report.step)
    assert _key(from_capsule) == _key(by_replay) == _key(result.report)
    assert from_capsule.fidelity.reproduced is True


def test_smoke_runs_every_epoch_and_fails_when_the_data_ends_first():
    ok = smoke(f"{LOOPS}:frozen_bn", steps=14)     # 8 steps an epoch, 2 epochs
    assert ok.exit_code == 0 and ok.steps_run == 14
    result = CliRunner().invoke(app, ["smoke", f"{LOOPS}:frozen_bn", "--steps", "40"])
    assert result.exit_code == 2 and "data ended after 16 steps (2 epoch(s))" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_report_shows_epoch_and_position_within_the_epoch():
    loaded = load_target(f"{LOOPS}:shuffled", config={"nan_at": 37, "workers": 0})
    report = diagnose_target(loaded, config=CFG)
    pos = report.position
    assert pos["epoch"] == report.step // 10 and pos["index"] == report.step % 10
    assert report.history[-1].epoch == pos["epoch"]


def test_diagnosis_leaves_train_eval_flags_as_returned():
    loaded = load_target(f"{LOOPS}:frozen_bn", config={"nan_at": 5})
    flags = [m.training for m in loaded.target.model.modules()]
    diagnose_target(loaded, config=CFG)
    assert [m.training for m in loaded.target.model.modules()] == flags


def test_validation_draws_nothing_from_the_rng_or_the_loader():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    loaded = load_target(f"{LOOPS}:shuffled", config={"seeded": False, "workers": 0})
    after_build = torch.get_rng_state()
    mod = _module()
    torch.manual_seed(123)
    mod.shuffled({"seeded": False, "workers": 0})
    assert torch.equal(torch.get_rng_state(), after_build) and not torch.equal(before, after_build)
    assert loaded.target.epochs == 3


def test_one_shot_iterator_is_refused_without_being_consumed():
    from nanprobe.base.errors import TargetError
    from nanprobe.reach.target import validate

    items = iter([torch.ones(2)] * 3)
    with pytest.raises(TargetError, match="one-shot iterator"):
        validate({"model": torch.nn.Linear(2, 1), "loss_fn": lambda m, b: m(b).sum(), "batches": items}, "t")
    assert len(list(items)) == 3


def test_precision_rerun_of_a_step_fn_rewrites_its_autocast():
    """A step_fn that trains under torch.autocast(bf16): the fp32 rerun turns its autocast off and
    restores the user's autocast object afterwards."""
    loaded = load_target(f"{LOOPS}:autocast_step", config={"nan_at": None})
    reached = reach(loaded.target, at=2, precision=Precision.BF16, cfg=CFG.replay, where="t")
    from nanprobe.locate.rerun import run_step
    bf16 = run_step(loaded.target, reached, Precision.BF16, where="t", instrument=False)
    fp32 = run_step(loaded.target, reached, Precision.FP32, where="t", instrument=False)
    again = run_step(loaded.target, reached, Precision.BF16, where="t", instrument=False)
    assert bf16.record.loss == again.record.loss == reached.record.loss
    assert fp32.record.loss != bf16.record.loss and fp32.applied
    ctx = loaded.target.step_fn.ctx
    assert ctx.fast_dtype == torch.bfloat16 and ctx._enabled


def test_a_scaled_loss_divided_after_scaling_is_counted_once():
    """``(scaler.scale(loss) / k).backward()`` backpropagates the scaled loss: the loss is what was handed to
    GradScaler.scale, not also loss * scale / k (the replay of a step_fn that returns nothing, and watch, read
    the loss through the same hooks: reach/hooks.py)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    seen = []

    def step_fn(model, batch, step):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        seen.append(loss.item())
        (scaler.scale(loss) / 2).backward()
        scaler.step(opt)
        scaler.update()

    t = validate({"model": model, "step_fn": step_fn, "batches": batches, "optimizer": opt, "grad_scaler": scaler,
                  "precision": "fp16"}, "t")
    reached = reach(t, at=2, precision=t.precision, cfg=load_config().replay, where="t")
    assert [h.loss for h in reached.history] == pytest.approx(seen[:2], rel=1e-6)
