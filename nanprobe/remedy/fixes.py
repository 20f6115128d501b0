"""The fix catalog: mechanism and cause -> Fix templates adapted to the finding.

Each template gets the finding and the evidence and returns a Fix (or None when it does not
apply). A finding's fixes are its mechanism's first (qk-layernorm, z-loss, LR, AdamW eps/beta2,
weight decay), then its cause's (precision changes last among the numeric ones): ranked by the
evidence, not by what is easiest to check. A template may carry a remedy: the fix as changes
nanprobe can apply from outside the user's code (:class:`nanprobe.remedy.Remedy`); ``attach``
hands the top finding's fixes and remedies to the horizon verifier (nanprobe/remedy/horizon.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..classify import Evidence, explained_by, op_base, semantic_name
from ..classify.raised import LABEL_OUT_OF_RANGE
from ..classify.core import entered, owning_group
from ..classify.rules import constant, largest_update, lrs_seen, multiplier_above_one
from ..base.errors import short_path
from ..locate.instrument import LOSS_FN
from ..base.precision import Precision
from .change import Remedy
from ..base.report import Cause, Finding, Fix, Mechanism, Phase, Status

RemedyFn = Callable[[Finding, Evidence], Remedy | None]


@dataclass(frozen=True, slots=True)
class Template:
    build: Callable[[Finding, Evidence], Fix | None]
    verify: RemedyFn | None = None      # the fix applied from outside the user's code, for the horizon


CATALOG: dict[Cause, list[Template]] = {c: [] for c in Cause}
MECHANISMS: dict[Mechanism, list[Template]] = {m: [] for m in Mechanism}


def fix_for(*keys: Cause | Mechanism, verify: RemedyFn | None = None):
    """Register a template for causes and mechanisms (in registration order: the order they rank in)."""
    def deco(fn: Callable[[Finding, Evidence], Fix | None]):
        for k in keys:
            (MECHANISMS if isinstance(k, Mechanism) else CATALOG)[k].append(Template(fn, verify))
        return fn
    return deco


def _static(*causes: Cause, when: Callable[[Finding, Evidence], bool], title: str, code: str, why: str,
            src: bool = False) -> None:
    """Register a fix of fixed text for the findings ``when`` picks (``src``: the origin's line after the code)."""
    fix_for(*causes)(lambda f, ev: Fix(title=title.format(mod=_mod(f)), code=code + (_src(ev) if src else ""),
                                       why=why) if when(f, ev) else None)


def _kind_is(kind: str) -> Callable[[Finding, Evidence], bool]:
    return lambda f, ev: _kind(ev) == kind


def _op_in(*ops: str) -> Callable[[Finding, Evidence], bool]:
    return lambda f, ev: ev.origin is not None and op_base(ev.origin.op) in ops


def _mod(f: Finding) -> str:
    return f.module if f.module not in (None, "", LOSS_FN) else "model"


def _attr(name: str | None) -> str:
    """Python expression for the module: model.blocks[1].attn."""
    parts = name.split(".") if name and name != LOSS_FN else []
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts)


def _src(ev: Evidence) -> str:
    e = ev.origin
    return f"\n# was, at {e.source}: {e.code}" if e is not None and e.source and e.code else ""


def _device(ev: Evidence) -> str:
    return "cuda" if ev.reached.loop.device_type == "cuda" else "cpu"


def _kind(ev: Evidence) -> str | None:
    """Which op or error semantics explained the step (e.g. ``ctc_no_alignment``, ``embedding_index``)."""
    return explained_by(ev.reached.error) or semantic_name(ev)


def _group(ev: Evidence) -> dict[str, Any]:
    """The first param group of the first optimizer ({} without one)."""
    opts = ev.target.optimizers
    return opts[0][1].param_groups[0] if opts and opts[0][1].param_groups else {}


# -- mechanisms (a finding's mechanism ranks its fixes first) ---------------------------------------
def _module_of(ev: Evidence, name: str | None) -> torch.nn.Module | None:
    if not name or name == LOSS_FN:
        return None
    try:
        return ev.target.model.get_submodule(name)
    except AttributeError:
        return None


_ATTENTION_LINE = re.compile(r"@|matmul|bmm|einsum|scaled_dot_product_attention")


def _forward_at(module: torch.nn.Module | None) -> tuple[str | None, str | None]:
    """Where the module's class defines forward ("model.py:40"), and its attention line ("model.py:44: ...")."""
    if module is None:
        return None, None
    fwd = type(module).forward
    try:
        lines, start = inspect.getsourcelines(fwd)
        file = short_path(inspect.getsourcefile(fwd) or "")
    except (TypeError, OSError):
        return None, None
    for i, line in enumerate(lines):
        if _ATTENTION_LINE.search(line) and not line.strip().startswith("#"):
            return f"{file}:{start}", f"{file}:{start + i}: {line.strip()}"
    return f"{file}:{start}", None


def _same_class(ev: Evidence, name: str | None) -> tuple[str, ...]:
    """Every module of the named module's class (a change to the class applies to them all)."""
    module = _module_of(ev, name)
    if module is None:
        return ()
    return tuple(n for n, m in ev.target.model.named_modules() if type(m) is type(module))


@fix_for(Mechanism.ATTENTION_LOGIT_GROWTH,
         verify=lambda f, ev: Remedy(qk_norm=_same_class(ev, f.module)) if _same_class(ev, f.module) else None)
