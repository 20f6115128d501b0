"""Snapshots: every store (device, host, disk) restores exactly, refills in place, and a partial restore
happens (and a full one skips the optimizer state) only when no weight or optimizer state was written
since the last full one."""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanprobe.base.config import load_config
from nanprobe.pipeline.diagnose import diagnose_target
from nanprobe.reach.entry import Loaded
from nanprobe.base.precision import Precision
from nanprobe.reach.replay import reach
from nanprobe.locate.rerun import run_step
from nanprobe.reach.state import StoragePolicy, objects_of
from nanprobe.reach.store import TensorStore
from nanprobe.reach.target import validate


def _target(seed: int = 0, bf16_params: bool = False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    if bf16_params:
        model[3].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(10)]

    def loss_fn(m, b):   # the head may hold bf16 weights: a mixed-dtype state
        h = m[:3](b[0])
        return F.cross_entropy(m[3](h.to(m[3].weight.dtype)).float(), b[1])
    return validate({"model": model, "loss_fn": loss_fn, "batches": batches, "optimizer": opt, "scheduler": sched},
                    "t")


def _flat(t) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in t.model.state_dict().items()}
    for i, s in t.optimizer.state_dict()["state"].items():
        for k, v in s.items():
            out[f"o.{i}.{k}"] = torch.as_tensor(v).clone()
    return out


@pytest.mark.parametrize("mode", ["device", "host", "disk"])
def test_every_store_restores_bitwise_and_refills_in_place(mode, tmp_path):
    t = _target(bf16_params=True)
    objects = objects_of(t)
    objects.storage = StoragePolicy(mode=mode, directory=str(tmp_path))
    for b in t.batches[:2]:       # optimizer state exists
        t.optimizer.zero_grad()
        t.loss_fn(t.model, b).backward()
        t.optimizer.step()
    snap = objects.take()
    assert snap.storage == mode
    want = _flat(t)
    ids = [id(p) for p in t.model.parameters()] + [id(v) for s in t.optimizer.state.values() for v in s.values()]
    for b in t.batches[2:4]:
        t.optimizer.zero_grad()
        t.loss_fn(t.model, b).backward()
        t.optimizer.step()
    snap.restore(objects)
    got = _flat(t)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert ids == [id(p) for p in t.model.parameters()] + [id(v) for s in t.optimizer.state.values() for v in s.values()]
    files = list(tmp_path.iterdir())
    assert len(files) == (1 if mode == "disk" else 0)
    again = objects.take(reuse=snap)          # same layout: the same buffers / the same file
    assert again.store is snap.store and list(tmp_path.iterdir()) == files
    snap.release()
    assert not list(tmp_path.iterdir())


def test_disk_store_reads_into_other_dtypes_and_views():
    store = TensorStore("disk")
    src = torch.randn(5, 7)
    (slot,) = store.put_all([src])
    into64 = torch.empty(5, 7, dtype=torch.float64)
    slot.copy_into(into64)
    assert torch.equal(into64, src.double())
    strided = torch.empty(7, 5).t()          # not contiguous
    slot.copy_into(strided)
    assert torch.equal(strided, src)
    assert torch.equal(slot.load(), src)
    store.close()


