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

from ..instrument import Event
from ..report import Cause, Finding
from .core import Evidence, finding, g, node_base, op_base, origin_line

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
