"""The Lightning and transformers callbacks: a real Trainer, only the callback added.

A bad step is skipped, its capsule written, diagnosed in-process (step, cause, phase, source line of
the JSON report) and training goes on; a healthy run writes nothing and ends with the same weights,
bit for bit, as the same run without the callback.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import tb_scalars
from nanprobe.capsule import read

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _framework(name: str):
    """CI installs the extras and sets NANPROBE_INTEGRATION_TESTS=required: a missing framework fails there."""
    if os.environ.get("NANPROBE_INTEGRATION_TESTS") == "required":
        return importlib.import_module(name)
    return pytest.importorskip(name)


def _line(path: str | Path, marker: str) -> int:
    """The 1-based line of ``path`` holding ``marker`` (source lines are asserted, never hard-coded)."""
    lines = Path(path).read_text().splitlines()
    hits = [i + 1 for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def _report(event) -> dict:
    assert event.report is not None, event
    return json.loads(Path(event.report).read_text())


def _equal_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _copy_and_save(model: nn.Module, averaged: list) -> None:
    """What training code does with its model between steps: a best-model snapshot, an AveragedModel
    (SWA/EMA), torch.save of the whole module, a state_dict round trip."""
    import copy
    import io

    from torch.optim.swa_utils import AveragedModel

    copy.deepcopy(model)
    if not averaged:
        averaged.append(AveragedModel(model))
    averaged[0].update_parameters(model)
    torch.save(model, io.BytesIO())
    model.load_state_dict(copy.deepcopy(model.state_dict()))


# -- Lightning ----------------------------------------------------------------------------------------------

L = _framework("lightning")


class Regressor(L.LightningModule):
    """MSE for a warm-up epoch, then a relative-error term: a target of 0 divides by zero."""

    def __init__(self, relative_from_epoch: int | None = 1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.relative_from_epoch = relative_from_epoch
        self.seen: list[tuple[int, int, list[int]]] = []   # (global_step, epoch, sample ids) per training_step

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.seen.append((self.global_step, self.current_epoch, ids.tolist()))
        pred = self.net(x).squeeze(-1)
        loss = F.mse_loss(pred, y)
        if self.relative_from_epoch is not None and self.current_epoch >= self.relative_from_epoch:
            loss = loss + ((pred - y) / y).abs().mean()   # <- origin: relative error
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)}


ZERO = 5   # the sample whose target is 0


def _loader(seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    y = x.sum(-1) + 3.0
    y[ZERO] = 0.0
    torch.manual_seed(seed)
    return DataLoader(TensorDataset(x, y, torch.arange(32)), batch_size=4, shuffle=True)


def _fit(module, callbacks, tmp_path, **kwargs):
    trainer = L.Trainer(max_epochs=kwargs.pop("max_epochs", 3), accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=callbacks, **kwargs)
    trainer.fit(module, _loader())
    return trainer


class _Weights(L.Callback):
    """Records the first layer's weight around every batch (after nanprobe's callback has run)."""

    def __init__(self):
        self.before: dict[int, torch.Tensor] = {}
        self.after: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.setdefault(trainer.global_step, pl_module.net[0].weight.detach().clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = pl_module.net[0].weight.detach().clone()


def test_lightning_nan_in_the_second_epoch_is_skipped_diagnosed_and_reported(tmp_path, caplog):
    from nanprobe.integrations.lightning import NanprobeCallback

    torch.manual_seed(0)
    module = Regressor()
    cb = NanprobeCallback(dirpath=tmp_path / "reports")
    weights = _Weights()
    with caplog.at_level(logging.WARNING, logger="nanprobe.lightning"):
        trainer = _fit(module, [cb, weights], tmp_path, accumulate_grad_batches=2, gradient_clip_val=1.0)
    # the oracle: the first optimizer step in epoch >= 1 whose micro-batches hold the zero target
    expected = min(step for step, epoch, ids in module.seen if epoch >= 1 and ZERO in ids)
    assert expected >= len(_loader()) // 2   # in the second epoch: 4 steps per epoch
    assert trainer.global_step == 12 and trainer.current_epoch == 3   # training went on to the end
    bad = cb.events[0]
    assert (bad.step, bad.status, bad.reason, bad.action) == (expected, "nonfinite", "loss is inf", "skipped")
    # the update was skipped: the weights after the bad step are the weights before it
    assert torch.equal(weights.before[expected], weights.after[expected + 1])
    assert not torch.equal(weights.before[expected - 1], weights.before[expected])
    assert all(torch.isfinite(p).all() for p in module.parameters())

    report = _report(bad)
    src = f"test_integrations.py:{_line(__file__, '# <- ' + 'origin: relative error')}"
    assert report["command"] == "lightning" and report["step"] == expected and report["status"] == "nonfinite"
    origin = report["origin"]
    assert (origin["phase"], origin["module"], origin["op"], origin["kind"]) == \
        ("forward", "(loss_fn)", "aten.div.Tensor", "+inf")
    assert origin["source"].endswith(src)
    top = report["findings"][0]
    assert (top["cause"], top["phase"]) == ("div", "forward")
    assert report["fidelity"]["reproduced"] is True and report["fidelity"]["tolerance"] == "bitwise"
    assert report["position"]["epoch"] == 1 and report["position"]["micro_batches"] == 2
    assert report["lightning"]["global_step"] == expected and report["lightning"]["action"] == "skipped"
    # the capsule of the step before it: weights_only-loadable, with both micro-batches
    cap = read(bad.capsule)
    assert cap.step == expected and len(cap.data["micro_batches"]) == 2 and cap.data["max_grad_norm"] == 1.0
    # one line per bad step, naming the report and the replay command
    lines = [r.getMessage() for r in caplog.records if r.name == "nanprobe.lightning"]
    assert len(lines) == len(cb.events) and "\n" not in lines[0]
    assert f"step {expected}: non-finite values born in forward at (loss_fn) (aten.div.Tensor, {src});" in lines[0]
    assert f"Report: {bad.report}." in lines[0]   # outside the working directory: the absolute path
    assert lines[0].endswith(f"Replay: nanprobe run ENTRY --capsule {bad.capsule}")
    # that command replays it to the same diagnosis: an ENTRY whose loss_fn calls training_step, no Trainer
    # (the module reads current_epoch 1, as in the run: the relative-error term is on)
    from conftest import asset
    from nanprobe.pipeline.diagnose import diagnose
    replayed = diagnose(asset("lightning_regressor.py") + ":target", capsule=bad.capsule).to_json()
    assert (replayed["step"], replayed["origin"]["phase"], replayed["origin"]["op"], replayed["origin"]["source"]) == \
        (expected, "forward", "aten.div.Tensor", origin["source"])
    assert replayed["findings"][0]["cause"] == "div" and replayed["fidelity"]["reproduced"] is True
    assert "current_epoch reads 1 and global_step" in " ".join(replayed["notes"])
    # later bad steps are skipped too; only the first is diagnosed in-process (max_reports=1)
    assert all(e.action == "skipped" and e.report is None for e in cb.events[1:])


@pytest.mark.parametrize("policy", ["stop", "raise"])
def test_lightning_policies_stop_or_raise_after_the_report(tmp_path, policy):
    from nanprobe.live import Stopped
    from nanprobe.integrations.lightning import NanprobeCallback

    torch.manual_seed(0)
    module = Regressor()
    cb = NanprobeCallback(dirpath=tmp_path, policy=policy)
    if policy == "raise":
        with pytest.raises(Stopped, match=r"nanprobe stopped training at step \d+: loss is inf \(policy 'raise'\)"):
            _fit(module, [cb], tmp_path)
    else:
        trainer = _fit(module, [cb], tmp_path)
        assert trainer.global_step == cb.events[0].step + 1 < 24   # the fit ended after the bad step
    assert len(cb.events) == 1 and cb.events[0].action == {"stop": "stopped", "raise": "raised"}[policy]
    assert _report(cb.events[0])["findings"][0]["cause"] == "div"


class EpsZeroRegressor(Regressor):
    """AdamW with eps=0 and a "kind" embedding first used at step 6: its rows with zero gradient get
    0/0 from that step's update (the step's loss and gradients are finite)."""

    def __init__(self):
        super().__init__(relative_from_epoch=None)
        self.kind = nn.Embedding(5, 16, padding_idx=0)

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        h = self.net[1](self.net[0](x))
        if self.global_step >= 6:
            h = h + self.kind(ids % 3)
        return F.mse_loss(self.net[2](h).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=0.0)


def test_lightning_names_the_update_that_made_the_weights_non_finite_at_its_own_step(tmp_path):
    from nanprobe.live import Stopped
    from nanprobe.integrations.lightning import NanprobeCallback

    class FirstBroken(L.Callback):   # the oracle, in a run without nanprobe
        step = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.step is None and not all(torch.isfinite(p).all() for p in pl_module.parameters()):
                self.step = trainer.global_step - 1

    oracle = FirstBroken()
    torch.manual_seed(0)
    _fit(EpsZeroRegressor(), [oracle], tmp_path, max_epochs=2)
    torch.manual_seed(0)
    cb = NanprobeCallback(dirpath=tmp_path / "reports")
    with pytest.raises(Stopped, match="the weights are non-finite"):
        _fit(EpsZeroRegressor(), [cb], tmp_path, max_epochs=2)
    event = cb.events[0]
    assert oracle.step is not None and event.step == oracle.step
    assert event.reason.startswith(f"the AdamW update of step {oracle.step} made the weights non-finite: ")
    report = _report(event)
    assert (report["origin"]["phase"], report["origin"]["parameter"], report["findings"][0]["cause"]) == \
        ("update", "kind.weight", "div")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_healthy_run_writes_nothing_and_keeps_the_weights_bitwise(tmp_path, precision):
    from nanprobe.integrations.lightning import NanprobeCallback

    class Copies(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _copy_and_save(pl_module, averaged)

    finals = []
    for with_callback in (False, True):
        torch.manual_seed(0)
        module = Regressor(relative_from_epoch=None)
        cb = NanprobeCallback(dirpath=tmp_path / "reports")
        averaged: list = []
        _fit(module, [cb, Copies()] if with_callback else [Copies()], tmp_path, precision=precision,
             accumulate_grad_batches=3, gradient_clip_val=0.5)
        finals.append({k: v.clone() for k, v in module.state_dict().items()})
        finals.append({k: v.clone() for k, v in averaged[0].state_dict().items()})
    assert _equal_state(finals[0], finals[2]) and _equal_state(finals[1], finals[3])
    assert cb.events == [] and not (tmp_path / "reports").exists()
    assert cb._guard.checks == 9   # 8 batches per epoch in steps of 3, 3 and 2 micro-batches, 3 epochs
    # the precursor monitor ran (and changed nothing: the weights above are bitwise the same) and stayed silent
    assert cb._guard.monitor.trend.series["train/loss"] and cb._guard.warnings == []


class ManualRegressor(Regressor):
    def __init__(self):
        super().__init__(relative_from_epoch=None)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y, _ = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.manual_backward(loss)
        opt.step()
        return loss


def test_lightning_manual_optimization_is_not_guarded_and_says_so_once(tmp_path, caplog):
    from nanprobe.integrations.lightning import NanprobeCallback

    cb = NanprobeCallback(dirpath=tmp_path / "reports")
    with caplog.at_level(logging.WARNING, logger="nanprobe.lightning"):
        _fit(ManualRegressor(), [cb], tmp_path, max_epochs=1)
    lines = [r.getMessage() for r in caplog.records if r.name == "nanprobe.lightning"]
    assert len(lines) == 1 and "manual optimization" in lines[0] and "nanprobe.Guard" in lines[0]
    assert cb.events == [] and cb._guard is None


def test_lightning_logs_the_precursor_curves_to_the_trainers_logger(tmp_path):
    """The precursor series go to the trainer's logger as ordinary scalars, beside the module's own."""
    from nanprobe.integrations.lightning import NanprobeCallback

    torch.manual_seed(0)
    logger = L.pytorch.loggers.CSVLogger(str(tmp_path / "logs"), name="run")
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=logger, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[NanprobeCallback(dirpath=tmp_path / "reports")])
    trainer.fit(Regressor(relative_from_epoch=None), _loader())
    import csv
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    steps = sorted(int(r["step"]) for r in rows if r.get("nanprobe/optimizer/adam_v_below_eps"))
    assert steps == [10, 20], steps   # every monitored step (monitor.live_every 10) with AdamW state (none at 0)
    assert any(r.get("train_loss") for r in rows)   # the module's own scalar is still there


# -- transformers ------------------------------------------------------------------------------------------

transformers = _framework("transformers")
_framework("accelerate")   # transformers.Trainer needs it


class SFTData(torch.utils.data.Dataset):
    """Token ids with SFT labels: prompt tokens are -100; four samples lost their completion (all -100)."""

    def __init__(self, n: int = 12, seq: int = 8, vocab: int = 64, cut: tuple[int, ...] = (2, 5, 7, 9)):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.labels = self.ids.clone()
        self.labels[:, :4] = -100
        self.labels[list(cut)] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_trainer(model, data, callbacks, tmp_path, **kwargs):
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                          num_train_epochs=kwargs.pop("epochs", 2), use_cpu=True, report_to=[],
                                          save_strategy="no", logging_strategy="no", seed=0, learning_rate=1e-3,
                                          disable_tqdm=True, **kwargs)
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def test_transformers_sft_batch_with_every_label_ignored(tmp_path, caplog):
    from nanprobe.integrations.transformers import NanprobeCallback

    model = _gpt2()
    seen: list[tuple[int, torch.Tensor]] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append((trainer.state.global_step, kw["labels"].clone())),
                                    with_kwargs=True)
    cb = NanprobeCallback(dirpath=tmp_path / "reports")
    trainer = _hf_trainer(model, SFTData(), [cb], tmp_path)
    with caplog.at_level(logging.WARNING, logger="nanprobe.transformers"):
        trainer.train()
    # the oracle: the first step whose (shifted) labels are all ignored: num_items_in_batch is 0
    expected = min(step for step, labels in seen if (labels[..., 1:] != -100).sum() == 0)
    assert trainer.state.global_step == 12   # 6 steps per epoch, 2 epochs: training went on
    bad = cb.events[0]
    assert (bad.step, bad.status, bad.reason, bad.action) == (expected, "nonfinite", "loss is nan", "skipped")
    assert all(torch.isfinite(p).all() for p in model.parameters())

    report = _report(bad)
    import transformers.loss.loss_utils as loss_utils
    src = f"loss_utils.py:{_line(loss_utils.__file__, 'loss = loss / num_items_in_batch')}"
    assert report["command"] == "transformers" and report["step"] == expected and report["status"] == "nonfinite"
    origin = report["origin"]
    assert (origin["phase"], origin["op"], origin["kind"]) == ("forward", "aten.div.Tensor", "nan")
    assert origin["source"].endswith(src) and origin["code"] == "loss = loss / num_items_in_batch"
    top = report["findings"][0]
    # one story: the labels are why (cause data), the division is where (the origin's phase, module, op)
    assert (top["cause"], top["phase"], top["module"], top["op"]) == ("data", "forward", origin["module"],
                                                                     "aten.div.Tensor")
    assert [(p["code"], p["key"]) for p in report["data_problems"]] == [("all_ignored", "batch['inputs']['labels']")]
    assert report["fidelity"]["reproduced"] is True and report["fidelity"]["tolerance"] == "bitwise"
    assert report["transformers"]["global_step"] == expected
    cap = read(bad.capsule)
    assert cap.step == expected and cap.data["max_grad_norm"] == 1.0
    lines = [r.getMessage() for r in caplog.records if r.name == "nanprobe.transformers"]
    assert len(lines) == len(cb.events) and f"step {expected}: non-finite values born in forward" in lines[0]
    assert lines[0].endswith(f"Replay: nanprobe run ENTRY --capsule {bad.capsule}")
    # that command replays it to the same diagnosis, with an ENTRY returning replay_target(the script's Trainer)
    from conftest import asset
    from nanprobe.pipeline.diagnose import diagnose
    replayed = diagnose(asset("hf_sft.py") + ":target", capsule=bad.capsule).to_json()
    assert (replayed["step"], replayed["origin"]["op"], replayed["origin"]["source"]) == \
        (expected, "aten.div.Tensor", origin["source"])
    assert (replayed["findings"][0]["cause"], replayed["findings"][0]["phase"]) == ("data", "forward")
    assert replayed["fidelity"]["reproduced"] is True


def test_transformers_healthy_run_writes_nothing_and_keeps_the_weights_bitwise(tmp_path):
    """bf16 autocast, accumulation over 2 micro-batches (num_items_in_batch spans both: the all-ignored
    micro-batches are harmless then), clipping, the linear schedule."""
    from nanprobe.integrations.transformers import NanprobeCallback

    class Copies(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            _copy_and_save(model, averaged)

    finals = []
    for with_callback in (False, True):
        model = _gpt2()
        cb = NanprobeCallback(dirpath=tmp_path / "reports")
        averaged: list = []
        trainer = _hf_trainer(model, SFTData(cut=(2,)), [cb, Copies()] if with_callback else [Copies()], tmp_path,
                              bf16=True, gradient_accumulation_steps=2, max_grad_norm=0.5)
        trainer.train()
        finals.append({k: v.clone() for k, v in model.state_dict().items()})
        finals.append({k: v.clone() for k, v in averaged[0].state_dict().items()})
    assert _equal_state(finals[0], finals[2]) and _equal_state(finals[1], finals[3])
    assert cb.events == [] and cb._guard.checks == 6 and not (tmp_path / "reports").exists()
    assert cb._guard.monitor.trend.series["train/loss"] and cb._guard.warnings == []   # monitored, silent
    assert "training_step" not in vars(trainer)   # the instance wrapper is gone after train()


def test_transformers_logs_the_precursor_curves_through_report_to(tmp_path):
    """With report_to (here TensorBoard) the precursor series go through Trainer.log beside the loss."""
    pytest.importorskip("tensorboard", reason="the [tensorboard] extra: pip install -e '.[tensorboard]'")
    from nanprobe.integrations.transformers import NanprobeCallback

    model = _gpt2()
    cb = NanprobeCallback(dirpath=tmp_path / "reports")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                          num_train_epochs=4, use_cpu=True, report_to=["tensorboard"],
                                          logging_steps=1, save_strategy="no",
                                          seed=0, learning_rate=1e-3, disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=SFTData(cut=(2,)), callbacks=[cb]).train()
    tags = tb_scalars(tmp_path / "out")
    curves = [t for t in tags if t.startswith("train/nanprobe/") and t.endswith("/max_logit")]
    assert curves and "train/loss" in tags, sorted(tags)   # the attention logits beside the loss


# -- without the framework ---------------------------------------------------------------------------------

@pytest.mark.parametrize("module, blocked", [
    ("nanprobe.integrations.lightning", ("lightning", "lightning.pytorch", "pytorch_lightning")),
    ("nanprobe.integrations.transformers", ("transformers",)),
])
def test_an_integration_without_its_framework_says_so_in_one_line_and_exits_2(monkeypatch, capsys, module, blocked):
    importlib.import_module(module)   # loaded (whatever ran before in this worker), then put back afterwards
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)   # import fails as if not installed
    package, _, leaf = module.rpartition(".")
    monkeypatch.setattr(sys.modules[package], leaf, sys.modules[module])   # put back afterwards, as sys.modules
    monkeypatch.delitem(sys.modules, module)
    fresh = importlib.import_module(module)
    with pytest.raises(SystemExit) as exit_info:
        fresh.NanprobeCallback()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    extra = module.rsplit(".", 1)[1]
    assert err.count("\n") == 1 and err.startswith("nanprobe: error: ") and f"pip install 'nanprobe[{extra}]'" in err


def test_the_hooked_guards_cutoffs_never_hide_a_spike_the_replays_judge_sees():
    """The callbacks judge with the replay's divergence model; the cut-offs all ranks reduce on the
    device are a necessary condition: every spike the model reports lies above them."""
    import random

    from nanprobe.base.config import load_config
    from nanprobe.judge.divergence import Judge
    from nanprobe.base.report import StepRecord

    judge = Judge(load_config().guard)
    rng = random.Random(0)
    verdicts = []
    for step in range(400):
        t_loss, t_norm = judge.model.loss_cut(), judge.model.norm_cut()
        loss = rng.choice([rng.uniform(1, 2), rng.uniform(1, 2), rng.uniform(15, 40), float("nan")])
        norm = rng.choice([rng.uniform(0.5, 1), rng.uniform(0.5, 1), rng.uniform(80, 300), float("inf")])
        skipped = rng.random() < 0.05
        record = StepRecord(step=step, loss=loss, grad_norm=norm, lr=None, update_ratio=None, finite=True,
                            skipped=skipped)
        status, _ = judge.judge(record, True)
        verdicts.append(status.value)
        if status.value == "spike":
            assert loss > t_loss or (not skipped and norm > t_norm)
        if status.value == "finite":
            judge.add(record)
    assert {"finite", "spike", "nonfinite"} <= set(verdicts)   # every rule was exercised


# -- the README's examples ---------------------------------------------------------------------------------

@pytest.mark.parametrize("script, logger, cause, src", [
    ("lightning_relative_error.py", "nanprobe.lightning", "div", "# relative error: y == 0"),
    ("transformers_sft_all_ignored.py", "nanprobe.transformers", "data", None),
])
def test_the_readmes_integration_examples_print_what_it_shows(tmp_path, monkeypatch, caplog, script, logger, cause,
                                                              src):
    path = Path(__file__).resolve().parents[2] / "examples" / "integrations" / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger=logger):
        mod.main()
    lines = [r.getMessage() for r in caplog.records if r.name == logger]
    assert lines and "non-finite values born in forward" in lines[0] and f"cause {cause} (" in lines[0]
    if src is not None:
        assert f"{script}:{_line(path, src)}" in lines[0]
    reports = sorted((tmp_path / "nanprobe-reports").glob("*.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["findings"][0]["cause"] == cause


@pytest.mark.parametrize("guard, message", [({"rng_states": "bogus"}, "guard.rng_states is 'bogus'"),
                                            ({"check_every": 0}, "guard.check_every is 0")])
def test_the_hooked_guard_refuses_guard_settings_the_library_guard_refuses(guard, message):
    from nanprobe.base.config import _build
    from nanprobe.base.errors import UsageError
    from nanprobe.live import HookedGuard

    cfg = _build({"guard": guard}, "test")
    with pytest.raises(UsageError, match=message):
        HookedGuard(command="watch", who="nanprobe watch", model=nn.Linear(2, 2), build_target=lambda: None,
                    config=cfg)
