"""From one step to the trajectory: slow divergence, the mechanism with its onset, early warnings.

The attention-logit-growth proxy (``examples/attention_logit_growth.py``) diverges in every precision;
bf16 and fp16 are ~6x slower than fp32 on an AVX2-only CPU, so the replay tests run its bf16 target
with ``--precision fp32`` (same recipe, same break-away) and only the Guard test trains in fp16.
"""

from __future__ import annotations

import importlib
import logging
import math
import random
import sys

import pytest
import torch

import nanprobe
from nanprobe.base.config import load_config
from nanprobe.pipeline.diagnose import diagnose
from nanprobe.judge.divergence import breakaway
from nanprobe.base.report import Mechanism, Status
from nanprobe.pipeline.smoke import smoke

from conftest import EXAMPLES, example

PROXY = example("attention_logit_growth.py")
CONTROL = example("control_qk_norm.py")


# -- the break-away test -----------------------------------------------------------------------------

def _noisy(levels, seed=0, noise=0.05):
    rng = random.Random(seed)
    return [lv + rng.gauss(0, noise) for lv in levels]


def test_breakaway_flags_a_loss_that_leaves_its_best_level_and_stays():
    levels = [4.0 - 2.0 * min(i, 40) / 40 for i in range(60)] + [2.6] * 40   # down to 2.0, breaks to 2.6 at 60
    facts = breakaway(_noisy(levels))
    assert facts is not None
    assert 40 <= facts["best_step"] <= 62 and abs(facts["best"] - 2.0) < 0.1
    assert 60 <= facts["since"] <= 66 and facts["step"] == facts["since"] + 19   # patience 20 steps
    assert facts["level"] > facts["cut"] > facts["best"]


@pytest.mark.parametrize("name, levels", [
    ("recovers", [4.0 - 2.0 * min(i, 40) / 40 for i in range(60)] + [2.6] * 12 + [2.0] * 40),
    ("plateau", [4.0 - 2.0 * min(i, 40) / 40 for i in range(120)]),
    ("cosine restart", [2.0 + (1.5 if i % 50 < 6 else 0.0) for i in range(150)]),
    ("heavy tails", [1.0 * (20.0 if i % 9 == 0 else 1.0) for i in range(150)]),
    ("crosses zero", [0.5 - i / 100 for i in range(100)]),
])
def test_breakaway_stays_quiet_on_noise_that_comes_back(name, levels):
    assert breakaway(_noisy(levels, noise=0.03)) is None, name


def test_breakaway_takes_step_loss_pairs_and_skips_non_finite_values():
    levels = _noisy([3.0 - min(i, 30) / 30 for i in range(50)] + [2.5] * 40)
    pairs = [(100 + i, v) for i, v in enumerate(levels)]
    pairs.insert(10, (999, math.nan))
    facts = breakaway(pairs)
    assert facts is not None and facts["since"] >= 150


# -- the proxy: run and smoke ------------------------------------------------------------------------

def _attention_series(report, stat):
    return {k.split("/")[0]: v for k, v in report.trajectory["series"].items() if k.endswith("/" + stat)}