def _qk_layernorm(f: Finding, ev: Evidence) -> Fix | None:
    module = _module_of(ev, f.module)
    cls = type(module).__name__ if module is not None else "your attention module"
    fwd, line = _forward_at(module)
    head = getattr(module, "head_dim", None) or "head_dim"
    code = (f"# in {cls} ({_attr(f.module)}{f', forward at {fwd}' if fwd else ''}): LayerNorm on q and k\n"
            f"# in __init__:\nself.q_norm = nn.LayerNorm({head})\nself.k_norm = nn.LayerNorm({head})\n"
            f"# in forward, after q and k are split into heads, before the scores:\n"
            f"q, k = self.q_norm(q), self.k_norm(k)\n"
            + (f"# then as before, at {line}" if line else
               "scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)   # or F.scaled_dot_product_attention"))
    return Fix(title=f"Add qk-layernorm to {cls} ({_mod(f)}): normalise q and k before q @ k^T", code=code,
               why="at a high LR the pre-softmax logits q . k grow until the attention collapses onto one token "
                   "(entropy near 0) and the loss breaks or a low-precision op overflows; normalised q and k "
                   "bound the logits whatever the weights do (Dehghani et al. 2023, Wortsman et al. 2023)")


@fix_for(Mechanism.OUTPUT_LOGIT_DIVERGENCE,
         verify=lambda f, ev: Remedy(z_loss=(f.module, 1e-4)) if _module_of(ev, f.module) is not None else None)
def _z_loss(f: Finding, ev: Evidence) -> Fix | None:
    name = _mod(f)
    return Fix(title=f"Add z-loss on the logits of {name} (1e-4 * logsumexp^2)",
               code=f"logits = model(inputs)                 # the output of {name}\n"
                    "loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())\n"
                    "z = torch.logsumexp(logits.float(), dim=-1)\n"
                    "loss = loss + 1e-4 * z.pow(2).mean()   # z-loss: keeps log Z near 0",
               why="the softmax is invariant to a shift of all logits, so nothing stops log Z (logsumexp) from "
                   "drifting until the logits leave the dtype's range; z-loss pulls it back to 0 (PaLM, "
                   "Wortsman et al. 2023)")


def _adam_change(ev: Evidence, key: str) -> tuple[Any, Any] | None:
    """(was, new) of the group key an Adam-second-moment fix changes; None where it is already safe."""
    g = _group(ev)
    if "betas" not in g or "eps" not in g:
        return None
    if key == "betas":
        return (tuple(g["betas"]), (g["betas"][0], 0.95)) if g["betas"][1] > 0.95 else None
    return (g["eps"], 1e-6) if g["eps"] < 1e-6 else None


def _adam_remedy(key: str) -> RemedyFn:   # (a template's remedy is asked for only when its fix applies)
    return lambda f, ev: Remedy(param_overrides=((key, _adam_change(ev, key)[1]),))


def _adam_fix(ev: Evidence, key: str, title: str, why: str) -> Fix | None:
    change = _adam_change(ev, key)
    if change is None:
        return None
    was, new = change
    return Fix(title=title.format(opt=_opt_name(ev), was=was),
               code=f"optimizer = torch.optim.{_opt_name(ev)}(model.parameters(), lr=..., {key}={new!r})"
                    f"  # was {key}={was!r}", why=why)


@fix_for(Mechanism.ADAM_SECOND_MOMENT, verify=_adam_remedy("betas"))
def _adam_beta2(f: Finding, ev: Evidence) -> Fix | None:
    return _adam_fix(ev, "betas", "Lower {opt}'s beta2 to 0.95 (betas are {was})",
                     "with a slow second moment v lags behind a gradient that grows again after a quiet stretch: "
                     "m / sqrt(v) becomes huge; beta2 0.95 lets v follow the gradient")


@fix_for(Mechanism.ADAM_SECOND_MOMENT, verify=_adam_remedy("eps"))
def _adam_eps(f: Finding, ev: Evidence) -> Fix | None:
    return _adam_fix(ev, "eps", "Raise {opt}'s eps to 1e-6 (it is {was:g})",
                     "where the gradient's RMS falls toward eps, sqrt(v) no longer bounds the update m / (sqrt(v) + "
                     "eps); a larger eps caps the step of parameters whose second moment collapsed")


LOWER_LR = 0.3   # the lower peak LR the mechanism fixes propose and verify: this times the run's


def ascent(f: Finding) -> bool:
    """The finding says the applied update climbs the gradient (an LR applied inside the optimizer below 0)."""
    return f.mechanism is Mechanism.LR_SCHEDULE and any("climbs the gradient" in e for e in f.evidence)


@fix_for(Mechanism.ATTENTION_LOGIT_GROWTH, Mechanism.LR_SCHEDULE, Mechanism.OUTPUT_LOGIT_DIVERGENCE,
         Mechanism.ADAM_SECOND_MOMENT, Mechanism.ACTIVATION_GROWTH,
         verify=lambda f, ev: Remedy(lr_scale=LOWER_LR))
def _lower_peak_lr(f: Finding, ev: Evidence) -> Fix | None:
    if ascent(f):
        return None
    peak = max(lrs_seen(ev.reached), default=None)
    was = f"  # was {peak:.3g}" if peak else ""
    lr = f"{peak * LOWER_LR:.3g}" if peak else f"{LOWER_LR} * peak_lr"
    longer = " or warm up longer" if f.mechanism is Mechanism.ATTENTION_LOGIT_GROWTH else ""
    return Fix(title=f"Lower the peak learning rate ({LOWER_LR:g}x){longer}",
               code=f"optimizer = torch.optim.{_opt_name(ev)}(model.parameters(), lr={lr}){was}\n"
                    "# keep the schedule's shape (warmup, decay): it multiplies the new peak"
                    + ("\n# or keep the peak and warm up over several times more steps" if longer else ""),
               why="the growth is driven by the step size: Adam moves every weight by about the LR per step, so "
                   "the logits and activations grow with it; a lower peak keeps them in range")


