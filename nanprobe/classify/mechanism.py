"""The mechanism behind a failure: the slow process the precursor monitor saw, ranked above the op.

An fp16 overflow in ``blocks.0.mlp.fc2`` after 90 steps of growing attention logits is attention-logit
growth: an fp32 island for fc2 only moves the overflow along. When the monitor's series show a
precursor out of its band (``monitor.Trend.signals``), the failure gets a finding with that
``mechanism``, its module and ``onset``, ranked first; its cause code stays one of ``Cause`` (the
cause of the op finding it explains, ``lr_spike`` for a slow divergence with nothing non-finite).
The other tensors within 2x of the dtype's max at the failing step are listed as evidence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..judge.divergence import Breakaway
from ..judge.monitor import Signal, Trend
from ..base.precision import Precision, limits
from ..base.report import Cause, Finding, Mechanism, Phase, Status


def _near_max(ranges, prec: Precision, factor: float = 2.0) -> list[str]:
    """Module outputs within ``factor`` of the low precision's max (or already beyond it)."""
    if not prec.low or not ranges:
        return []
    top = limits(prec.dtype).max
    near = sorted((r for r in ranges if r.absmax >= top / factor or not r.finite), key=lambda r: -r.absmax)
    out: dict[str, str] = {}   # each module once, at its largest
    for r in near:
        out.setdefault(r.module, f"{r.module} {r.absmax:.3g}" if r.finite else f"{r.module} non-finite")
    return list(out.values())


def _pick(signals: list[Signal], origin_module: str | None) -> Signal:
    """The signal that explains the failure: the one in the origin's module, else the LR schedule, else the
    attention layer whose logits grew most, else the earliest."""
    for s in signals:
        if origin_module and s.module and (origin_module == s.module or origin_module.startswith(s.module + ".")):
            return s
    lr = [s for s in signals if s.mechanism is Mechanism.LR_SCHEDULE]
    if lr:   # the schedule kept raising the LR (or applied it below zero) where the run broke: the root of the rest
        return lr[0]
    attn = [s for s in signals if s.mechanism is Mechanism.ATTENTION_LOGIT_GROWTH]
    return max(attn, key=lambda s: s.growth) if attn else signals[0]