def test_run_flags_the_slow_divergence_and_names_attention_logit_growth_with_its_onset():
    report = diagnose(f"{PROXY}:target", precision="fp32")
    assert report.status is Status.DIVERGING and report.exit_code == 1
    top = report.top
    assert top.mechanism is Mechanism.ATTENTION_LOGIT_GROWTH
    logits = _attention_series(report, "max_logit")
    assert set(logits) == {"blocks.0.attn", "blocks.1.attn"}
    # the right layer: the one whose logits grew most by the failing step
    grown = {m: pts[-1][1] / pts[0][1] for m, pts in logits.items()}
    assert top.module == max(grown, key=grown.get)
    # the onset: the first step the logits left 10x their healthy level for good (3 samples in a row), before
    # the loss broke. The band is not the value at initialisation (every run's logits grow 10x from there, and
    # through a warm-up): for a run that broke away it is their level where the loss was at its best, the end
    # of the run's healthy stretch
    pts = logits[top.module]
    broke = next(e for e in top.evidence if e.startswith("loss broke at step"))
    best_step = int(broke.split("(best ")[1].split(" at step ")[1].split(",")[0])
    band = min([x for s, x in pts if s <= best_step][-5:])
    first = next(s for i, (s, x) in enumerate(pts) if s >= best_step and all(y > 10 * band for _, y in pts[i:i + 3]))
    assert pts[0][1] * 10 < band and best_step < first
    assert top.onset == first == report.trajectory["onset"]
    assert top.onset < int(broke.split()[4]) <= report.step
    assert any("entropy" in e for e in top.evidence)
    js = report.to_json()
    assert js["findings"][0]["mechanism"] == "attention_logit_growth" and js["findings"][0]["onset"] == top.onset
    every = load_config().monitor.every                  # replay monitors every k-th step
    assert report.step - every < js["trajectory"]["series"]["train/loss"][-1][0] <= report.step


def test_smoke_fails_on_the_slow_divergence_and_stays_quiet_with_qk_norm():
    bad = smoke(f"{PROXY}:target", steps=110, precision="fp32")
    assert bad.exit_code == 1 and bad.report.status is Status.DIVERGING
    assert bad.report.top.mechanism is Mechanism.ATTENTION_LOGIT_GROWTH
    good = smoke(f"{CONTROL}:target", steps=110, precision="fp32")
    assert good.exit_code == 0 and good.report.status is Status.FINITE


# -- the live run: one early warning, >= 50 steps before the failure ------------------------------------

def _guarded(module, steps, caplog, tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    t = importlib.import_module(module).target_fp16()   # the user's own fp16 + GradScaler loop, with the Guard
    model, opt, sched = t["model"], t["optimizer"], t["scheduler"]
    scaler = torch.amp.GradScaler("cpu")
    guard = nanprobe.Guard(model, opt, scaler=scaler, scheduler=sched, precision="fp16", policy="record",
                           capsule_dir=tmp_path)
    bad = None
    with caplog.at_level(logging.WARNING, logger="nanprobe.guard"):
        for step, batch in zip(range(steps), t["batches"]):
            with guard.step(batch):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = t["loss_fn"](model, batch)
                guard.backward(loss)
            guard.optimizer_step(max_grad_norm=1.0)
            sched.step()
            if not math.isfinite(loss.item()):
                bad = step
                break
    return guard, bad


def test_guard_warns_once_50_steps_before_the_fp16_nan_and_not_with_qk_norm(caplog, tmp_path):
    guard, nan_step = _guarded("attention_logit_growth", 120, caplog, tmp_path)
    assert nan_step is not None                          # the plain loop's NaN step, in this very loop
    assert [e.step for e in guard.events][:1] == [nan_step]
    assert len(guard.warnings) == 1
    w = guard.warnings[0]
    assert w["mechanism"] == "attention_logit_growth" and w["module"].startswith("blocks.")
    assert w["step"] <= nan_step - 50
    assert w["projected_step"] is not None and w["projected_step"] <= nan_step
    lines = [r.getMessage() for r in caplog.records if "early warning" in r.getMessage()]
    assert len(lines) == 1 and "attention_logit_growth" in lines[0]

    caplog.clear()
    quiet, none = _guarded("control_qk_norm", w["step"] + 40, caplog, tmp_path)
    assert none is None and quiet.warnings == [] and not quiet.events
    assert not [r for r in caplog.records if "early warning" in r.getMessage()]


def test_trajectory_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from nanprobe.compare import plot_trajectory
    traj = {"onset": 3, "warnings": [{"step": 6}],
            "series": {"blocks.0.attn/max_logit": [[s, 0.1 * 3 ** s] for s in range(10)],
                       "blocks.0.attn/entropy": [[s, 2.5 / (s + 1)] for s in range(10)],
                       "train/loss": [[s, 4.0 - 0.1 * s] for s in range(10)]}}
    out = plot_trajectory(traj, tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