@fix_for(Mechanism.LR_SCHEDULE, verify=lambda f, ev: Remedy(warmup=2 * max(ev.reached.step, 1)))
def _longer_warmup(f: Finding, ev: Evidence) -> Fix | None:
    if ascent(f):
        return None
    steps = 2 * max(ev.reached.step, 1)
    return Fix(title=f"Warm up longer: over {steps} steps",
               code=f"warmup = {steps}  # steps: twice the step the run failed at\n"
                    "scheduler = torch.optim.lr_scheduler.LambdaLR(\n"
                    "    optimizer, lambda step: min(1.0, (step + 1) / warmup) * your_decay(step))",
               why="the run broke while the LR was still rising to (or had just reached) its peak: a longer "
                   "warmup lets the weights and Adam's moments settle before the full step size")


@fix_for(Mechanism.LR_SCHEDULE)
def _applied_lr(f: Finding, ev: Evidence) -> Fix | None:
    if not ascent(f):
        return None
    opt = _opt_name(ev)
    return Fix(title=f"Fix the LR {opt} applies inside step(): it turns negative past its schedule's end",
               code="# the schedule inside the optimizer must span the steps it is stepped, e.g. BertAdam's:\n"
                    "t_total = len(train_dataloader) // gradient_accumulation_steps * num_epochs  # optimizer steps\n"
                    f"optimizer = {opt}(model.parameters(), lr=lr, warmup=0.1, t_total=t_total)\n"
                    "# or clamp the factor it multiplies the LR by: max(0.0, 1.0 - progress)",
               why="a factor like warmup_linear's 1 - progress goes below 0 once progress passes 1: the update "
                   "then points up the gradient (its cosine with -grad is negative) and every step undoes learning; "
                   "a lower or warmed-up LR only makes the ascent slower")


@fix_for(Mechanism.OUTPUT_LOGIT_DIVERGENCE, Mechanism.ACTIVATION_GROWTH,
         verify=lambda f, ev: Remedy(param_overrides=(("weight_decay", 0.1),))
         if ev.target.optimizers and _opt_name(ev) == "AdamW" else None)
def _weight_decay(f: Finding, ev: Evidence) -> Fix | None:
    wd = _group(ev).get("weight_decay", 0)
    if wd >= 0.1:
        return None
    return Fix(title="Use decoupled weight decay 0.1 (AdamW)",
               code=f"optimizer = torch.optim.AdamW(model.parameters(), lr=..., weight_decay=0.1)  # was {wd:g}"
                    + ("" if _opt_name(ev) == "AdamW" else f" with {_opt_name(ev)}"),
               why="weight decay pulls the weights' norm back every step, so the logits and activations they "
                   "produce cannot grow without bound")


# -- op and error semantics (first: the specific fix before the generic ones) ----------------------
_static(Cause.DATA, when=_kind_is("ctc_no_alignment"), src=True,
        title="Drop (or zero) the CTC samples that have no valid alignment",
        code="# a target needs input_length >= target_length + (number of repeated neighbours)\n"
             "loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, zero_infinity=True)\n"
             "# better, in the dataset: skip utterances whose transcript is too long for the audio\n"
             "repeats = (targets[:, 1:] == targets[:, :-1]).sum(1)   # (count within target_lengths if padded)\n"
             "keep = input_lengths >= target_lengths + repeats",
        why="an impossible alignment has probability 0: -log 0 = inf and its gradient is NaN; "
            "zero_infinity=True gives those samples loss 0 and gradient 0")

_static(Cause.DATA, when=_kind_is("empty_set"), src=True,
        title="Leave rows that have nothing to reduce over out of the loss",
        code="has_any = mask.any(dim=-1)                 # rows with at least one candidate\n"
             "scores = scores.masked_fill(~mask, float('-inf'))\n"
             "lse = torch.logsumexp(scores[has_any], dim=-1)  # (or log_softmax / softmax) on those rows only\n"
             "# and make the sampler put >= 1 positive per anchor (e.g. 2+ samples per class)",
        why="-inf in some entries is an intended mask; -inf in every entry of a row is an empty set whose "
            "log-sum is -inf (softmax 0/0): drop such rows before the reduction, not after")

_static(Cause.DOMAIN, when=_kind_is("kl_div_zero_probability"), src=True,
        title="Give kl_div a probability target (>= 0), or log-probabilities with log_target=True",
        code="loss = F.kl_div(F.log_softmax(student_logits, -1), F.log_softmax(teacher_logits, -1),\n"
             "                log_target=True, reduction='batchmean')",
        why="kl_div computes target * log(target); a negative target is not a probability")

_static(Cause.DATA, when=_kind_is("kl_div_zero_probability"), src=True,
        title="Keep zero probabilities finite in kl_div (clamp -inf log-probabilities)",
        code="teacher_logp = teacher_logp.clamp_min(torch.finfo(teacher_logp.dtype).min)\n"
             "loss = F.kl_div(student_logp, teacher_logp, log_target=True, reduction='batchmean')\n"
             "# or with probabilities: F.kl_div(student_logp, teacher_logp.exp(), reduction='batchmean')\n"
             "# (xlogy gives 0 * log 0 = 0)",
        why="a zero probability contributes 0 to KL, but exp(-inf) * (-inf - x) is 0 * inf = NaN")

_static(Cause.DATA, when=_kind_is("embedding_index"),
        title="Resize the embedding to the tokenizer (or map the ids the table does not have)",
        code="model.resize_token_embeddings(len(tokenizer))   # transformers models\n"
             "# or: grow the table by hand, keeping the trained rows\n"
             "old = model.embed\n"
             "model.embed = nn.Embedding(len(tokenizer), old.embedding_dim)\n"
             "model.embed.weight.data[:old.num_embeddings] = old.weight.data",
        why="an id >= num_embeddings has no row; adding special tokens to the tokenizer does not add rows")

