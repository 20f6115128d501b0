"""Judgement that holds on programs nobody here wrote (issue: the zoo): two signals before a verdict,
bands from the run's own healthy stretch, the LR that was applied, one "verified" that demands learning,
and no internal error on a degenerate batch.

Each rule has a small reproduction here; tests/pipeline/test_zoo.py runs it on real public programs.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import torch

from nanprobe.base.config import MonitorConfig, load_config
from nanprobe.judge.divergence import Judge
from nanprobe.remedy.horizon import best_level, broke_away, kept_learning
from nanprobe.judge.monitor import Monitor, Sample, Trend
from nanprobe.base.report import Mechanism, Status, StepRecord
from nanprobe.judge.shift import batch_shift


def _trend(series: dict[str, list[tuple[int, float]]], classes: int | None = None, **cfg) -> Trend:
    t = Trend(MonitorConfig(**cfg), None, classes=classes)
    steps = sorted({s for pts in series.values() for s, _ in pts})
    for s in steps:
        t.add(Sample(step=s, values={k: x for k, pts in series.items() for st, x in pts if st == s}))
    return t


def _rec(step: int, loss: float, norm: float = 1.0) -> StepRecord:
    return StepRecord(step=step, loss=loss, grad_norm=norm, lr=1e-3, scale=None, skipped=False, finite=True,
                      update_ratio=None)


# -- two signals before a verdict ------------------------------------------------------------------

def _rising_run(judge: Judge, norms=lambda k: 1.0) -> list[tuple[Status, str | None]]:
    """A loss that falls to 2.0 by step 40, then rises to 2.6 and stays (a KL weight ramping up)."""
    rng = random.Random(0)
    out = []
    for k in range(120):
        level = 4.0 - 2.0 * min(k, 40) / 40 if k < 60 else 2.6
        rec = _rec(k, level + rng.gauss(0, 0.03), norms(k))
        out.append(judge.judge(rec, True))
        judge.add(rec)
    return out


def _judge(second=None) -> Judge:
    """The replay's Judge, with a stand-in precursor monitor whose trend answers ``second(facts)``."""
    trend = SimpleNamespace(precursor=lambda facts, patience: second(facts) if second else None)
    return Judge(load_config().replay, SimpleNamespace(cfg=load_config().monitor, trend=trend))


def test_a_loss_rise_with_nothing_behind_it_is_a_note_not_a_failure():
    j = _judge()
    verdicts = _rising_run(j)
    assert all(st is Status.FINITE for st, _ in verdicts)
    assert j.rise is not None and len(j.notes) == 1 and "with nothing behind it" in j.notes[0]
    assert j.breakaway is None


def test_a_loss_rise_with_the_gradient_norm_rising_ten_fold_is_diverging():
    j = _judge()
    verdicts = _rising_run(j, norms=lambda k: 1.0 if k < 60 else 30.0)
    diverging = [why for st, why in verdicts if st is Status.DIVERGING]
    assert diverging and "gradient norm rose" in diverging[0] and "30x" in diverging[0]


def test_a_loss_rise_with_a_precursor_behind_it_is_diverging():
    seen = []

    def second(facts):
        seen.append(facts["step"])
        return "attention_logit_growth: blocks.0.attn: ..." if facts["step"] >= 100 else None

    j = _judge(second)
    verdicts = _rising_run(j)
    first = next(k for k, (st, _) in enumerate(verdicts) if st is Status.DIVERGING)
    assert first == 100 and seen[0] < 100 and j.notes   # noted while nothing stood behind it
    assert j.breakaway["signal"].startswith("attention_logit_growth")


def test_an_excursion_has_recovered_only_back_near_its_level_not_under_the_spike_cut():
    """The word-language-model LSTM at lr 20: 6 -> 305, then 12-60 for hundreds of steps. Under the 10x spike
    cut, but not recovered."""
    j = _judge()
    rng = random.Random(1)
    for k in range(20):
        rec = _rec(k, 6.0 + rng.gauss(0, 0.05))
        j.judge(rec, True)
        j.add(rec)
    assert not j.back_to_normal(_rec(21, 30.0)) and not j.back_to_normal(_rec(21, 12.0))
    assert j.back_to_normal(_rec(21, 6.3))


# -- bands from the healthy stretch --------------------------------------------------------------------