def mechanism_findings(findings: list[Finding], *, trend: Trend | None, status: Status, step: int,
                       breakaway: dict[str, Any] | None, ranges, prec: Precision,
                       origin_module: str | None) -> tuple[list[Finding], int | None]:
    """``findings`` with the mechanism finding first (where the series show one), and the onset."""
    # a slow mechanism began before the failure: a precursor first out of its band at the failing step
    # itself (a one-step LR explosion moves every statistic at once) is the failure, not its cause
    signals = [s for s in (trend.signals() if trend is not None else []) if s.onset <= step - trend.cfg.min_lead]
    if not signals and breakaway is not None and trend is not None:   # what stood behind the break-away
        behind = trend.behind(breakaway["step"], breakaway["best_step"])
        signals = [behind] if behind is not None else []
    if status is Status.FINITE or not signals and breakaway is None:
        return findings, None
    near = _near_max(ranges, prec)
    top = findings[0] if findings else None
    if not signals:   # a slow divergence no precursor explains: the break-away itself, with the LR
        ev = [Breakaway.describe(breakaway), breakaway.get("signal"),
              trend.lr_note(breakaway["since"]) if trend is not None else None]
        ev = [x for x in ev if x]
        f = Finding(cause=Cause.LR_SPIKE, confidence=0.6, phase=Phase.UPDATE, module=None, op=None,
                    evidence=tuple(ev), mechanism=None, onset=breakaway["since"])
        return [f] + [x for x in findings if x.cause is not Cause.LR_SPIKE], breakaway["since"]
    sig = _pick(signals, origin_module)
    if breakaway is not None and trend is not None:
        # a run that broke away: its healthy stretch ended at the loss's best level; the precursor's onset is
        # where it left the level it had there (a level every healthy run also passes during warm-up is no onset)
        later = trend.onset_since(sig, breakaway["best_step"])
        if later is not None and later > sig.onset:
            sig = dataclasses.replace(sig, onset=later, evidence=sig.evidence + (
                f"left its level at the loss's best step {breakaway['best_step']} (10x) from step {later}",))
    if top is not None and top.module and sig.module and sig.mechanism is not Mechanism.ATTENTION_LOGIT_GROWTH \
            and not (top.module == sig.module or top.module.startswith(sig.module + ".")):
        # the finding already places the failure elsewhere by its own evidence (its origin, the weights that
        # moved most): a statistic that grew in another module is seen downstream of it, not its cause
        onset = breakaway["since"] if breakaway is not None else top.onset
        f = dataclasses.replace(top, onset=onset, evidence=top.evidence + (
            f"also seen: {sig.module} {sig.mechanism.value} from step {sig.onset} (downstream of {top.module})",))
        return [f] + findings[1:], onset
    if sig.mechanism is Mechanism.LR_SCHEDULE and (top is None or top.cause in (Cause.UNKNOWN, Cause.LR_SPIKE)):
        # the step size the schedule applied: the LR story leads, whatever the op finding could not tell apart
        ev = list(sig.evidence) + [x for x in (Breakaway.describe(breakaway) if breakaway is not None else None,
                                               trend.lr_note(sig.onset)) if x]
        if top is not None and top.cause is Cause.LR_SPIKE:   # its module: the weights that moved most
            f = dataclasses.replace(top, evidence=tuple(ev) + top.evidence, mechanism=sig.mechanism, onset=sig.onset)
        else:
            f = Finding(cause=Cause.LR_SPIKE, confidence=max(0.75, top.confidence if top is not None else 0.0),
                        phase=Phase.UPDATE, module=None, op=None, evidence=tuple(ev) + (top.evidence if top else ()),
                        mechanism=sig.mechanism, onset=sig.onset)
        return [f] + [dataclasses.replace(x, confidence=min(x.confidence, f.confidence - 0.01))
                      for x in findings[1:]], sig.onset
    if sig.module is None and top is not None:
        # a run-wide mechanism (loss scale, Adam's eps): the op finding keeps its place, with the mechanism
        f = dataclasses.replace(top, mechanism=sig.mechanism, onset=sig.onset, evidence=top.evidence + sig.evidence)
        return [f] + findings[1:], sig.onset
    ev = list(sig.evidence)
    if breakaway is not None:
        ev.append(f"loss broke at step {breakaway['since']} (best {breakaway['best']:.4g} at step "
                  f"{breakaway['best_step']}, {breakaway['level']:.4g} at step {breakaway['step']})")
    elif status is not Status.FINITE:
        ev.append(f"the run failed at step {step}, {step - sig.onset} steps after the onset")
    ev += [note] if (note := trend.lr_note(sig.onset)) else []
    if near:
        ev.append("within 2x of the dtype max at the failing step: " + ", ".join(near[:6]))
    others = [s for s in signals if (s.mechanism, s.module) != (sig.mechanism, sig.module)]
    for s in others[:3]:
        ev.append(f"also: {s.module + ' ' if s.module else ''}{s.mechanism.value} from step {s.onset}")
    if top is not None and top.cause is not Cause.NOT_REPRODUCED and status is not Status.DIVERGING:
        cause, phase, op = top.cause, top.phase, top.op if top.module == sig.module else None
        conf = min(0.99, top.confidence + 0.02)
        if top.module and top.module != sig.module:
            ev.append(f"the first op to overflow was in {top.module} ({top.op}): where the growth was caught, "
                      "not its cause")
    else:
        cause, phase, op = (Cause.OVERFLOW if status is Status.NONFINITE else Cause.LR_SPIKE), Phase.FORWARD, None
        conf = max(0.7, top.confidence + 0.02 if top is not None else 0.0)
    f = Finding(cause=cause, confidence=min(conf, 0.99), phase=phase, module=sig.module, op=op,
                evidence=tuple(ev), mechanism=sig.mechanism, onset=sig.onset)
    rest = [dataclasses.replace(x, confidence=min(x.confidence, f.confidence - 0.01)) for x in findings]
    return [f] + rest, sig.onset


__all__ = ["mechanism_findings"]
