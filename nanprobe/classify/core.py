"""The classifier's core: the op-family registry, the evidence bundle, shared helpers, and
``classify`` (run every registered rule, merge, rank)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..judge.checks import DataProblem
from ..base.config import RunConfig
from ..locate.instrument import Event, Probe
from ..base.precision import limits
from ..reach.replay import Reached
from ..base.report import Cause, Finding, Phase, Status
from ..locate.rerun import StepTrace
from ..reach.target import Target

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

# node bases whose aten name is not just the lower-cased node name (SqrtBackward0 -> sqrt)
_NODE_ALIASES = {"LinalgVectorNorm": "linalg_vector_norm", "NativeLayerNorm": "native_layer_norm",
                 "NativeBatchNorm": "native_batch_norm"}


def op_base(op: str | None) -> str:
    """``aten.log.default`` -> ``log``."""
    if not op:
        return ""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]


def node_base(node: str | None) -> str:
    """``SqrtBackward0`` -> ``sqrt``."""
    m = re.match(r"([A-Za-z0-9]+?)Backward\d*$", node or "")
    return _NODE_ALIASES.get(m.group(1), m.group(1).lower()) if m else ""


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
    def target(self) -> Target:
        return self.reached.loop.target

    @property
    def reference_finite(self) -> bool | None:
        ref = self.reference
        if ref is None or ref.record is None:
            return None
        return ref.finite and not (ref.trace and ref.trace.events)


Rule = Callable[[Evidence], list[Finding]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    """Register a rule; classify runs them all."""
    RULES.append(fn)
    return fn


def g(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def where(e: Event) -> str:
    what = f"{e.node} ({e.op})" if e.node else e.op
    return f"{what} in {e.module or '(model)'}"


def finding(cause: Cause, conf: float, e: Event | None, evidence: list[str], *, phase: Phase | None = None,
             module: str | None = None, op: str | None = None) -> Finding:
    return Finding(cause=cause, confidence=max(0.0, min(conf, 0.99)),
                   phase=phase or (e.phase if e else Phase.FORWARD),
                   module=module if module is not None or e is None else e.module,
                   op=op if op is not None or e is None else (e.node or e.op), evidence=tuple(evidence))


def origin_line(e: Event) -> str:
    src = f" at {e.source}" if e.source else ""
    rows = f"; samples {list(e.samples)}" if e.samples else ""
    inputs = "inputs with no NaN" if any(s.nonfinite for s in e.inputs) else "finite inputs"
    return (f"{e.phase.value}: {where(e)} produced {e.kind} ({e.out_nonfinite} of {e.out_numel} values, "
            f"{e.out_dtype}) from {inputs}{src}{rows}")


def is_low(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16")


def dtype_max(dtype: str) -> float:
    return limits(getattr(torch, dtype)).max


def zeros(stats) -> int:
    return sum(s.zeros for s in stats)


def classify(ev: Evidence) -> list[Finding]:
    """Run every rule; merge duplicates (same cause) keeping the strongest; rank by confidence."""
    if ev.reached.status is Status.FINITE and ev.origin is None and ev.main.finite and not ev.data \
            and ev.reached.error is None:
        return []
    if scaler_skip_note(ev):
        return []   # GradScaler's normal back-off: the values overflow only because of the loss scale
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
            found[Cause.LR_SPIKE] = replace_conf(lr, lr.confidence * 0.5)
        elif Cause.OVERFLOW in found and lr.confidence > 0.5:
            found[Cause.OVERFLOW] = replace_conf(found[Cause.OVERFLOW], min(found[Cause.OVERFLOW].confidence,
                                                                        lr.confidence - 0.05))
    if not found and ev.origin is not None:
        f = unknown_origin(ev.origin)
        found[f.cause] = f
    if not found or entered(ev) is not None and Cause.DATA not in found:
        # a value from outside the step's ops: say where it entered, whatever else is found (a data finding
        # already says: the batch brought it)
        f = unknown_step(ev)
        if f is not None:
            found[f.cause] = f
    return sorted(found.values(), key=lambda f: -f.confidence)


def entered(ev: Evidence) -> Event | None:
    """The first op whose output was non-finite when no op of the step produced the value (a NaN constant,
    a tensor from outside the step), where the rerun saw no origin."""
    return ev.main.trace.entered if ev.origin is None and ev.main.trace is not None else None


def nonfinite_state(ev: Evidence) -> list[str]:
    """The model tensors that are already non-finite before the step (an earlier update or the checkpoint
    wrote them)."""
    return [name for name, t in ev.reached.snapshot.model.items()
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]


def raw_facts(ev: Evidence) -> list[str]:
    """What the replay and the instrumented rerun saw, in numbers."""
    rec = ev.reached.record
    lines = []
    if ev.reached.reason:
        lines.append(f"replay: {ev.reached.reason} at step {ev.reached.step}")
    if rec is not None:
        lines.append(f"step {rec.step}: loss {g(rec.loss)}, gradient norm {g(rec.grad_norm)}, lr {g(rec.lr)}"
                     + (f", |dw|/|w| {g(rec.update_ratio)}" if rec.update_ratio is not None else ""))
    if ev.main.record is not None:
        m = ev.main.record
        lines.append(f"the instrumented rerun: loss {g(m.loss)}, gradient norm {g(m.grad_norm)}, "
                     f"{ev.main.trace.ops_checked if ev.main.trace else 0} ops checked")
    return lines


def unknown_step(ev: Evidence) -> Finding | None:
    """A bad step no rule explained: still a finding, with the origin where one was seen, a low confidence and
    the raw facts (never an empty answer)."""
    e = entered(ev)
    if ev.reached.status is Status.FINITE and ev.main.finite and e is None and ev.reached.error is None:
        return None
    if e is not None and nonfinite_state(ev):
        return None   # the value entered from weights already non-finite: the corrupted-state rule says so
    if e is not None:
        scalars = [s for s in e.scalars if isinstance(s, float) and not math.isfinite(s)]
        src = f" at {e.source}" if e.source else ""
        return finding(Cause.UNKNOWN, 0.35, e, [
            f"{e.phase.value}: {where(e)} is the first op with a non-finite output ({e.kind}, {e.out_nonfinite} of "
            f"{e.out_numel} values, {e.out_dtype}){src}",
            "its input was already non-finite and no op of the step produced it: the value entered from outside "
            "the ops nanprobe checks" + (f" - a non-finite constant in the call ({', '.join(map(str, scalars))})"
                                        if scalars else " (a NaN/inf constant or Python float in your code, a "
                                        "tensor computed before the step or outside torch)"),
            *(f"input {i}: {s.numel} values, range {g(s.min)}..{g(s.max)}, {s.nonfinite} non-finite"
              for i, s in enumerate(e.inputs[:3])),
            *raw_facts(ev)])
    rec = ev.reached.record
    if rec is not None and rec.loss is not None and not math.isfinite(rec.loss):
        phase = Phase.FORWARD
    elif rec is not None and rec.grad_norm is not None and not math.isfinite(rec.grad_norm):
        phase = Phase.BACKWARD
    elif rec is not None and not rec.finite:
        phase = Phase.UPDATE
    else:
        phase = Phase.INPUT if ev.reached.status is Status.SPIKE else Phase.FORWARD
    return finding(Cause.UNKNOWN, 0.2, None, [
        *raw_facts(ev),
        "no op of the instrumented rerun produced a non-finite value and no rule explains the step: read the "
        "numbers above, and the fixes below for how to see more"], phase=phase)


def unknown_origin(e: Event, extra: list[str] | None = None) -> Finding:
    """No rule knows what this op's inf/NaN means: say what is known, with a low confidence.

    Never "overflow" by default: an unknown op that returns inf from finite inputs is most often
    evaluated outside where it is finite (a pole, a boundary), which is what ``domain`` means."""
    if e.phase is Phase.UPDATE:
        return finding(Cause.LR_SPIKE, 0.4, e, [origin_line(e), "the optimizer update turned finite gradients "
                                                "and weights into non-finite weights"])
    ins = e.inputs
    lo = min((s.min for s in ins), default=None)
    hi = max((s.max for s in ins), default=None)
    return finding(Cause.DOMAIN, 0.3, e, [origin_line(e), *(extra or []),
                                          f"unknown origin: no rule knows what {e.kind} from {e.node or e.op} "
                                          f"means (its finite inputs range from {g(lo)} to {g(hi)}); read as an "
                                          "input outside where the op is finite - check its domain"])


def scaler_skip_note(ev: Evidence) -> str | None:
    """The diagnosed step is one of GradScaler's normal skips (the judge found nothing wrong): the
    values overflow fp16 only because of the loss scale. The note says so; there is no finding."""
    rec = ev.reached.record
    if rec is None or not rec.skipped or ev.reached.status is not Status.FINITE or ev.reached.error is not None:
        return None
    e = ev.origin
    if e is not None and e.phase is Phase.FORWARD or any(p.level == "error" for p in ev.data):
        return None
    scale = rec.scale
    text = (f"GradScaler skipped step {ev.reached.step}" + (f" at loss scale {scale:g}" if scale else "") +
            ": the scaled gradients overflow fp16 (max 65504) and the scaler lowered its scale, as it should; "
            f"the loss ({g(rec.loss)}) is finite")
    probe = ev.probe if ev.probe is not None and ev.probe.found else None
    if e is not None and probe is not None and probe.out_absmax is not None:
        text += (f"; unscaled, {e.node or e.op} reaches |x| = {g(probe.out_absmax)} in "
                 f"{ev.reference.precision.value}, which fits fp16")
    return text


def replace_conf(f: Finding, conf: float) -> Finding:
    return dataclasses.replace(f, confidence=max(0.0, min(conf, 0.99)))


@dataclass(frozen=True, slots=True)
class GroupLR:
    """The optimizer param group that holds a parameter, and the other groups' LRs."""

    optimizer: str
    index: int
    count: int
    lr: float
    others: tuple[float, ...]

    @property
    def differs(self) -> bool:
        """Several groups and this one's LR is not theirs: the first group's LR does not speak for it."""
        return self.count > 1 and any(abs(o - self.lr) > 1e-12 * max(abs(self.lr), 1.0) for o in self.others)


def owning_group(ev: Evidence, parameter: str | None) -> GroupLR | None:
    """The param group (of the target's optimizers) holding ``parameter`` (a model parameter name)."""
    p = dict(ev.target.model.named_parameters()).get(parameter)
    if p is None:
        return None
    for name, opt in ev.target.optimizers:
        for i, group in enumerate(opt.param_groups):
            if any(q is p for q in group["params"]):
                lrs = [_as_float(gr.get("lr")) for gr in opt.param_groups]
                if lrs[i] is None:
                    return None
                return GroupLR(optimizer=name, index=i, count=len(lrs), lr=lrs[i],
                               others=tuple(x for j, x in enumerate(lrs) if j != i and x is not None))
    return None


def _as_float(x) -> float | None:
    if isinstance(x, torch.Tensor):
        return float(x.item()) if x.numel() == 1 else None
    return float(x) if isinstance(x, (int, float)) else None