def test_partial_restore_only_when_no_weight_was_written():
    t = _target()
    reached = reach(t, at=3, precision=Precision.FP32, cfg=load_config().replay, where="t")
    before = _flat(t)
    bn_before = t.model[1].running_mean.clone()
    # a rerun that stops before its update: weights untouched, BatchNorm statistics moved
    run_step(t, reached, Precision.FP32, where="t", instrument=False, restore_after=False, update=False)
    assert not torch.equal(t.model[1].running_mean, bn_before)
    assert reached.snapshot._untouched(reached.loop.objects)
    reached.snapshot.restore(reached.loop.objects, partial_ok=True)
    assert torch.equal(t.model[1].running_mean, bn_before)
    # a rerun with its update writes the weights: the next restore must be full
    run_step(t, reached, Precision.FP32, where="t", instrument=False, restore_after=False, update=True)
    assert not reached.snapshot._untouched(reached.loop.objects)
    reached.snapshot.restore(reached.loop.objects, partial_ok=True)
    after = _flat(t)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_full_restore_copies_the_optimizer_state_only_after_an_update(monkeypatch):
    t = _target()
    reached = reach(t, at=3, precision=Precision.FP32, cfg=load_config().replay, where="t")
    before = _flat(t)
    opt_slots = {id(s) for slots in reached.snapshot.opt_slots for s in slots.values()}
    assert opt_slots
    copied: list[int] = []
    real = TensorStore.copy_into
    monkeypatch.setattr(TensorStore, "copy_into", lambda self, slot, live: (copied.append(id(slot)),
                                                                            real(self, slot, live))[1])
    # reruns that stop before their update leave the optimizer state as saved: a full restore skips it
    run_step(t, reached, Precision.FP32, where="t", instrument=False, restore_after=False, update=False)
    reached.restore()
    assert copied and not opt_slots & set(copied)
    after = _flat(t)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # an update writes it: the next full restore copies it back
    copied.clear()
    run_step(t, reached, Precision.FP32, where="t", instrument=False, restore_after=False, update=True)
    reached.restore()
    assert opt_slots <= set(copied)
    after = _flat(t)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_reruns_without_update_give_the_replayed_loss_and_norm():
    t = _target()
    reached = reach(t, at=4, precision=Precision.FP32, cfg=load_config().replay, where="t")
    full = run_step(t, reached, Precision.FP32, where="t", instrument=True, restore_after=False)
    short = run_step(t, reached, Precision.FP32, where="t", instrument=True, restore_after=False, update=False)
    assert (full.record.loss, full.record.grad_norm) == (short.record.loss, short.record.grad_norm) \
        == (reached.record.loss, reached.record.grad_norm)
    assert short.record.update_ratio == reached.record.update_ratio is not None


def test_diagnosis_on_a_disk_snapshot_matches_the_in_memory_one(tmp_path):
    def run(mode):
        t = _target()
        t.batches[5][0][2, 1] = float("nan")
        cfg = load_config()
        cfg = dataclasses.replace(cfg, replay=dataclasses.replace(cfg.replay, snapshot_store=mode,
                                                                  snapshot_dir=str(tmp_path), snapshot_every=2))
        loaded = Loaded(target=t, entry="t", module="t", function="t", path=None, lineno=None)
        report = diagnose_target(loaded, config=cfg)
        return report.to_json(), _flat(t)
    a, state_a = run("device")
    b, state_b = run("disk")
    for key in ("step", "status", "findings", "context", "position", "fidelity"):
        assert a[key] == b[key], key
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert a["step"] == 5 and a["fidelity"]["reproduced"] is True
    gc.collect()
    assert not [f for f in os.listdir(tmp_path) if f.startswith("nanprobe-snapshot-")]   # files go with the snapshots


def test_an_fp64_rerun_measures_its_update_before_the_weights_go_back():
    t = _target()
    reached = reach(t, at=3, precision=Precision.FP32, cfg=load_config().replay, where="t")
    before = _flat(t)
    fp32 = run_step(t, reached, Precision.FP32, where="t", instrument=False, restore_after=False)
    fp64 = run_step(t, reached, Precision.FP64, where="t", instrument=False)
    assert fp32.record.update_ratio > 0
    assert fp64.record.update_ratio == pytest.approx(fp32.record.update_ratio, rel=1e-2)   # was 0
    after = _flat(t)
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


def test_borrowed_globals_gives_back_a_medium_matmul_precision():
    # assigning torch.backends.cuda.matmul.allow_tf32 overwrites the float32 matmul precision: the flags
    # must go back before the precision does, or a user's "medium" is lost (and torch then refuses to read it)
    from nanprobe.reach.state import borrowed_globals

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with borrowed_globals():
            torch.set_float32_matmul_precision("highest")
        assert torch.get_float32_matmul_precision() == "medium"
        with borrowed_globals():   # entered again: it reads the precision on entry
            pass
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