def test_a_statistic_that_grows_during_warm_up_and_then_holds_is_in_its_band():
    """The band is the level after warm-up: attention logits that grow 40x while the LR ramps (as every healthy
    run's do) and then stay are not a precursor."""
    lr = [(s, min(1.0, (s + 1) / 40) * 1e-3) for s in range(0, 200, 2)]
    logit = [(s, 3.0 + 117.0 * min(s, 40) / 40 + math.sin(s)) for s in range(0, 200, 2)]
    t = _trend({"optimizer/lr": lr, "blocks.0.attn/max_logit": logit})
    assert t.warmup_end() == 40
    assert t.signals() == []


def test_the_onset_is_the_first_sustained_exit_from_the_band_not_one_sample():
    logit = [(s, 5.0) for s in range(0, 60, 2)]
    logit[20] = (40, 400.0)                     # one sample out: noise
    logit += [(s, 5.0 * 1.2 ** ((s - 60) / 2)) for s in range(60, 120, 2)]   # a real exit from step ~86
    t = _trend({"blocks.0.attn/max_logit": logit})
    sig = t.signals()[0]
    assert sig.mechanism is Mechanism.ATTENTION_LOGIT_GROWTH
    first_out = next(s for s, x in logit if s >= 60 and x > 50)
    assert sig.onset == first_out and sig.onset > 40


def test_log_z_is_read_against_log_of_the_number_of_classes_and_the_logits_mean():
    """A 10-class head whose log Z grows from 2.3 to 58 while its logits' mean stays near 0 (confident
    predictions: the top logit grows) is no precursor; a vocabulary head whose logits all drift up is."""
    confident = [(s, 2.3 + 56.0 * s / 200) for s in range(0, 200, 2)]
    mean = [(s, 1.0 + s / 100) for s in range(0, 200, 2)]
    t = _trend({"fc2/logsumexp": confident, "fc2/logit_mean": mean}, classes=10)
    assert not [s for s in t.signals() if s.mechanism is Mechanism.OUTPUT_LOGIT_DIVERGENCE]
    drift = [(s, 12.0 + (0.0 if s < 60 else (s - 60) * 1.0)) for s in range(0, 200, 2)]
    shift = [(s, (0.0 if s < 60 else (s - 60) * 1.0)) for s in range(0, 200, 2)]
    t2 = _trend({"lm_head/logsumexp": drift, "lm_head/logit_mean": shift}, classes=30000)
    sig = [s for s in t2.signals() if s.mechanism is Mechanism.OUTPUT_LOGIT_DIVERGENCE]
    assert sig and sig[0].module == "lm_head" and 60 < sig[0].onset < 200


def test_adams_second_moment_below_eps_counts_only_while_that_share_rises():
    falling = [(s, 0.93 - 0.67 * s / 100) for s in range(0, 100, 10)]      # 93% -> 26%: Adam warming up
    assert not [s for s in _trend({"optimizer/adam_v_below_eps": falling}).signals()
                if s.mechanism is Mechanism.ADAM_SECOND_MOMENT]
    rising = [(s, 0.2 + 0.7 * s / 100) for s in range(0, 100, 10)]
    sig = [s for s in _trend({"optimizer/adam_v_below_eps": rising}).signals()
           if s.mechanism is Mechanism.ADAM_SECOND_MOMENT]
    assert sig and "rising" in sig[0].evidence[0]


def test_an_early_warning_needs_a_second_sign():
    """Attention logits out of their band with a loss that keeps improving (and no dtype limit ahead): no
    warning; with the loss rising: one."""
    logit = [(s, 5.0 if s < 40 else 5.0 * 1.15 ** ((s - 40) / 2)) for s in range(0, 120, 2)]
    improving = [(s, 3.0 - s / 100) for s in range(0, 120, 2)]
    t = _trend({"blocks.0.attn/max_logit": logit, "train/loss": improving})
    assert t.signals() and t.warn(120) is None
    rising = [(s, 3.0 - s / 100 if s < 60 else 2.4 + (s - 60) / 50) for s in range(0, 120, 2)]
    t2 = _trend({"blocks.0.attn/max_logit": logit, "train/loss": rising})
    w = t2.warn(120)
    assert w is not None and w["mechanism"] == "attention_logit_growth"


# -- the LR that was applied ---------------------------------------------------------------------------

