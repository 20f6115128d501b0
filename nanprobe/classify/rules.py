"""The rules: data, divergence (step size), not reproduced, corrupted state, and the origin op.

Each rule looks at the evidence of one diagnosed step and returns zero or more ``Finding``s
(without fixes; ``fixes.attach`` adds them). Confidence is the ranking key.
"""

from __future__ import annotations

import math
import statistics

from ..base.precision import limits
from ..base.report import Cause, Finding, Phase, Status, StepRecord
from .core import (Evidence, dtype_max, family_of, finding, g, is_low, node_base, nonfinite_state, op_base,
                   origin_line, owning_group, rule, unknown_origin, zeros)
from .ops import semantics_for


@rule
def data_rule(ev: Evidence) -> list[Finding]:
    errors = [p for p in ev.data if p.level == "error"]
    if not errors:
        return []
    p = errors[0]
    conf = 0.97 if p.code == "nonfinite" and ev.origin is None else 0.95
    if ev.origin is not None and p.code in ("beyond_range", "label_negative", "label_out_of_range"):
        conf = 0.8
    lines = [f"step {ev.reached.step}: {q.message}" + (f"; samples {list(q.samples)}" if q.samples else "")
             for q in errors[:4]]
    if ev.origin is not None:
        lines.append("it surfaces as " + origin_line(ev.origin))
    elif ev.reached.error is not None:
        lines.append(f"the step raised before any NaN existed: {ev.reached.error.message}")
    # one story: the batch is why, the origin (where there is one) is where (its phase, module, op)
    return [finding(Cause.DATA, conf, ev.origin, lines, phase=None if ev.origin is not None else Phase.INPUT)]


# -- divergence: is the step size to blame? ----------------------------------------------------------

def lrs_seen(reached) -> list[float]:
    """The LRs of the recent steps and of the reached step, oldest first."""
    lrs = [h.lr for h in reached.history if h.lr is not None]
    cur = reached.record.lr if reached.record else None
    return lrs + ([cur] if cur is not None else [])


def constant(lrs: list[float]) -> bool:
    return bool(lrs) and max(lrs) <= min(lrs) * 1.0001


def multiplier_above_one(reached, lr: float | None) -> bool:
    """A LambdaLR / MultiplicativeLR that drove the LR above its base LR: its multiplier left [0, 1]."""
    base = reached.scheduler_base_lrs
    return lr is not None and bool(base) and lr > max(base) * 1.0001 and \
        reached.scheduler_kind in ("LambdaLR", "MultiplicativeLR")