_static(Cause.DIV, Cause.DATA, when=_kind_is("unbiased_over_one"), src=True,
        title="Never reduce std/var over a single sample: drop the short batch or use correction=0",
        code="loader = DataLoader(dataset, batch_size=16, shuffle=True, drop_last=True)  # no batch of one\n"
             "# or, where a batch (or group) of one can occur:\n"
             "std = x.std(dim=0, correction=0)   # population std: 0 for one sample, not 0/0",
        why="the unbiased estimator divides by N - 1: over one sample that is 0/0 = NaN, and an eps added "
            "after std does not reach it")

_static(Cause.OVERFLOW, Cause.DIV, when=_kind_is("normalization"), src=True,
        title="Find the extreme value that reaches {mod} (a larger eps cannot help)",
        code="# weights (e.g. embedding rows) whose square overflows float32 (|x| > 1.8e19)\n"
             "for name, p in model.named_parameters():\n"
             "    rows = (p.detach().abs() > 1e19).reshape(p.shape[0], -1).any(1).nonzero().flatten()\n"
             "    if len(rows):\n"
             "        print(name, rows[:10].tolist())\n"
             "# e.g. re-initialise such embedding rows from the trained ones:\n"
             "# emb.weight.data[rows] = emb.weight.data[good].mean(0)",
        why="the normalization squares its inputs for the variance: a value beyond ~1.8e19 makes it inf and "
            "the output NaN whatever eps is; the value itself (a corrupt row, a feature far out of range) is "
            "the bug")

_static(Cause.DOMAIN, when=_kind_is("bce_outside_unit_interval"),
        title="Use binary_cross_entropy_with_logits on the raw scores",
        code="loss = F.binary_cross_entropy_with_logits(logits, targets)   # no sigmoid before it\n"
             "# (nn.BCEWithLogitsLoss; autocast-safe, unlike sigmoid + BCELoss)",
        why="BCE takes probabilities in [0, 1]; the logits version applies the sigmoid inside, in log space")

_static(Cause.DOMAIN, when=_kind_is("not_positive_definite"),
        title="Make the matrix safely positive-definite before factorising it",
        code="eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)\n"
             "L = torch.linalg.cholesky(cov + 1e-5 * eye)        # jitter on the diagonal\n"
             "# or factorise in float64: torch.linalg.cholesky(cov.double()).to(cov.dtype)",
        why="a covariance estimated from few samples (or in low precision) is singular or slightly "
            "indefinite; a small diagonal jitter restores positive-definiteness")


@fix_for(Cause.OVERFLOW)
def _fp16_constant(f: Finding, ev: Evidence) -> Fix | None:
    if _kind(ev) != "constant_beyond_dtype":
        return None
    code = ev.main.trace.failed.code if ev.main.trace and ev.main.trace.failed else None
    return Fix(title="Use a dtype-aware constant instead of a hard-coded -1e9",
               code="scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)   # -65504 in fp16"
                    + (f"\n# was: {code}" if code else ""),
               why="-1e9 does not fit fp16 (max 65504); finfo(dtype).min is the most negative value that does")


# -- precision ---------------------------------------------------------------------------------
@fix_for(Mechanism.LOSS_SCALE_COLLAPSE, Cause.OVERFLOW, Cause.UNDERFLOW,
         verify=lambda f, ev: Remedy(precision=Precision.BF16))
def _bf16(f: Finding, ev: Evidence) -> Fix | None:
    if ev.reached.precision is not Precision.FP16:
        return None
    dev = _device(ev)
    return Fix(title="Train in bf16 instead of fp16 (same range as fp32; no GradScaler needed)",
               code=f'with torch.autocast("{dev}", dtype=torch.bfloat16):\n    loss = loss_fn(model, batch)\n'
                    f'loss.backward()  # drop GradScaler: bf16 does not underflow like fp16'
                    + ("\n# on CUDA check torch.cuda.is_bf16_supported() (Ampere or newer)" if dev == "cuda" else ""),
               why="bf16 has fp32's 8-bit exponent: max 3.4e38 instead of 65504, smallest normal 1.2e-38 "
                   "instead of 6.1e-5")


def _island_modules(f: Finding, ev: Evidence) -> tuple[str, ...]:
    """The finding's module plus every other module where the same op produced non-finite values."""
    names = [f.module]
    e = ev.origin
    for other in (ev.main.trace.events if ev.main.trace else []):
        if e is not None and other.phase is Phase.FORWARD and other.op == e.op and other.module not in names \
                and other.module not in (None, "", LOSS_FN):
            names.append(other.module)
    return tuple(names)


@fix_for(Cause.OVERFLOW, Cause.UNDERFLOW, Cause.LOG, Cause.DIV, Cause.SQRT,
         verify=lambda f, ev: Remedy(fp32_modules=_island_modules(f, ev)) if f.module and f.module != LOSS_FN else None)
