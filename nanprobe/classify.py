"""Step traces -> ranked findings. Small rules, one op -> cause registry.

A rule looks at the evidence of one diagnosed step and returns zero or more ``Finding``s
(without fixes; ``fixes.attach`` adds them). Confidence is the ranking key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from .checks import DataProblem
from .config import RunConfig
from .instrument import Event, Probe
from .precision import limits
from .replay import Reached
from .report import Cause, Finding, Phase, Status, StepRecord
from .rerun import StepTrace

import torch

# -- op -> family registry -----------------------------------------------------------------------
_FAMILY: dict[str, str] = {}


def register_family(family: str, *ops: str) -> None:
    """Map aten base names (``log``) or autograd node bases (``Log``) to an op family."""
    for op in ops:
        if op in _FAMILY:
            raise ValueError(f"op {op!r} is already registered as {_FAMILY[op]!r}")
        _FAMILY[op] = family


register_family("log", "log", "log2", "log10", "log1p", "xlogy", "special_xlog1py", "_log_softmax", "logit")
register_family("sqrt", "sqrt", "rsqrt", "linalg_vector_norm", "norm", "_foreach_sqrt", "linalg_norm", "cdist",
                "_cdist_forward", "_euclidean_dist", "std", "std_mean", "var", "var_mean")
register_family("div", "div", "div_", "reciprocal", "true_divide", "addcdiv", "addcdiv_", "_foreach_div",
                "_foreach_div_", "_foreach_addcdiv", "_foreach_addcdiv_", "remainder", "fmod", "floor_divide",
                "nll_loss_forward", "nll_loss2d_forward", "mean", "_softmax", "cosine_similarity",
                "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit", "_foreach_reciprocal")
register_family("domain", "acos", "asin", "atanh", "acosh", "pow", "pow_", "_foreach_pow", "lgamma", "digamma",
                "polygamma", "erfinv", "mvlgamma")
register_family("exp", "exp", "exp2", "expm1", "sinh", "cosh", "_foreach_exp", "softplus", "elu", "selu", "celu")
register_family("accum", "mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
                "mkldnn_convolution", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_cudnn_attention", "sum", "mul", "mul_", "add", "add_", "sub", "sub_", "cumsum",
                "_to_copy", "copy_", "square", "einsum", "addcmul", "addcmul_", "_foreach_add", "_foreach_add_",
                "_foreach_mul", "_foreach_mul_", "_foreach_addcmul_", "_foreach_lerp_", "lerp_", "dot", "mv",
                "prod", "_fused_adam_", "_fused_adamw_", "gelu", "silu", "tanh", "sigmoid")

_NODE_ALIASES = {"LinalgVectorNorm": "linalg_vector_norm", "Norm": "norm", "Sqrt": "sqrt", "Rsqrt": "rsqrt",
                 "Log": "log", "Log2": "log2", "Log10": "log10", "Log1p": "log1p", "Div": "div", "Pow": "pow",
                 "Acos": "acos", "Asin": "asin", "Atanh": "atanh", "Acosh": "acosh", "Exp": "exp",
                 "Reciprocal": "reciprocal", "Std": "std", "Var": "var", "Cdist": "cdist",
                 "NativeLayerNorm": "native_layer_norm", "NativeBatchNorm": "native_batch_norm",
                 "Mean": "mean", "Lgamma": "lgamma", "Digamma": "digamma", "Erfinv": "erfinv", "Xlogy": "xlogy",
                 "Softplus": "softplus", "Expm1": "expm1", "Logit": "logit"}


def op_base(op: str | None) -> str:
    """``aten.log.default`` -> ``log``."""
    if not op:
        return ""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]


def node_base(node: str | None) -> str:
    """``SqrtBackward0`` -> ``sqrt``."""
    if not node:
        return ""
    m = re.match(r"([A-Za-z0-9]+?)Backward\d*$", node)
    if not m:
        return ""
    return _NODE_ALIASES.get(m.group(1), m.group(1).lower())


def family_of(event: Event) -> str:
    if event.phase is Phase.BACKWARD:
        fam = _FAMILY.get(node_base(event.node))
        if fam:
            return fam
    return _FAMILY.get(op_base(event.op), "other")


# -- evidence bundle ------------------------------------------------------------------------------
@dataclass(slots=True)
class Evidence:
    reached: Reached
    main: StepTrace
    reference: StepTrace | None
    probe: Probe | None
    others: dict[str, StepTrace]
    data: list[DataProblem]
    cfg: RunConfig
    entry: str = ""

    @property
    def origin(self) -> Event | None:
        return self.main.origin

    @property
    def reference_finite(self) -> bool | None:
        if self.reference is None or self.reference.record is None:
            return None
        return self.reference.finite and not self.reference.trace.events if self.reference.trace else \
            self.reference.finite


Rule = Callable[[Evidence], list[Finding]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def _g(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _where(e: Event) -> str:
    mod = e.module if e.module not in (None, "") else "(model)"
    what = f"{e.node} ({e.op})" if e.node else e.op
    return f"{what} in {mod}"


def _finding(cause: Cause, conf: float, e: Event | None, evidence: list[str], *, phase: Phase | None = None,
             module: str | None = None, op: str | None = None) -> Finding:
    return Finding(cause=cause, confidence=max(0.0, min(conf, 0.99)),
                   phase=phase or (e.phase if e else Phase.FORWARD),
                   module=module if module is not None or e is None else e.module,
                   op=op if op is not None or e is None else (e.node or e.op), evidence=tuple(evidence))


def _origin_line(e: Event) -> str:
    src = f" at {e.source}" if e.source else ""
    rows = f"; samples {list(e.samples)}" if e.samples else ""
    return (f"{e.phase.value}: {_where(e)} produced {e.kind} ({e.out_nonfinite} of {e.out_numel} values, "
            f"{e.out_dtype}) from finite inputs{src}{rows}")


def _is_low(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16")


def _dtype_max(dtype: str) -> float:
    return limits(getattr(torch, dtype)).max


def _zeros(stats) -> int:
    return sum(s.zeros for s in stats)


# -- rules ----------------------------------------------------------------------------------------
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
        lines.append("it surfaces as " + _origin_line(ev.origin))
    return [_finding(Cause.DATA, conf, None, lines, phase=Phase.INPUT, module=None, op=None)]


def _lr_evidence(ev: Evidence) -> tuple[list[str], str | None, float]:
    """Lines showing an LR jump / exploding update in the steps before; the module with the largest update."""
    cfg = ev.cfg
    hist: list[StepRecord] = list(ev.reached.history)
    lines: list[str] = []
    strength = 0.0
    lrs = [h.lr for h in hist if h.lr is not None]
    cur = ev.reached.record.lr if ev.reached.record else None
    if lrs and cur is not None:
        base = statistics.median(lrs[: max(1, len(lrs) // 2)])
        peak = max(lrs[-3:] + [cur])
        if base > 0 and peak > cfg.lr_jump_factor * base:
            lines.append(f"learning rate rose from {_g(base)} to {_g(peak)} ({peak / base:.0f}x) in the steps "
                         f"before step {ev.reached.step}")
            strength = max(strength, 0.6)
    ratios = [(h.step, h.update_ratio) for h in hist[-5:] if h.update_ratio is not None]
    big = [(s, r) for s, r in ratios if r > cfg.update_ratio_limit]
    if big:
        s, r = max(big, key=lambda x: x[1])
        lines.append(f"update ratio |dw|/|w| reached {_g(r)} at step {s} (limit {cfg.update_ratio_limit:g})")
        strength = max(strength, 0.75) + (0.15 if strength else 0)
    this_ratio = ev.main.record.update_ratio if ev.main.record else None
    if this_ratio is not None and (this_ratio > cfg.update_ratio_limit or
                                   (not math.isfinite(this_ratio) and ev.origin is not None)) \
            and (ev.origin is None or ev.origin.phase is Phase.UPDATE):
        lines.append(f"this step's update ratio |dw|/|w| is {_g(this_ratio)}")
        strength = max(strength, 0.7)
    sched = ev.reached.scheduler_base_lrs
    if cur is not None and sched and cur > max(sched) * 1.0001 and ev.reached.scheduler_kind in ("LambdaLR",
                                                                                               "MultiplicativeLR"):
        lines.append(f"{ev.reached.scheduler_kind} drives the LR to {_g(cur)}, {cur / max(sched):.3g}x its base "
                     f"LR {_g(max(sched))}: the multiplier should stay <= 1")
        strength = max(strength, 0.5) + (0.2 if strength else 0)
    norms = [h.grad_norm for h in hist if h.grad_norm is not None and math.isfinite(h.grad_norm)]
    if len(norms) >= 4 and norms[-1] > 100 * statistics.median(norms[:-1]):
        lines.append(f"gradient norm grew to {_g(norms[-1])} (median {_g(statistics.median(norms[:-1]))})")
        strength = max(strength, 0.5)
    module = None
    source = ev.reached.update_ratios or ev.main.update_ratios
    if source:
        pname = max(source, key=lambda k: source[k] if math.isfinite(source[k]) else float("inf"))
        module = pname.rsplit(".", 1)[0] if "." in pname else ""
        lines.insert(0, f"largest relative update: {pname} ({_g(source[pname])})")
    return lines, module, strength


@rule
def lr_rule(ev: Evidence) -> list[Finding]:
    e = ev.origin
    if e is not None and e.phase is Phase.UPDATE and family_of(e) == "div":
        return []  # a division in the optimizer (eps = 0), not a step size problem
    lines, module, strength = _lr_evidence(ev)
    if ev.reached.status is Status.SPIKE and not strength:
        strength = 0.55
        lines.insert(0, ev.reached.reason or "loss spike")
    if not strength:
        return []
    conf = strength
    if any(p.level == "error" for p in ev.data):
        conf -= 0.4  # bad data explains the blow-up better
    if ev.reference_finite is False or (e is not None and not _is_low(e.out_dtype)):
        conf += 0.15  # not a precision problem: the reference diverges too
    if e is not None and e.phase is Phase.UPDATE and family_of(e) != "div":
        conf += 0.1
    if ev.reached.reason:
        lines.insert(0, f"replay: {ev.reached.reason} at step {ev.reached.step}")
    return [_finding(Cause.LR_SPIKE, conf, None, lines, phase=Phase.UPDATE, module=module, op=None)]


@rule
def not_reproduced_rule(ev: Evidence) -> list[Finding]:
    if ev.reached.status is not Status.NONFINITE or ev.origin is not None or not ev.main.finite:
        return []
    return [_finding(Cause.NOT_REPRODUCED, 0.9, None, [
        f"replay saw {ev.reached.reason} at step {ev.reached.step}",
        f"the rerun of the same step from the same state, batch and RNG is finite (loss {_g(ev.main.record.loss)})",
        "suspect nondeterminism (atomics, thread count, cuDNN autotune) or hardware (ECC errors, overheating)",
    ], phase=Phase.FORWARD, module=None, op=None)]


@rule
def corrupted_state_rule(ev: Evidence) -> list[Finding]:
    """Weights or buffers already non-finite before the step: an earlier update (or the checkpoint) did it."""
    if ev.origin is not None or ev.main.finite:
        return []
    bad = [name for name, t in ev.reached.snapshot.model.items()
           if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]
    if not bad:
        return []
    module = bad[0].rsplit(".", 1)[0] if "." in bad[0] else ""
    return [_finding(Cause.LR_SPIKE, 0.5, None, [
        f"{len(bad)} tensor(s) of the model are already non-finite before step {ev.reached.step} "
        f"(first: {bad[0]}); nothing in this step produced them",
        f"an earlier update (or the checkpoint {ev.reached.reached_by!r} started from) wrote them: "
        "diagnose an earlier step with --at, or check the checkpoint",
    ], phase=Phase.UPDATE, module=module, op=None)]


@rule
def origin_rule(ev: Evidence) -> list[Finding]:
    e = ev.origin
    if e is None:
        return []
    fam = family_of(e)
    base = op_base(e.op)
    nbase = node_base(e.node)
    low = _is_low(e.out_dtype)
    ref_ok = ev.reference_finite
    probe = ev.probe if ev.probe is not None and ev.probe.found else None
    lines = [_origin_line(e)]
    if e.masked:
        lines.append("the non-finite value was masked before the loss (torch.where / masked_fill / relu): the loss "
                     "stays finite but the gradient of the masked branch is NaN")
    if e.code:
        lines.append(f"code: {e.code}")
    ins = e.inputs
    findings: list[Finding] = []
    min_in = min((s.min for s in ins), default=None)
    zeros = _zeros(ins)
    if low and ref_ok:
        lines.append(f"the same step in {ev.reference.precision.value} is finite (loss {_g(ev.reference.record.loss)})")

    def underflow_check(kind: str) -> bool:
        """Zeros in the low-precision inputs that are non-zero in the reference.

        The op itself may run in float32 (CUDA autocast upcasts log, exp, pow...) while its zero
        input was flushed upstream in fp16: what matters is that the run is in low precision.
        """
        if not ev.reached.precision.low or probe is None or probe.inputs is None:
            return False
        ref_zeros = _zeros(probe.inputs)
        if zeros > ref_zeros:
            tiny = min((s.min_nonzero for s in probe.inputs if s.min_nonzero is not None), default=None)
            run_dtype = str(ev.reached.precision.dtype).replace("torch.", "")
            lim = limits(ev.reached.precision.dtype)
            lines.append(f"{zeros - ref_zeros} input value(s) of {e.op} are exactly 0 in the {ev.reached.precision.value} "
                         f"run but non-zero in {ev.reference.precision.value} (smallest {_g(tiny)}; {run_dtype} "
                         f"flushes below {lim.subnormal:.2g})")
            findings.append(_finding(Cause.UNDERFLOW, 0.92, e, lines))
            findings.append(_finding(Cause(kind), 0.6, e, lines[:1] + [
                f"secondary: {base or nbase} of the underflowed zero(s) gives {e.kind}; guarding the {kind} alone "
                "hides the lost precision"]))
            return True
        return False

    if e.phase is Phase.UPDATE:
        info = e.update_info or {}
        extra = []
        if info:
            extra.append(f"parameter {info.get('parameter')} ({info.get('optimizer', 'optimizer')}, lr "
                         f"{_g(info.get('lr'))}, eps {_g(info.get('eps'))})")
            if "exp_avg_sq_zeros" in info:
                extra.append(f"exp_avg_sq: {info['exp_avg_sq_zeros']} of {info['exp_avg_sq_numel']} entries are 0 "
                             f"(min {_g(info['exp_avg_sq_min'])})")
        if fam == "div" or (info.get("eps") == 0):
            return [_finding(Cause.DIV, 0.93, e, lines + extra + [
                "the update divides by sqrt(second moment) + eps, and both are 0 for parameters whose gradient "
                "has been 0" if info.get("eps") == 0 else "the update divided by zero"])]
        return []  # the LR rule owns other update-phase blow-ups

    if fam == "log" or nbase in ("log", "log2", "log10", "log1p"):
        if underflow_check("log"):
            return findings
        if min_in is not None and min_in < 0:
            lines.append(f"log of negative input (min {_g(min_in)})")
        elif zeros:
            lines.append(f"log of {zeros} exact zero(s)")
        return [_finding(Cause.LOG, 0.9, e, lines)]
    if fam == "sqrt":
        if underflow_check("sqrt"):
            return findings
        if e.phase is Phase.BACKWARD:
            lines.append(f"the gradient of {nbase or base} is infinite where its input is 0 "
                         "(d/dx sqrt(x) = 1/(2 sqrt(x)))")
        elif min_in is not None and min_in < 0:
            lines.append(f"sqrt of negative input (min {_g(min_in)})")
        return [_finding(Cause.SQRT, 0.9, e, lines)]
    if fam == "domain":
        if base.startswith("pow") or nbase == "pow":
            exps = [s for s in e.scalars if isinstance(s, float)]
            if exps and 0 < abs(exps[0]) < 1 and e.phase is Phase.BACKWARD:
                lines.append(f"gradient of x**{exps[0]:g} is infinite at x = 0")
                return [_finding(Cause.SQRT, 0.85, e, lines)]
            if min_in is not None and min_in < 0 and e.kind == "nan":
                lines.append(f"pow of a negative base (min {_g(min_in)}) with a fractional exponent "
                             f"{exps[0] if exps else ''}")
                return [_finding(Cause.DOMAIN, 0.9, e, lines)]
            if e.kind != "nan":
                if underflow_check("div"):
                    return findings
                return [_finding(Cause.OVERFLOW if low else Cause.DIV, 0.7, e, lines)]
        lines.append(f"input outside the domain of {nbase or base} (min {_g(min_in)}, max "
                     f"{_g(max((s.max for s in ins), default=None))})")
        return [_finding(Cause.DOMAIN, 0.9, e, lines)]
    if fam == "div":
        if base == "_softmax" and e.kind == "nan":
            lines.append("softmax over a row whose entries are all -inf (a fully masked row): 0/0")
            return [_finding(Cause.DIV, 0.8, e, lines)]
        if base.startswith("nll_loss") or base == "mean":
            lines.append("a mean over zero elements (0/0): every label ignored or an empty selection")
            return [_finding(Cause.DIV, 0.8, e, lines)]
        if underflow_check("div"):
            return findings
        if zeros or e.kind == "nan":
            lines.append(f"division by zero ({zeros} zero value(s) among the inputs)")
            return [_finding(Cause.DIV, 0.9, e, lines)]
        if low:
            return [_finding(Cause.OVERFLOW, 0.8, e, lines + [
                f"the quotient exceeds the {e.out_dtype} maximum {_dtype_max(e.out_dtype):g}"])]
        lines.append("division by a near-zero value")
        return [_finding(Cause.DIV, 0.8, e, lines)]
    if fam == "exp" or fam == "accum" or fam == "other":
        if e.kind == "nan" and fam != "exp" and not low:
            # inf - inf or 0 * inf inside one op
            lines.append("the op itself combined an overflow with a subtraction or a zero (inf - inf, 0 * inf)")
        conf = 0.85
        if low and base in ("_to_copy", "copy_"):
            big = max((s.absmax for s in ins), default=None)
            lim = _dtype_max(e.out_dtype)
            if big is not None and big > lim:
                lines.append(f"casting values up to |x| = {_g(big)} to {e.out_dtype} (max {lim:g}) gives inf")
                conf = 0.95
        if low:
            lim = _dtype_max(e.out_dtype)
            if probe is not None and probe.out_absmax is not None:
                lines.append(f"in {ev.reference.precision.value} the same op reaches |x| = {_g(probe.out_absmax)} "
                             f"({'> ' if probe.out_absmax > lim else '<= '}{e.out_dtype} max {lim:g})")
                if probe.out_absmax > lim:
                    conf = 0.95
            if ref_ok:
                conf = max(conf, 0.9)
        else:
            big = max((s.absmax for s in ins), default=None)
            if fam == "exp":
                lines.append(f"exp of inputs up to {_g(big)} (float32 exp overflows above 88.7)")
            else:
                lines.append(f"inputs reach |x| = {_g(big)}: the result exceeds the float32 maximum 3.4e38")
            conf = 0.8
        return [_finding(Cause.OVERFLOW, conf, e, lines)]
    return []


def classify(ev: Evidence) -> list[Finding]:
    """Run every rule; merge duplicates (same cause) keeping the strongest; rank by confidence."""
    if ev.reached.status is Status.FINITE and ev.origin is None and ev.main.finite and not ev.data:
        return []
    found: dict[Cause, Finding] = {}
    for r in RULES:
        for f in r(ev):
            old = found.get(f.cause)
            if old is None or f.confidence > old.confidence:
                found[f.cause] = f
    if ev.origin is not None and ev.origin.phase is not Phase.UPDATE and Cause.LR_SPIKE in found:
        # a precision overflow with a finite reference is not an LR problem, and vice versa
        lr = found[Cause.LR_SPIKE]
        if ev.reference_finite:
            found[Cause.LR_SPIKE] = _replace_conf(lr, lr.confidence * 0.5)
        elif Cause.OVERFLOW in found:
            found[Cause.OVERFLOW] = _replace_conf(found[Cause.OVERFLOW], min(found[Cause.OVERFLOW].confidence,
                                                                         lr.confidence - 0.05))
    if not found and ev.origin is not None:
        f = _fallback(ev.origin)
        found[f.cause] = f
    return sorted(found.values(), key=lambda f: -f.confidence)


def _fallback(e: Event) -> Finding:
    """No specific rule matched: say what is known, with a low confidence."""
    if e.phase is Phase.UPDATE:
        return _finding(Cause.LR_SPIKE, 0.4, e, [_origin_line(e), "the optimizer update turned finite gradients "
                                                 "and weights into non-finite weights"])
    cause = Cause.OVERFLOW if "inf" in e.kind else Cause.DOMAIN
    return _finding(cause, 0.35, e, [_origin_line(e), f"no specific rule for {e.node or e.op}: {e.kind} from "
                                     "finite inputs reads as " + ("an overflow" if cause is Cause.OVERFLOW
                                                                  else "an out-of-domain input")])


def _replace_conf(f: Finding, conf: float) -> Finding:
    return dataclasses.replace(f, confidence=max(0.0, min(conf, 0.99)))
