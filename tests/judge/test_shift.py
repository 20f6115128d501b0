"""Does a batch stand out against the batches before it (``nanprobe.judge.shift``): the positive data evidence a
``data`` finding needs; and a spike that neither the data nor the step size explains is ``unknown``."""

from __future__ import annotations

import torch

from conftest import asset
from nanprobe import diagnose
from nanprobe.judge.shift import batch_shift


def _batches(n: int, seed: int = 0) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(20, 30, (8,), generator=g)
        mask = torch.arange(32)[None, :] < lengths[:, None]
        out.append([{"x": torch.randn(8, 5, generator=g) * 3, "labels": torch.randint(0, 4, (8,), generator=g),
                     "attention_mask": mask}])
    return out


def test_ordinary_batches_do_not_stand_out():
    batches = _batches(30)
    found = [p for k in range(4, 30) for p in batch_shift(batches[k][0:1], batches[:k], step=k)]
    assert found == []


def test_a_key_in_other_units_is_named_with_its_samples():
    batches = _batches(10)
    bad = dict(batches[9][0], x=batches[9][0]["x"] * 1000)
    (p,) = batch_shift([bad], batches[:9], step=9)
    assert (p.code, p.key, p.step, p.samples) == ("shift", "batch['x']", 9, (0, 1, 2, 3, 4))
    assert "usual size" in p.message


def test_labels_of_another_source_and_lengths_that_collapse_stand_out():
    batches = _batches(10)
    relabelled = dict(batches[9][0], labels=batches[9][0]["labels"] + 100)
    (p,) = batch_shift([relabelled], batches[:9], step=9)
    assert p.key == "batch['labels']" and "labels never seen before (100" in p.message and len(p.samples) == 5
    short = dict(batches[9][0], attention_mask=torch.zeros(8, 32, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True))
    (q,) = batch_shift([short], batches[:9], step=9)
    assert q.key == "batch['attention_mask']" and "mean length per sample is 1" in q.message


def test_a_spike_neither_the_data_nor_the_step_size_explains_is_unknown_with_both_hypotheses():
    report = diagnose(asset("hostile.py") + ":loss_scaled_once")
    top = report.top
    assert (report.step, top.cause.value, top.phase.value) == (7, "unknown", "input"), top
    text = "\n".join(top.evidence)
    assert top.confidence < 0.5 and "hypotheses: (1) the data" in text and "(2) the step size" in text
    assert "the check that tells them apart" in text and "the batch does not stand out" in text
    assert top.fixes and top.fixes[0].title == "Tell the data and the step size apart"