class _ScheduledInside(torch.optim.SGD):
    """An optimizer that applies its own schedule inside step() (BertAdam's warmup_linear): the param
    group's lr stays constant, the applied LR turns negative after ``t_total`` steps."""

    def __init__(self, params, lr, t_total):
        super().__init__(params, lr=lr)
        self.t_total, self.n = t_total, 0

    @torch.no_grad()
    def step(self, closure=None):
        factor = 1.0 - self.n / self.t_total     # warmup_linear's decay: negative past t_total
        self.n += 1
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] * factor)


def _monitored_run(opt_factory, steps=60):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = opt_factory(model.parameters())
    mon = Monitor(model, MonitorConfig(), every=2)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    for k in range(steps):
        mon.begin(k)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        mon.end(k, loss=loss.item(), lr=opt.param_groups[0]["lr"], optimizers=[opt])
    return mon.trend


def test_the_applied_update_is_read_from_the_weights_an_update_that_climbs_the_gradient_is_lr_schedule():
    trend = _monitored_run(lambda p: _ScheduledInside(p, lr=0.5, t_total=30))
    cos = dict(trend.series["update/cosine"])
    assert cos[10] > 0.99 and cos[40] < -0.99          # SGD: the update is -lr * grad, then +|lr| * grad
    ratio = dict(trend.series["update/ratio"])
    assert ratio[10] > 0 and all(x == 0.5 for _, x in trend.series["optimizer/lr"])
    sig = [s for s in trend.signals() if s.mechanism is Mechanism.LR_SCHEDULE]
    assert sig and sig[0].independent and sig[0].onset == 32 and "negative" in sig[0].evidence[0]
    assert "although the param group's lr is 0.5" in sig[0].evidence[0]
    assert trend.lr_note(40).startswith("LR 0.5, constant")


def test_live_an_update_that_climbs_the_gradient_explains_a_flagged_step_but_raises_nothing_itself():
    """Live (watch, the Guard, callbacks: every ten steps), one step's gradient against an update that Adam's
    momentum made from other batches can read as ascent on a healthy run (PPO's minibatches). There the cosine is
    measured and explains a step the judge flagged (BertAdam's negative applied LR: lr_spike, not unknown), but it
    is no precursor: no early warning, nothing behind a break-away of the loss."""
    cos = [(s, -0.7) for s in range(10, 60, 10)]
    lr = [(s, 1e-3) for s in range(0, 60, 10)]
    for live in (False, True):
        t = Trend(MonitorConfig(), None, live=live)
        for s, x in lr:
            t.add(Sample(step=s, values={"optimizer/lr": x, **({"update/cosine": dict(cos)[s]} if s else {})}))
        sig = [x for x in t.signals() if x.mechanism is Mechanism.LR_SCHEDULE]
        assert sig and "negative" in sig[0].evidence[0] and sig[0].independent is (not live), (live, sig)
        if live:
            assert t.behind(50) is None and t.warn(50) is None


def test_a_finite_spike_whose_in_process_report_names_a_cause_is_not_re_executed(tmp_path):
    """watch explains a bad step it could not locate by re-executing the script (--at N). A finite loss spike has
    no origin to locate: where its in-process report names a cause (OneCycle's LR ramp: lr_spike), that report is
    the answer (the re-executed one, with fewer steps of history, said unknown); an unknown spike is re-executed."""
    from types import SimpleNamespace

    from nanprobe.watch.at import unlocated_step

    def event(step, status, cause, origin=None):
        path = tmp_path / f"{step}.json"
        path.write_text(json.dumps({"status": status, "origin": origin, "findings": [{"cause": cause}],
                                    "watch": {"root": "Net", "handwritten": False}}))
        return SimpleNamespace(step=step, report=str(path))

    assert unlocated_step([event(17, "spike", "lr_spike")]) is None
    assert unlocated_step([event(17, "spike", "unknown")]) == 17
    assert unlocated_step([event(5, "nonfinite", "lr_spike")]) == 5   # a NaN: its origin is what --at finds


def test_lr_words_come_from_the_lrs_direction():
    up = _trend({"optimizer/lr": [(s, 1e-4 * (s + 1)) for s in range(0, 40, 2)]})
    assert up.lr_note(20).startswith("began while the LR was rising")
    down = _trend({"optimizer/lr": [(s, 1e-2 * (1 - s / 50)) for s in range(0, 40, 2)]})
    assert down.lr_note(20).startswith("began while the LR was decaying")
    flat = _trend({"optimizer/lr": [(s, 1e-3) for s in range(0, 40, 2)]})
    assert flat.lr_note(20).startswith("LR 0.001, constant") and "peak" not in flat.lr_note(20)