def _fp32_island(f: Finding, ev: Evidence) -> Fix | None:
    if not ev.reached.precision.low or f.phase is Phase.UPDATE:
        return None
    dev = _device(ev)
    pure = ev.target.pure
    if f.module and f.module != LOSS_FN:
        names = _island_modules(f, ev)
        if pure and any(any(True for _ in ev.target.model.get_submodule(n).parameters()) for n in names):
            return None   # weights stored in low precision: an island would need float32 copies of them
        mods = ", ".join(_attr(n) for n in names)
        back = str(ev.target.weights.dtype) if pure else None   # "torch.bfloat16"
        ret = (f"            out = forward(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a\n"
               f"                            for a in args), **kwargs)\n"
               f"        return out.to({back})  # back to the weights' dtype for the next layer\n") if pure else (
               f"            return forward(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a\n"
               f"                             for a in args), **kwargs)\n")
        code = (f"# keep {', '.join(names)} in float32 while the rest runs in {ev.reached.precision.value}\n"
                f"def fp32_island(module):\n"
                f"    forward = module.forward\n"
                f"    def forward_fp32(*args, **kwargs):\n"
                f'        with torch.autocast("{dev}", enabled=False):\n'
                + ret +
                f"    module.forward = forward_fp32\n\n"
                f"for m in ({mods},):\n"
                f"    fp32_island(m)")
    else:
        code = (f'with torch.autocast("{dev}", enabled=False):  # an fp32 island for the loss\n'
                f"    loss = compute_loss(output.float(), target)")
    where = f"among {ev.target.weights.value} weights" if pure else "inside autocast"
    return Fix(title=f"Run {_mod(f)} in float32 (an fp32 island {where})", code=code,
               why="a nested autocast(enabled=False) with float32 inputs computes this block at full range and "
                   "precision; everything else keeps the speed of low precision")


_static(Cause.OVERFLOW, when=lambda f, ev: _op_in("bmm", "mm", "matmul", "baddbmm", "addmm")(f, ev)
        and bool(f.module and "att" in f.module.lower()), src=True,
        title="Scale q before q @ k^T (or use F.scaled_dot_product_attention)",
        code="# scale first, so the product never leaves the fp16 range\n"
             "q = q * (q.size(-1) ** -0.5)\n"
             "scores = q @ k.transpose(-2, -1)\n"
             "# or, fused and overflow-safe:\n"
             "out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)",
        why="dividing by sqrt(d) after the matmul lets the unscaled logits overflow 65504 first; "
            "qk-norm (LayerNorm on q and k) bounds them for good")

_static(Cause.OVERFLOW, when=_op_in("_to_copy", "copy_", "fill_", "masked_fill", "masked_fill_"), src=True,
        title="Use a dtype-aware constant instead of a hard-coded huge one (-1e9, 1e10, ...)",
        code="neg = torch.finfo(scores.dtype).min        # -65504 in fp16, -3.4e38 in fp32\n"
             "scores = scores.masked_fill(blocked, neg)   # instead of adding (blocked * -1e9).to(dtype)",
        why="a constant beyond the fp16 range becomes inf when cast; fully masked rows then give "
            "softmax(-inf, ..., -inf) = NaN, where the finite minimum gives a uniform row")

_static(Cause.OVERFLOW, when=_op_in("exp", "expm1", "exp2", "sinh", "cosh"), src=True,
        title="Use a numerically stable form instead of exp (softplus, logsumexp, log-sigmoid)",
        code="# log(1 + exp(x))      -> torch.nn.functional.softplus(x)\n"
             "# log(sum(exp(x)))     -> torch.logsumexp(x, dim=-1)\n"
             "# exp(x) / sum(exp(x)) -> torch.softmax(x, dim=-1)\n"
             "y = torch.nn.functional.softplus(x)",
        why="these subtract the maximum (or switch to a linear branch) before exponentiating, so large "
            "inputs cannot overflow")


# -- lr -----------------------------------------------------------------------------------------
def _lower_lr_remedy(f: Finding, ev: Evidence) -> Remedy | None:
    """The LR fix below as a change to the LR the scheduler sets (a multiplier above 1 has none)."""
    lrs = lrs_seen(ev.reached)
    if lrs and multiplier_above_one(ev.reached, max(lrs)):
        return None
    owner = owning_group(ev, largest_update(ev))
    if owner is not None and owner.differs:   # the fix sets that group's LR to the other groups' (a typo)
        return Remedy(lr_scale=tuple(max(owner.others) / owner.lr if i == owner.index else 1.0
                                     for i in range(owner.count)))
    return Remedy(lr_scale=0.1 if constant(lrs) else None, warmup=warmup_steps(ev))


