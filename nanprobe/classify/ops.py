"""What inf/NaN means for loss and reduction ops: the op-semantics registry.

The op-family rules read a non-finite value by arithmetic (a log of 0, a division by 0, a value
past the dtype's range). Loss and reduction ops have their own meaning: ``ctc_loss`` = inf is a
target with no valid alignment to its input; ``logsumexp``/``log_softmax``/``softmax`` over a row
that is entirely -inf is an empty set; ``kl_div`` with -inf log-probabilities is 0 * inf. Register
one function per op (aten base name such as ``_ctc_loss``, or autograd node base such as
``logsumexp``), or per call on the origin's source line (``kl_div``) for ops that decompose into
arithmetic before nanprobe sees them. A function returns findings, or None to let the family
rules decide.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..locate.instrument import Event
from ..base.report import Cause, Finding
from ..reach.step import batch_size
from .core import Evidence, dtype_max, finding, g, node_base, op_base, origin_line

Semantic = Callable[[Evidence, Event], "list[Finding] | None"]
_OPS: dict[str, Semantic] = {}
_CALLS: list[tuple[re.Pattern[str], str, Semantic]] = []


def register_semantics(*ops: str, calls: tuple[str, ...] = ()) -> Callable[[Semantic], Semantic]:
    """Register what a non-finite output means for ``ops`` (aten or autograd-node base names) and
    for origins whose source line calls one of ``calls``. Registering an op twice raises."""
    def deco(fn: Semantic) -> Semantic:
        for op in ops:
            if op in _OPS:
                raise ValueError(f"op {op!r} already has semantics ({_OPS[op].__name__})")
            _OPS[op] = fn
        for call in calls:
            _CALLS.append((re.compile(rf"\b{re.escape(call)}\s*\("), call, fn))
        return fn
    return deco


def semantics_for(e: Event) -> Semantic | None:
    fn = _OPS.get(op_base(e.op)) or (_OPS.get(node_base(e.node)) if e.node else None)
    if fn is None and e.code:
        fn = next((f for pat, _, f in _CALLS if pat.search(e.code)), None)
    return fn


def semantic_name(ev: Evidence) -> str | None:
    """The registered semantics that explained the origin (the fix catalog adapts to it)."""
    e = ev.origin
    if e is None:
        return None
    fn = semantics_for(e)
    return fn.__name__ if fn is not None and fn(ev, e) else None


def _has_inf_input(e: Event) -> bool:
    return any(s.nonfinite for s in e.inputs)   # NaN inputs make no origin: these are +-inf


def _rows(e: Event) -> str:
    return f" (samples {list(e.samples)})" if e.samples else ""


@register_semantics("_ctc_loss", "ctc_loss", "ctcloss")
def ctc_no_alignment(ev: Evidence, e: Event) -> list[Finding] | None:
    return [finding(Cause.DATA, 0.93, e, [
        origin_line(e),
        f"ctc_loss = inf means no valid alignment{_rows(e)}: a target longer than its input sequence (counting a "
        "blank between repeated labels) has probability 0, and -log 0 = inf; its gradient is NaN",
        "the data holds samples the model cannot emit: filter them (target_length + repeats <= input_length) or "
        "pass zero_infinity=True"])]


@register_semantics("logsumexp", "_log_softmax", "_softmax", "log_softmax", "softmax")
def empty_set(ev: Evidence, e: Event) -> list[Finding] | None:
    """A reduction over a row of -inf only: an empty set, not an intended mask passing through."""
    if not _has_inf_input(e):
        return None   # non-finite from finite inputs: the family rules (overflow, ...)
    name = op_base(e.op).lstrip("_") if not e.node else node_base(e.node)
    value = {"logsumexp": "log(0) = -inf", "log_softmax": "x - log(0) = -inf - (-inf) = NaN"}.get(
        name, "0/0 = NaN")
    return [finding(Cause.DATA, 0.85, e, [
        origin_line(e),
        f"{name} over a row whose entries are all -inf{_rows(e)}: an empty set - every candidate of that row was "
        f"masked out ({value})",
        "a mask that leaves a row with nothing (an anchor with no positive in the batch, a sequence with no valid "
        "position, a state with no legal action) is a property of the batch, not an intended mask: -inf in some "
        "entries is fine, in all of them it is not"])]


@register_semantics(calls=("kl_div", "KLDivLoss"))
def kl_div_zero_probability(ev: Evidence, e: Event) -> list[Finding] | None:
    lo = min((s.min for s in e.inputs), default=0.0)
    if _has_inf_input(e):
        return [finding(Cause.DATA, 0.96, e, [
            origin_line(e),
            "kl_div with -inf log-probabilities (zero probabilities, e.g. a truncated top-k teacher): with "
            "log_target=True it computes exp(t) * (t - input) = 0 * (-inf) = NaN for every zero-probability entry",
            f"code: {e.code}"])]
    if e.kind == "nan" and lo < 0:
        return [finding(Cause.DOMAIN, 0.9, e, [
            origin_line(e),
            f"kl_div's target must be probabilities >= 0 (min {g(lo)}): target * log(target) of a negative target "
            "is NaN; pass log-probabilities with log_target=True, or normalise the target (softmax)",
            f"code: {e.code}"])]
    return None


@register_semantics("nll_loss_forward", "nll_loss2d_forward")
def nll_no_target(ev: Evidence, e: Event) -> list[Finding] | None:
    if e.kind != "nan" or _has_inf_input(e):
        return None
    ii = ev.target.ignore_index
    return [finding(Cause.DATA, 0.85, e, [
        origin_line(e),
        f"nll_loss (cross_entropy) averaged over zero targets: every label of the batch is ignore_index ({ii}), "
        "or every present class has weight 0: 0/0 = NaN"])]


@register_semantics("std", "var", "std_mean", "var_mean")
def unbiased_over_one(ev: Evidence, e: Event) -> list[Finding] | None:
    """std/var over N <= 1 values: the unbiased estimator divides by N - 1 = 0 (or N = 0): 0/0 = NaN."""
    # how many input values each output summarised (input numel / output numel)
    n = e.inputs[0].numel // e.out_numel if e.inputs and e.out_numel else None
    if e.kind != "nan" or _has_inf_input(e) or n is None or n > 1:
        return None
    name = (node_base(e.node) if e.node else op_base(e.op)).lower()
    shape = e.inputs[0].shape
    lines = [origin_line(e),
             f"{name} over {n} value(s) per output (input shape {list(shape)}): the unbiased estimator divides the "
             f"sum of squared deviations by N - 1 = {n - 1}, so it computes 0/0 = NaN"]
    items = ev.reached.recorded.items
    size = batch_size(items[0]) if items else None
    if size is None or size > 1 or not shape or shape[0] != size:
        return [finding(Cause.DIV, 0.93, e, lines)]
    step = ev.reached.step
    return [finding(Cause.DIV, 0.93, e, lines + [
                f"the batch of step {step} holds {size} sample(s) and {name} reduces over the sample axis: a last, "
                "short batch (a loader without drop_last) or a per-class/per-group split of one"]),
            finding(Cause.DATA, 0.7, e, [
                f"step {step}: the batch holds {size} sample(s); {name} over the batch axis needs at least 2",
                "drop the short last batch (DataLoader(..., drop_last=True)) or use correction=0 (unbiased=False)"])]


@register_semantics("native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "native_batch_norm",
                    "_native_batch_norm_legit", "batch_norm")
def normalization(ev: Evidence, e: Event) -> list[Finding] | None:
    """A normalization layer fed extreme or constant inputs: its variance overflows (x^2 beyond the dtype's
    max gives inf, rstd 0, then inf * 0 = NaN), or a constant row has zero variance (with eps = 0)."""
    if _has_inf_input(e) or not e.inputs:
        return None
    x = e.inputs[0]
    lim = dtype_max(x.dtype) if x.dtype in ("float16", "bfloat16", "float32", "float64") else None
    name = node_base(e.node) if e.node else op_base(e.op)
    if lim is not None and x.absmax > 0 and x.absmax * x.absmax > lim:
        return [finding(Cause.OVERFLOW, 0.92, e, [
            origin_line(e),
            f"{name} of inputs up to |x| = {g(x.absmax)}: the variance squares them, and {g(x.absmax)}^2 exceeds the "
            f"{x.dtype} maximum {lim:g} (|x| above {g(lim ** 0.5)} overflows): var = inf, rstd = 0, inf * 0 = NaN",
            "an extreme value reached the normalization (an embedding row, a feature or a residual stream far out "
            "of range): find where it came from; a larger eps does not help"])]
    if x.zeros == x.numel or (x.absmax == 0):
        return [finding(Cause.DIV, 0.85, e, [
            origin_line(e), f"{name} of an all-zero input with eps = 0: zero variance, 0/0 = NaN"])]
    return None