def _lr_lines(ev: Evidence, hist: list[StepRecord]) -> tuple[list[str], float]:
    lines: list[str] = []
    strength = 0.0
    lrs = [h.lr for h in hist if h.lr is not None]
    cur = ev.reached.record.lr if ev.reached.record else None
    seen = lrs_seen(ev.reached)
    if seen:
        base = statistics.median(lrs[: max(1, len(lrs) // 2)]) if lrs else seen[0]
        peak = max(seen[-4:])
        if base > 0 and peak > ev.cfg.lr_jump_factor * base:
            lines.append(f"learning rate rose from {g(base)} to {g(peak)} ({peak / base:.0f}x) in the steps before "
                         f"step {ev.reached.step}")
            strength = 0.6
        elif constant(seen):
            lines.append(f"learning rate {g(seen[-1])}, constant over the {len(seen)} step(s) seen")
    if multiplier_above_one(ev.reached, cur):
        top = max(ev.reached.scheduler_base_lrs)
        lines.append(f"{ev.reached.scheduler_kind} drives the LR to {g(cur)}, {cur / top:.3g}x its base "
                     f"LR {g(top)}: the multiplier should stay <= 1")
        strength = max(strength, 0.5) + (0.2 if strength else 0)
    return lines, strength


def _update_lines(ev: Evidence, hist: list[StepRecord]) -> tuple[list[str], float]:
    """The largest measured |dw|/|w| near the step: the steps before (where measured), the step itself
    (its rerun), and the previous step's per-parameter ratios (their median: robust to fresh biases)."""
    cfg = ev.cfg
    seen: list[tuple[float, str]] = [(h.update_ratio, f"step {h.step}") for h in hist[-5:]
                                     if h.update_ratio is not None and math.isfinite(h.update_ratio)]
    e = ev.origin
    # this step's own update counts where it is what went wrong (an update-phase origin, or the judge saw
    # the update itself); otherwise a large update is the consequence of this step's loss, not its cause
    this = ev.main.record.update_ratio if ev.main.record else None
    own = (e is not None and e.phase is Phase.UPDATE) or (ev.reached.reason or "").startswith("update spike")
    if this is not None and math.isfinite(this) and own:
        seen.append((this, f"step {ev.reached.step}, this step's own update"))
    per_param = [r for r in ev.reached.update_ratios.values() if math.isfinite(r)]
    if per_param and not any(h.update_ratio is not None for h in hist[-1:]):
        seen.append((statistics.median(per_param), f"step {ev.reached.step - 1}, median over parameters"))
    if not seen:
        return [], 0.0
    ratio, at = max(seen)
    if ratio > cfg.update_ratio_limit:
        return [f"update ratio |dw|/|w| reached {g(ratio)} at {at}: one step replaced the weights' norm "
                f"(limit {cfg.update_ratio_limit:g}; a healthy step moves about 1e-3)"], 0.75
    if ratio > cfg.update_ratio_high:
        return [f"update ratio |dw|/|w| reached {g(ratio)} at {at}, {ratio / 1e-3:.0f}x a healthy ~1e-3 per step: "
                f"large (evidence above {cfg.update_ratio_high:g})"], 0.55
    return [f"update ratio |dw|/|w| is at most {g(ratio)} ({at}): the updates are small (a healthy step moves "
            "~1e-3)"], 0.0


def _growth_lines(ev: Evidence) -> tuple[list[str], str | None, float]:
    """The weights themselves: a parameter whose norm grew by ``weight_growth_high`` or more in the update
    before the step (an identity init going x3.8) took a step that was too big."""
    growth = ev.reached.growth
    name = max(growth, key=lambda k: growth[k]) if growth else None
    if name is None or not growth[name] > ev.cfg.weight_growth_high:
        return [], None, 0.0
    return [f"the update of step {ev.reached.step - 1} grew {name} |w| x{growth[name]:.3g} in one step (a healthy "
            "update changes |w| by about 0.1%): a step that was too big"], name, 0.6


def step_size_evidence(ev: Evidence) -> tuple[list[str], str | None, float]:
    """Lines about the LR and the size of the updates near the step; the module with the largest
    relative update; how strongly they point at the step size (0: not at all)."""
    hist: list[StepRecord] = list(ev.reached.history)
    lr_lines, lr_strength = _lr_lines(ev, hist)
    up_lines, up_strength = _update_lines(ev, hist)
    grow_lines, grew, grow_strength = _growth_lines(ev)
    lines = lr_lines + up_lines + grow_lines
    up_strength = max(up_strength, grow_strength) + (0.1 if up_strength and grow_strength else 0.0)
    strength = max(lr_strength, up_strength) + (0.15 if lr_strength and up_strength else 0.0)
    # the gradient norm exploding in the steps BEFORE this one (this step's own norm follows its loss)
    norms = [h.grad_norm for h in hist if h.grad_norm is not None and math.isfinite(h.grad_norm)]
    if len(norms) >= 4 and norms[-1] > 5 * statistics.median(norms[:-1]):
        clip = ev.target.max_grad_norm
        grown = norms[-1] / statistics.median(norms[:-1])
        lines.append(f"gradient norm grew to {g(norms[-1])} before step {ev.reached.step}, {grown:.0f}x its median "
                     f"{g(statistics.median(norms[:-1]))}, " + (f"clipped at {clip:g}" if clip else "unclipped"))
        if not clip and grown > 100:
            strength = max(strength, 0.5)
    module = None
    source = ev.reached.update_ratios or ev.main.update_ratios
    pname = largest_update(ev) if source and strength else None
    if grew and not (source and up_strength > grow_strength):
        module = grew.rpartition(".")[0]
    elif pname is not None:
        module = pname.rpartition(".")[0]
        owner = owning_group(ev, pname)
        if owner is not None and owner.differs:
            # the step's recorded LR is the first group's: quote the group that owns the parameter instead
            lines = [line for line in lines if not line.startswith("learning rate ")]
            lines.insert(0, f"learning rate {g(owner.lr)} in param group {owner.index} of {owner.count} "
                            f"({owner.optimizer}), the group holding {pname}; the other group(s): "
                            f"{', '.join(g(x) for x in owner.others)}")
        lines.insert(0, f"largest relative update: {pname} ({g(source[pname])})")
    return lines, module, strength


def largest_update(ev: Evidence) -> str | None:
    """The parameter with the largest relative update |dw|/|w| near the step (None: none measured, or none
    moved: a rerun with no optimizer to apply, as a hand-written update's, moves nothing)."""
    source = {k: v for k, v in (ev.reached.update_ratios or ev.main.update_ratios or {}).items() if v != 0}
    return max(source, key=lambda k: source[k] if math.isfinite(source[k]) else float("inf"), default=None)


@rule
def divergence_rule(ev: Evidence) -> list[Finding]:
    """``lr_spike`` only with LR or update evidence; a spike without it is reported as what it is."""
    e = ev.origin
    if e is not None and e.phase is Phase.UPDATE and family_of(e) == "div":
        return []  # a division in the optimizer (eps = 0), not a step size problem
    lines, module, strength = step_size_evidence(ev)
    spike = ev.reached.status is Status.SPIKE
    reason = ev.reached.reason
    shifts = [p for p in ev.data if p.code == "shift"]
    found: list[Finding] = []
    if spike and shifts and not any(p.level == "error" for p in ev.data):
        # positive evidence in the data: a key of this batch stands out against the batches before it
        found.append(finding(Cause.DATA, 0.85 if not strength else 0.6, None, [
            f"step {ev.reached.step}: {reason}",
            *(q.message + (f"; samples {list(q.samples)}" if q.samples else "") for q in shifts[:3]), *lines,
            *(["the step size did not change and the updates are small: the LR does not explain it"]
              if not strength else [])], phase=Phase.INPUT))
    if not strength:
        if found or not spike or any(p.level == "error" for p in ev.data):
            return found
        n = len(ev.reached.before)
        return [finding(Cause.UNKNOWN, 0.3, None, [
            f"step {ev.reached.step}: {reason}", *lines,
            "the step size does not explain it (the LR did not change, the updates are small) and the batch does "
            f"not stand out: no key's range, norm, label histogram or lengths leave what the {n} batches before "
            "it spanned" if n else "the step size does not explain it (the LR did not change, the updates are "
            "small) and there are no earlier batches to compare this one with",
            "hypotheses: (1) the data - this batch differs in a way its per-key statistics do not show (a few "
            "mislabelled samples, targets of another source); (2) the step size - an update that was too big for "
            "where the weights were (a sharp region, Adam's second moment still small)",
            f"the check that tells them apart: rerun step {ev.reached.step} from the same state with the batch of "
            f"step {ev.reached.step - 1} (a spike that stays is the step size), or with a 10x smaller LR (a spike "
            "that stays is the data)"],
            phase=Phase.INPUT)]
    conf = strength
    if any(p.level == "error" for p in ev.data):
        conf -= 0.4  # bad data explains the blow-up better
    if shifts:
        conf -= 0.3  # a batch that stands out explains the failure better than the step size
    if e is None and ev.main.trace is not None and ev.main.trace.entered is not None:
        conf -= 0.4  # the non-finite value came from outside the step's ops: no step size makes a NaN constant
    if ev.reached.error is not None and e is None:
        conf -= 0.4  # the step raised before any NaN existed: its input did it, not the step size
    if ev.reference_finite is False or (e is not None and not is_low(e.out_dtype)):
        conf += 0.15  # not a precision problem: the reference diverges too
    if e is not None and e.phase is Phase.UPDATE and family_of(e) != "div":
        conf += 0.1
    if conf < 0.1:
        return found   # the other evidence explains the step: a step size at no confidence is no finding
    if reason:
        lines.insert(0, f"replay: {reason} at step {ev.reached.step}")
    return found + [finding(Cause.LR_SPIKE, conf, None, lines, phase=Phase.UPDATE, module=module)]


@rule
def not_reproduced_rule(ev: Evidence) -> list[Finding]:
    if ev.reached.status is not Status.NONFINITE or ev.origin is not None or not ev.main.finite \
            or ev.reached.error is not None:
        return []
    return [finding(Cause.NOT_REPRODUCED, 0.9, None, [
        f"replay saw {ev.reached.reason} at step {ev.reached.step}",
        f"the rerun of the same step from the same state, batch and RNG is finite (loss {g(ev.main.record.loss)})",
        "suspect nondeterminism (atomics, thread count, cuDNN autotune) or hardware (ECC errors, overheating)",
    ])]


@rule
def corrupted_state_rule(ev: Evidence) -> list[Finding]:
    """Weights or buffers already non-finite before the step: an earlier update (or the checkpoint) did it."""
    if ev.origin is not None or ev.main.finite:
        return []
    bad = nonfinite_state(ev)
    if not bad:
        return []
    return [finding(Cause.LR_SPIKE, 0.5, None, [
        f"{len(bad)} tensor(s) of the model are already non-finite before step {ev.reached.step} "
        f"(first: {bad[0]}); nothing in this step produced them",
        f"an earlier update (or the checkpoint {ev.reached.reached_by!r} started from) wrote them: "
        "diagnose an earlier step with --at, or check the checkpoint",
    ], phase=Phase.UPDATE, module=bad[0].rpartition(".")[0])]


# -- the origin op ------------------------------------------------------------------------------------

def _scale_lines(ev: Evidence, unscaled: float | None, lim: float) -> tuple[list[str], float | None]:
    """A backward origin under a GradScaler: does the value overflow only because of the loss scale?"""
    rec = ev.reached.record
    e = ev.origin
    if rec is None or rec.scale is None or e is None or e.phase is not Phase.BACKWARD or unscaled is None:
        return [], None
    scale = rec.scale
    if unscaled > lim:
        return [f"even unscaled the value reaches |x| = {g(unscaled)} > {lim:g} (the loss scale was {scale:g})"], 0.95
    return [f"unscaled the value fits fp16 (|x| = {g(unscaled)}); the loss scale {scale:g} makes it "
            f"{g(unscaled * scale)}: the scale overflows it, not the model"], 0.6


@rule
def origin_rule(ev: Evidence) -> list[Finding]:
    e = ev.origin
    if e is None:
        return []
    semantic = semantics_for(e)
    found = semantic(ev, e) if semantic is not None else None
    if found:
        return found
    fam = family_of(e)
    base = op_base(e.op)
    nbase = node_base(e.node)
    low = is_low(e.out_dtype)
    ref_ok = ev.reference_finite
    probe = ev.probe if ev.probe is not None and ev.probe.found else None
    lines = [origin_line(e)]
    if (ev.reached.reason or "").startswith("GradScaler"):
        lines.append(f"replay: {ev.reached.reason}")
    if e.masked:
        lines.append("the non-finite value was masked before the loss (torch.where / masked_fill / relu): the loss "
                     "stays finite but the gradient of the masked branch is NaN")
    if e.code:
        lines.append(f"code: {e.code}")
    ins = e.inputs
    findings: list[Finding] = []
    min_in = min((s.min for s in ins), default=None)
    n_zeros = zeros(ins)
    if low and ref_ok:
        lines.append(f"the same step in {ev.reference.precision.value} is finite (loss {g(ev.reference.record.loss)})")

    def underflow_check(kind: str) -> bool:
        """Zeros in the low-precision inputs that are non-zero in the reference.

        The op itself may run in float32 (CUDA autocast upcasts log, exp, pow...) while its zero
        input was flushed upstream in fp16: what matters is that the run is in low precision.
        """
        if not ev.reached.precision.low or probe is None or probe.inputs is None or n_zeros <= zeros(probe.inputs):
            return False
        # watch --at has no reference rerun: its probe recomputed the op that made the input in float32
        ref = ev.reference.precision.value if ev.reference is not None else "fp32 (the op that made it, recomputed)"
        tiny = min((s.min_nonzero for s in probe.inputs if s.min_nonzero is not None), default=None)
        run_dtype = str(ev.reached.precision.dtype).replace("torch.", "")
        lim = limits(ev.reached.precision.dtype)
        head = (f"{n_zeros - zeros(probe.inputs)} input value(s) of {e.op} are exactly 0 in the "
                f"{ev.reached.precision.value} run but non-zero in {ref} (smallest {g(tiny)}")
        if tiny is not None and tiny >= lim.tiny:
            # no reference value is small enough to flush: the zeros are rounding (the cancellation of
            # nearly equal terms, e.g. E[x^2] - E[x]^2), the low precision's lack of digits, not its range
            lines.append(f"{head}, within {run_dtype}'s range): rounding cancelled them (a difference of nearly "
                         "equal terms); precision is the problem, not the data")
            return False
        lines.append(f"{head}; {run_dtype} flushes below {lim.subnormal:.2g})")
        findings.append(finding(Cause.UNDERFLOW, 0.92, e, lines))
        findings.append(finding(Cause(kind), 0.6, e, lines[:1] + [
            f"secondary: {base or nbase} of the underflowed zero(s) gives {e.kind}; guarding the {kind} alone "
            "hides the lost precision"]))
        return True

    if e.phase is Phase.UPDATE:
        info = e.update_info or {}
        extra = [f"parameter {info.get('parameter')} ({info.get('optimizer', 'optimizer')}, lr "
                 f"{g(info.get('lr'))}, eps {g(info.get('eps'))})"] if info else []
        # what the update divides by (Adam's exp_avg_sq, RMSprop's/Adadelta's square_avg, Adagrad's sum,
        # Adamax's exp_inf)
        key = next((k for k in ("exp_avg_sq", "square_avg", "sum", "exp_inf") if f"{k}_zeros" in info), None)
        if key is not None:
            extra.append(f"{key}: {info[f'{key}_zeros']} of {info[f'{key}_numel']} entries are 0 "
                         f"(min {g(info[f'{key}_min'])})")
        if fam == "div" or (info.get("eps") == 0):
            return [finding(Cause.DIV, 0.93, e, lines + extra + [
                "the update divides by sqrt(second moment) + eps, and both are 0 for parameters whose gradient "
                "has been 0" if info.get("eps") == 0 and (key is None or info[f"{key}_zeros"])
                else "the update divided by zero"])]
        return []  # the divergence rule owns other update-phase blow-ups

    if fam == "log" or nbase in ("log", "log2", "log10", "log1p"):
        if underflow_check("log"):
            return findings
        if min_in is not None and min_in < 0:
            lines.append(f"log of negative input (min {g(min_in)})")
        elif n_zeros:
            lines.append(f"log of {n_zeros} exact zero(s)")
        return [finding(Cause.LOG, 0.9, e, lines)]
    if fam == "sqrt":
        if underflow_check("sqrt"):
            return findings
        if e.phase is Phase.BACKWARD:
            lines.append(f"the gradient of {nbase or base} is infinite where its input is 0 "
                         "(d/dx sqrt(x) = 1/(2 sqrt(x)))")
        elif min_in is not None and min_in < 0:
            lines.append(f"sqrt of negative input (min {g(min_in)})")
        return [finding(Cause.SQRT, 0.9, e, lines)]
    if fam == "domain":
        if base.startswith("pow") or nbase == "pow":
            exps = [s for s in e.scalars if isinstance(s, float)]
            if exps and 0 < abs(exps[0]) < 1 and e.phase is Phase.BACKWARD:
                return [finding(Cause.SQRT, 0.85, e, lines + [f"gradient of x**{exps[0]:g} is infinite at x = 0"])]
            if min_in is not None and min_in < 0 and e.kind == "nan":
                return [finding(Cause.DOMAIN, 0.9, e, lines + [f"pow of a negative base (min {g(min_in)}) with a "
                                                               f"fractional exponent {exps[0] if exps else ''}"])]
            if e.kind != "nan":
                if underflow_check("div"):
                    return findings
                return [finding(Cause.OVERFLOW if low else Cause.DIV, 0.7, e, lines)]
        return [finding(Cause.DOMAIN, 0.9, e, lines + [f"input outside the domain of {nbase or base} (min {g(min_in)}, "
                                                       f"max {g(max((s.max for s in ins), default=None))})"])]
    if fam == "div":
        if base == "_softmax" and e.kind == "nan":
            return [finding(Cause.DIV, 0.8, e, lines + [
                "softmax over a row whose entries are all -inf (a fully masked row): 0/0"])]
        if base.startswith("nll_loss") or base == "mean":
            return [finding(Cause.DIV, 0.8, e, lines + [
                "a mean over zero elements (0/0): every label ignored or an empty selection"])]
        if underflow_check("div"):
            return findings
        if n_zeros or e.kind == "nan":
            return [finding(Cause.DIV, 0.9, e, lines + [f"division by zero ({n_zeros} zero value(s) among the "
                                                        "inputs)"])]
        if low:
            return [finding(Cause.OVERFLOW, 0.8, e, lines + [
                f"the quotient exceeds the {e.out_dtype} maximum {dtype_max(e.out_dtype):g}"])]
        return [finding(Cause.DIV, 0.8, e, lines + ["division by a near-zero value"])]
    # exp and accumulations overflow; an op no family knows, only where the magnitudes say so
    past_max = probe is not None and probe.out_absmax is not None and probe.out_absmax > dtype_max(e.out_dtype)
    big = max((s.absmax for s in ins), default=0.0)
    if fam in ("exp", "accum") or (past_max if low else e.kind != "nan" and big > 1e30):
        return [_overflow(ev, e, fam, lines, low, ref_ok, probe)]
    return [unknown_origin(e, lines[1:])]


def _overflow(ev: Evidence, e, fam: str, lines: list[str], low: bool, ref_ok: bool | None, probe) -> Finding:
    big = max((s.absmax for s in e.inputs), default=None)
    if not low:
        if e.kind == "nan" and fam != "exp":
            # inf - inf or 0 * inf inside one op
            lines.append("the op itself combined an overflow with a subtraction or a zero (inf - inf, 0 * inf)")
        lines.append(f"exp of inputs up to {g(big)} (float32 exp overflows above 88.7)" if fam == "exp"
                     else f"inputs reach |x| = {g(big)}: the result exceeds the float32 maximum 3.4e38")
        return finding(Cause.OVERFLOW, 0.8, e, lines)
    conf = 0.85
    lim = dtype_max(e.out_dtype)
    if op_base(e.op) in ("_to_copy", "copy_") and big is not None and big > lim:
        lines.append(f"casting values up to |x| = {g(big)} to {e.out_dtype} (max {lim:g}) gives inf")
        conf = 0.95
    if probe is not None and probe.out_absmax is not None:
        lines.append(f"in {ev.reference.precision.value} the same op reaches |x| = {g(probe.out_absmax)} "
                     f"({'> ' if probe.out_absmax > lim else '<= '}{e.out_dtype} max {lim:g})")
        if probe.out_absmax > lim:
            conf = 0.95
    if ref_ok:
        conf = max(conf, 0.9)
    scale_lines, scale_conf = _scale_lines(ev, probe.out_absmax if probe is not None else None, lim)
    return finding(Cause.OVERFLOW, scale_conf if scale_lines else conf, e, lines + scale_lines)