# -- one "verified" that demands learning --------------------------------------------------------------

def test_a_fix_that_avoids_failure_by_not_training_stopped_learning():
    before = [(k, 4.0 - 2.0 * min(k, 40) / 40 + 0.02 * math.sin(k)) for k in range(60)]   # best level ~2.0
    best = best_level(before)
    assert abs(best[0] - 2.0) < 0.05
    frozen = [(k, 3.9 + 0.02 * math.sin(k)) for k in range(60, 90)]     # LR 1e-5: finite, flat, far above
    why = kept_learning(frozen, best)
    assert why is not None and why.startswith("stopped learning") and "3.9" in why
    learning = [(k, 2.0 - (k - 60) / 100) for k in range(60, 90)]
    assert kept_learning(learning, best) is None


def test_broke_away_skips_missing_losses():
    assert broke_away([(0, None), (1, 2.0)]) is None
    assert broke_away([]) is None


# -- no internal error on a degenerate batch --------------------------------------------------------------

def test_a_key_with_zero_spread_is_not_a_division_by_zero():
    """PPO's last minibatch holds one sample: advantages normalised per minibatch are all 0."""
    before = [[{"adv": torch.randn(16)}] for _ in range(4)]
    problems = batch_shift([{"adv": torch.zeros(1)}], before, step=4)
    assert problems and "all zeros" in problems[0].message


# -- an intended mask is never the origin ---------------------------------------------------------------

class _MaskedAttention(torch.nn.Module):
    """Attention with a causal mask of -inf added to the scores (nn.Transformer's generate_square_subsequent_mask),
    and one built from a Python float (transformers' sdpa_attention: scalar_tensor(-inf))."""

    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Linear(8, 16)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        scores = q @ k.transpose(-2, -1)
        n = x.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        floor = torch.scalar_tensor(float("-inf"))
        scores = torch.maximum(scores + causal, floor)
        return torch.softmax(scores, -1).sum()


def test_an_intended_minus_inf_mask_is_not_where_a_value_entered():
    from nanprobe.locate.instrument import OriginTracker
    model = _MaskedAttention()
    with OriginTracker(model, None, low_dtype=None, batch_size=2) as t:
        loss = model(torch.randn(2, 5, 8))
        t.set_phase(__import__("nanprobe.base.report", fromlist=["Phase"]).Phase.BACKWARD)
        loss.backward()
    mask_ops = {"aten.add.Tensor", "aten.scalar_tensor.default", "aten.maximum.default", "aten.triu.default",
                "aten.full.default", "aten._softmax.default"}
    seen = [e.op for e in (t.trace.entered, *t.trace.events) if e is not None]
    assert torch.isfinite(loss) and not mask_ops & set(seen), seen


# -- a fix's parameters fit the run --------------------------------------------------------------------

def test_a_warm_up_fix_spans_the_run_it_is_for():
    from types import SimpleNamespace

    from nanprobe.remedy.fixes import warmup_steps
    assert [warmup_steps(SimpleNamespace(reached=SimpleNamespace(step=n))) for n in (3, 200, 400, 10_000)] \
        == [10, 100, 200, 1000]


def test_an_attention_forward_that_raises_leaves_no_monitor_mode_behind():
    """The monitor reads attention logits through a TorchFunctionMode entered in the attention module's
    forward pre-hook. A forward that raises (masked_fill(-1e9) on fp16 scores) must still leave it: left
    entered, it intercepted every later op of the process (a later diagnosis checked its statistics too)."""

    class SelfAttention(torch.nn.Module):
        def forward(self, x):
            torch.softmax(x @ x.transpose(-2, -1), -1)
            raise RuntimeError("value cannot be converted to type at::Half without overflow")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), SelfAttention())
    mon = Monitor(model, MonitorConfig(), every=1)
    before = torch._C._len_torch_function_stack()
    assert mon.begin(0) and mon.attention
    try:
        model(torch.randn(2, 3, 4))
    except RuntimeError:
        pass
    mon.abort()
    assert torch._C._len_torch_function_stack() == before