def warmup_steps(ev: Evidence) -> int:
    """A warm-up that fits the run: half the steps it got through, between 10 and 1000 (a 1000-step warm-up
    for a run that failed at step 200 would be a fix for another run)."""
    return max(10, min(1000, ev.reached.step // 2))


@fix_for(Cause.LR_SPIKE, verify=_lower_lr_remedy)
def _lower_lr(f: Finding, ev: Evidence) -> Fix | None:
    if ascent(f):
        return None   # a lower LR only slows an ascent down (the LR the optimizer applies is the fix)
    lrs = lrs_seen(ev.reached)
    if lrs and multiplier_above_one(ev.reached, max(lrs)):
        return Fix(title="Fix the schedule: the LambdaLR multiplier must stay <= 1",
                   code=f"warmup = {warmup_steps(ev)}  # steps\n"
                        "scheduler = torch.optim.lr_scheduler.LambdaLR(\n"
                        "    optimizer, lambda step: min(1.0, (step + 1) / warmup))  # a multiplier in [0, 1]"
                        f"\n# your LR reached {max(lrs):.3g}, {max(lrs) / max(ev.reached.scheduler_base_lrs):.3g}x "
                        "the base LR",
                   why="LambdaLR multiplies the base LR by what the lambda returns; above 1 the LR grows with it")
    owner = owning_group(ev, largest_update(ev))
    if owner is not None and owner.differs:
        lr = owner.lr
        return Fix(title=f"Lower the learning rate of param group {owner.index} (it is {lr:.3g}; the other "
                         f"group(s) use {', '.join(f'{x:.3g}' for x in owner.others)})",
                   code=f"{owner.optimizer}.param_groups[{owner.index}][\"lr\"] = {max(owner.others):.3g}  "
                        f"# was {lr:.3g}\n"
                        "# or where you build it: {\"params\": ..., \"lr\": ...} with the intended value (1e3 vs 1e-3?)",
                   why="each param group steps with its own LR; the group holding the parameters that blew up moves "
                       "them by about its LR per step (Adam), whatever the first group's LR is")
    if constant(lrs):
        lr = lrs[-1]
        w = warmup_steps(ev)
        return Fix(title=f"Lower the learning rate (it is {lr:.3g}, constant) and warm up to it",
                   code=f"optimizer = torch.optim.{_opt_name(ev)}(model.parameters(), lr={lr / 10:.3g})  "
                        f"# was lr={lr:.3g}\n"
                        "scheduler = torch.optim.lr_scheduler.LambdaLR(\n"
                        f"    optimizer, lambda step: min(1.0, (step + 1) / {w}))  # linear warmup over {w} steps",
                   why="the update |dw|/|w| scales with the LR; a step that replaces the weights' norm diverges at "
                       "once (Adam moves every weight by about lr per step, whatever the gradient)")
    hint = f"\n# your LR went from {min(lrs):.3g} to {max(lrs):.3g} in {len(lrs)} steps" if lrs else ""
    return Fix(title="Fix the schedule: warm up to a lower peak learning rate",
               code=f"warmup = {warmup_steps(ev)}  # steps\n"
                    "scheduler = torch.optim.lr_scheduler.LambdaLR(\n"
                    "    optimizer, lambda step: min(1.0, (step + 1) / warmup))  # a multiplier in [0, 1]"
                    + hint,
               why="a peak LR too high for this model makes |dw|/|w| explode; warm up to a lower peak")


def _opt_name(ev: Evidence) -> str:
    opts = ev.target.optimizers
    return type(opts[0][1]).__name__ if opts else "AdamW"


@fix_for(Cause.OVERFLOW, Cause.LR_SPIKE, verify=lambda f, ev: Remedy(max_grad_norm=1.0) if ev.reached.record is not None
         and ev.reached.snapshot is not None and f.phase in (Phase.BACKWARD, Phase.UPDATE) else None)
def _clip(f: Finding, ev: Evidence) -> Fix | None:
    if f.cause is Cause.OVERFLOW and f.phase is Phase.FORWARD:
        return None
    if ev.target.max_grad_norm:
        return None   # the loop already clips: a clipping fix would be no news (the LR fix is the one)
    if f.cause is Cause.LR_SPIKE and _opt_name(ev) in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adafactor"):
        return None   # Adam normalises the gradient: clipping does not bound its step, the LR does
    scaler = ev.reached.scaler is not None
    code = ("scaler.scale(loss).backward()\nscaler.unscale_(optimizer)  # clip the true gradients, not scaled ones\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\nscaler.step(optimizer)\n"
            "scaler.update()") if scaler else \
        ("loss.backward()\ntorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\noptimizer.step()")
    return Fix(title="Clip the global gradient norm", code=code,
               why="bounds the size of one update whatever the gradient does")


# -- data ---------------------------------------------------------------------------------------
@fix_for(Cause.DATA)
def _data_clean(f: Finding, ev: Evidence) -> Fix | None:
    if _kind(ev) in ("ctc_no_alignment", "empty_set", "kl_div_zero_probability", "embedding_index"):
        return None   # the op's own fix above says what to do
    codes = {p.code for p in ev.data if p.level == "error"}
    key = next((p.key for p in ev.data if p.level == "error"), "batch")
    ii = ev.target.ignore_index
    if "all_ignored" in codes or "empty" in codes or _kind(ev) == "nll_no_target":
        return Fix(title="Guard the mean against batches with no valid labels",
                   code="loss_sum = F.cross_entropy(logits.flatten(0, -2), labels.flatten(),\n"
                        f"                           ignore_index={ii}, reduction=\"sum\")\n"
                        f"loss = loss_sum / (labels != {ii}).sum().clamp_min(1)",
                   why="a mean over zero labels is 0/0 = NaN; a count clamped at 1 gives loss 0 instead")
    values = {p.value for p in ev.data if p.code == "label_out_of_range" and p.value is not None}
    raised = re.search(LABEL_OUT_OF_RANGE, str(ev.reached.error.exc)) if ev.reached.error else None
    if raised:
        values.add(float(raised.group(1)))
    if len(values) == 1 and next(iter(values)) in (255.0, 65535.0, -1.0):
        void = int(next(iter(values)))
        return Fix(title=f"Label {void} marks void / unlabelled samples: tell the loss to ignore it",
                   code=f"loss = F.cross_entropy(logits, labels, ignore_index={void})\n"
                        f"# and return \"ignore_index\": {void} from target() so nanprobe checks labels the same way",
                   why=f"{void} is the usual 'void' value of segmentation masks and label files; as a class index it "
                       "is out of range and cross_entropy raises")
    if raised:
        value = int(raised.group(1))
        return Fix(title=f"Label {value} is not a class: map the labels to 0..C-1 or widen the classifier",
                   code=f"nanprobe scan-data {ev.entry or 'ENTRY'}  # which steps and samples hold the label\n"
                        "# in the dataset: remap labels to 0..num_classes-1 (e.g. 1-based ids: y = y - 1)\n"
                        "# or give the head one output per class: nn.Linear(d, num_classes)",
                   why="cross_entropy indexes the logits with the label; an index past the last class has no "
                       "logit, so the step raises (on CUDA, a device-side assert that poisons the process)")
    if "masked_row" in codes:
        return Fix(title="Never mask a whole attention row",
                   code="# let fully padded rows attend to themselves (their output is discarded anyway)\n"
                        "mask = mask | (~mask.any(-1, keepdim=True))",
                   why="softmax over a row of -inf is 0/0 = NaN, and the NaN flows back into the weights")
    shift = next((p for p in ev.data if p.code == "shift"), None)
    step = ev.reached.step
    scan = f"nanprobe scan-data {ev.entry or 'ENTRY'} --limit {step + 1}  # per-key min/max/mean of every batch: "
    if not codes and ev.reached.status is Status.SPIKE and shift is not None:
        return Fix(title=f"Fix {shift.key} in batch {step} at the source: it is in other units than the batches "
                         "before",
                   code=f"{scan}{shift.key} in batch {step} vs the others\n# fix the export / conversion that "
                        "produced it; until then skip such batches in the run with nanprobe.Guard",
                   why=f"{shift.message}; one batch in other units moves the weights by its own outliers")
    if not codes and ev.reached.status is Status.SPIKE:
        return Fix(title=f"Find what is different about batch {step}: its loss is far outside the run's",
                   code=f"{scan}compare batch {step} with the others\n"
                        "# typical culprits: targets in other units, a label mapping of another source, a corrupt "
                        "shard; fix them at the source, or skip such batches in the run with nanprobe.Guard",
                   why="the step size did not change, so the batch did: one batch whose loss is orders of magnitude "
                       "above the others moves the weights by its own outliers")
    return Fix(title=f"Clean the data: find and drop (or impute) the rows with bad values in {key}",
               code=f"nanprobe scan-data {ev.entry or 'ENTRY'}  # every bad value with step, key, sample\n"
                    "# in the dataset / collate_fn:\n"
                    "x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # or drop the row",
               why="a non-finite input reaches the loss and the gradient of every weight it touches")


# -- log / sqrt / div / domain -------------------------------------------------------------------
_static(Cause.LOG, Cause.UNDERFLOW, src=True,
        when=lambda f, ev: f.cause is not Cause.UNDERFLOW and ev.origin is not None
        or _op_in("log", "log2", "log10", "log1p")(f, ev),
        title="Compute the loss in log space instead of log(probability)",
        code="# -log(sigmoid(z))   -> F.softplus(-z)  or  F.binary_cross_entropy_with_logits(z, y)\n"
             "# log(softmax(z))    -> F.log_softmax(z, dim=-1)  or  F.cross_entropy(z, y)\n"
             "# log(rate) (Poisson)-> predict log_rate and use F.poisson_nll_loss(log_rate, y, log_input=True)",
        why="fused log-space functions never form the probability that underflows to 0")


@fix_for(Cause.LOG, Cause.UNDERFLOW)
def _clamp_log(f: Finding, ev: Evidence) -> Fix | None:
    e = ev.origin
    if e is None or op_base(e.op) not in ("log", "log2", "log10") and not (e.node or "").startswith("Log"):
        return None
    eps = "torch.finfo(x.dtype).tiny" if f.cause is Cause.UNDERFLOW else "1e-12"
    code = f"y = torch.log(x.clamp_min({eps}))" + _src(ev)
    if e.masked:
        code = ("# mask the INPUT, not the output: where() does not stop NaN gradients of the other branch\n"
                "safe = torch.where(x > 0, x, torch.ones_like(x))\n"
                "y = torch.where(x > 0, torch.log(safe), torch.zeros_like(x))" + _src(ev))
    return Fix(title="Clamp the argument of log away from 0" if not e.masked else "Mask the input of log, not its "
               "output", code=code,
               why="log(0) = -inf and its gradient 1/x = inf; adding 1e-8 does nothing in fp16 (it rounds to 0)")


_static(Cause.SQRT, when=lambda f, ev: True, src=True,
        title="Keep sqrt away from 0: add eps inside (or use a norm with eps)",
        code="dist = torch.sqrt(((a - b) ** 2).sum(-1) + 1e-12)\n"
             "# or: F.pairwise_distance(a, b, eps=1e-6); torch.linalg.vector_norm is safe at 0 forward\n"
             "# but not in backward",
        why="d/dx sqrt(x) = 1/(2 sqrt(x)) is infinite at x = 0, and 0 * inf = NaN in the chain rule")


@fix_for(Cause.DIV, Cause.UNDERFLOW, verify=lambda f, ev: Remedy(param_overrides=(("eps", 1e-8),))
         if f.phase is Phase.UPDATE else None)
def _div_eps(f: Finding, ev: Evidence) -> Fix | None:
    e = ev.origin
    if f.phase is Phase.UPDATE:
        info = (e.update_info or {}) if e else {}
        opt = info.get("optimizer", "Adam")
        return Fix(title=f"Give {opt} a positive eps",
                   code=f"optimizer = torch.optim.{opt}(model.parameters(), lr={info.get('lr', 1e-3):g}, eps=1e-8)",
                   why="the update is m / (sqrt(v) + eps); parameters with zero gradient have m = v = 0, so eps = 0 "
                       "makes it 0/0")
    if f.cause is Cause.UNDERFLOW and e is not None and op_base(e.op) not in ("div", "reciprocal", "rsqrt"):
        return None
    return Fix(title="Add eps to the denominator (or use the built-in normalizers)",
               code="y = x / (x.norm(dim=-1, keepdim=True) + 1e-6)\n"
                    "# or: F.normalize(x, dim=-1, eps=1e-12); nn.LayerNorm / nn.RMSNorm(eps=1e-6)" + _src(ev),
               why="a zero (or underflowed) denominator gives 0/0 = NaN or x/0 = inf")


_static(Cause.DIV, when=_op_in("_softmax"),
        title="Use a large finite negative number instead of -inf for masks, or never mask a whole row",
        code="scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)\n"
             "mask = mask | (~mask.any(-1, keepdim=True))  # rows with nothing to attend to",
        why="softmax of an all -inf row is 0/0 = NaN")


@fix_for(Cause.DOMAIN)
def _domain_clamp(f: Finding, ev: Evidence) -> Fix | None:
    e = ev.origin
    base = op_base(e.op) if e else ""
    if base.startswith("pow"):
        code = ("# a fractional power is only defined for x >= 0\n"
                "y = x.clamp_min(0).pow(p)            # or: x.sign() * x.abs().pow(p)\n"
                "# apply gamma correction before normalizing, on values in [0, 1]" + _src(ev))
    elif base in ("acos", "asin", "atanh"):
        code = (f"y = torch.{base}(x.clamp(-1 + 1e-6, 1 - 1e-6))  # keep inside the domain; the gradient is "
                "infinite at ±1" + _src(ev))
    elif e is not None:
        lo = min((s.min for s in e.inputs), default=0.0)
        hi = max((s.max for s in e.inputs), default=0.0)
        code = (f"# {base} gave {e.kind} for inputs in [{lo:.3g}, {hi:.3g}]: keep its input strictly inside the range "
                "where it is finite\n"
                f"x = x.clamp(lo + eps, hi - eps)   # the bounds of {base}'s domain\n"
                f"y = torch.{base.replace('special_', 'special.')}(x)" + _src(ev))
    else:
        return None
    return Fix(title=f"Clamp the input of {base or 'the op'} into its domain", code=code,
               why="outside its domain the op returns NaN, and at the boundary its gradient is infinite")


# -- not reproduced -----------------------------------------------------------------------------
_static(Cause.NOT_REPRODUCED, when=lambda f, ev: True,
        title="Make the step reproducible and check the hardware",
        code="torch.use_deterministic_algorithms(True)\ntorch.backends.cudnn.benchmark = False\n"
             "# and on the machine: nvidia-smi -q -d ECC,TEMPERATURE",
        why="a step that is finite when replayed exactly points at nondeterminism or a hardware fault")


# -- unknown -------------------------------------------------------------------------------------
@fix_for(Cause.UNKNOWN)
def _see_more(f: Finding, ev: Evidence) -> Fix | None:
    step = ev.reached.step
    entry = ev.entry or "ENTRY"
    e = entered(ev)
    if e is not None:
        at = f" ({e.source})" if e.source else ""
        return Fix(title=f"Find where the non-finite value enters {e.op}{at}",
                   code=f"# before the line{at}: which operand is already non-finite, and where it comes from\n"
                        "assert torch.isfinite(x).all(), x  # for each tensor operand x\n"
                        "# a Python float constant (float('nan'), an inf from math) is an operand too",
                   why="no op of the step produced the value: it comes from a constant or a tensor made outside "
                       "the step, so the fix is where it is made")
    if ev.reached.status is Status.SPIKE:
        return Fix(title="Tell the data and the step size apart",
                   code=f"nanprobe scan-data {entry} --limit {step + 1}  # per key: batch {step} against the others\n"
                        f"# rerun step {step} from the state before it with the batch of step {step - 1}: a spike "
                        "that stays is the step size;\n"
                        "# with a 10x smaller LR: a spike that stays is the data",
                   why="neither the batch's statistics nor the LR and update sizes explain the spike")
    return Fix(title="See more of the step",
               code=f"nanprobe compare-precisions {entry} --at {step}  # the step in every precision, per layer\n"
                    f"nanprobe run {entry} --at {step} --debug --json step{step}.json  # the raw events",
               why="nothing the rules know explains the step; the per-layer ranges and the events say what it did")


@fix_for(Cause.LR_SPIKE, Cause.DATA, Cause.NOT_REPRODUCED, Cause.UNKNOWN)
def _guard(f: Finding, ev: Evidence) -> Fix | None:
    if ev.reached.error is not None:
        return None   # a step that raises cannot be skipped by a guard around the update
    clip = ev.target.max_grad_norm   # the loop's own clipping
    entry = ev.entry or "train.py:target"
    return Fix(title="Skip bad updates in the real run with nanprobe.Guard (writes a capsule to replay)",
               code=f"guard = nanprobe.Guard(model, optimizer, entry=\"{entry}\")\n"
                    "for step, batch in enumerate(loader):\n"
                    "    with guard.step(batch):\n        loss = loss_fn(model, batch)\n"
                    "        guard.backward(loss)\n"
                    f"    if guard.optimizer_step({f'max_grad_norm={clip:g}' if clip else ''}):  "
                    "# False: skipped (non-finite or spike)\n"
                    "        scheduler.step()",
               why="one bad batch or glitch no longer corrupts the weights; the capsule replays the exact step")


def attach(findings: list[Finding], ev: Evidence,
           verify: Callable[[Finding, list[tuple[Fix, Remedy | None]]], list[Fix]] | None = None) -> list[Finding]:
    """Fill each finding's fixes from the catalog: its mechanism's first, then its cause's.

    ``verify`` (the horizon verifier) gets the top finding's fixes with their remedies and returns
    them with their verdicts. A fix that failed over the horizon is listed after the others; the
    rest keep the evidence's order."""
    out = []
    for i, f in enumerate(findings):
        templates = (MECHANISMS[f.mechanism] if f.mechanism is not None else []) + CATALOG[f.cause]
        by_title: dict[str, tuple[Fix, Remedy | None]] = {}   # the first fix of each title
        for tpl in templates:
            fix = tpl.build(f, ev)
            if fix is not None and fix.title not in by_title:
                by_title[fix.title] = (fix, tpl.verify(f, ev) if tpl.verify is not None else None)
        candidates = list(by_title.values())
        fixes = verify(f, candidates) if i == 0 and verify is not None else [fix for fix, _ in candidates]
        fixes.sort(key=lambda x: x.verified is False)
        out.append(dataclasses.replace(f, fixes=tuple(fixes)))
    return out
