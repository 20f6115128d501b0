"""The precursor monitor: cheap statistics of the slow mechanisms behind a failure, per step.

One monitor serves every way in (replay and smoke through ``Replayer``, ``nanprobe.Guard``, the
hook-driven guard behind ``watch`` and the callbacks). On a monitored step (every ``every``-th) it
records, as device tensors read back with one sync at the end of the step:

- per attention module (a module whose class name says attention, or ``nn.MultiheadAttention``):
  the largest pre-softmax logit and the attention entropy, where the softmax is called (hand-written
  ``q @ k^T`` + softmax), and the largest product of a matmul inside it (what overflows fp16 before a
  ``/ sqrt(d)``); for ``F.scaled_dot_product_attention`` the bound ``scale * max|q_i| * max|k_j|``
  (the fused kernel's logits are never materialised);
- the output logits' largest logsumexp (log Z) at the last ``nn.Linear`` of the model;
- in fp16, the activation headroom: log2(dtype max / largest |activation|) over the leaf modules, and
  which module is closest to the dtype's max (bf16 and fp32 reach 3.4e38: not measured there);
- the global and per-layer gradient norm, Adam's second moment against eps (the share of entries
  with sqrt(v) below eps), the loss scale and the LR.

Only hooks and a ``TorchFunctionMode`` entered inside attention modules are used, all installed for
the monitored step only: an unmonitored step costs nothing.

``Trend`` reads the series: when a precursor left its healthy band (the onset), which mechanism it
points to, and the early warning (with the projected step a dtype limit is crossed).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..base.config import MonitorConfig
from ..base.report import Mechanism
from ..base.sharding import full_value, local_value

_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)
_SOFTMAX = {torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
           torch.einsum, torch.baddbmm}
_SDPA = torch.nn.functional.scaled_dot_product_attention
EARLY_SAMPLES = 3          # live: steps monitored at the start, until one sees the model's forward
UPDATE_SAMPLE = 256        # entries per parameter read for |dw|/|w| and the update's cosine with -grad
ACTIVATIONS_EVERY = 10     # outside fp16, the largest activation is read every this many steps (replay, smoke)
UPDATE_RISE = 3.0          # the update size over a break-away this many times its level at the loss's best: a rise
ASCENT_SAMPLES = 3         # monitored steps in a row whose update climbs the gradient: an applied LR below zero


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules to watch: the outermost module whose class name says attention."""
    out: list[tuple[str, torch.nn.Module]] = []
    for name, m in model.named_modules():
        if not name or any(name.startswith(p + ".") for p, _ in out):
            continue
        if isinstance(m, torch.nn.MultiheadAttention) or _ATTENTION.search(type(m).__name__):
            out.append((name, m))
    return out


def _recent_peak(pts: list[tuple[int, float]], n: int = 3) -> tuple[int, float]:
    """The largest finite value of the last ``n`` samples: the failing step's own sample may already be
    non-finite or zeroed (an overflowed row masks to 0) and is no measure of how far the growth went."""
    recent = [(s, x) for s, x in pts[-n:] if math.isfinite(x)]
    return max(recent, key=lambda p: p[1]) if recent else pts[-1]


def _layer_of(name: str, depth: int = 2) -> str:
    """``blocks.1.attn.q.weight`` -> ``blocks.1``: the layer a parameter belongs to."""
    parts = name.split(".")[:-1]
    return ".".join(parts[:depth]) if parts else "(model)"


class _AttentionMode(TorchFunctionMode):
    """Entered inside an attention module: reads the logits at its softmax and matmuls."""

    def __init__(self, sink: defaultdict[str, list[torch.Tensor]], name: str):
        super().__init__()
        self.sink, self.name = sink, name

    def pre_hook(self, mod, args) -> None:
        self.__enter__()     # returns the mode; a forward pre-hook must return None (or it replaces the args)

    def post_hook(self, mod, args, out) -> None:
        self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            with torch.no_grad():
                if func in _SOFTMAX and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
                    # the largest finite logit: masked -inf entries excluded (one aminmax over the finite ones
                    # would cost a copy; the max of |min| over finite rows is read from the softmax instead)
                    self._put("max_logit", _finite_absmax(args[0].detach()))
                    # entropy of the first sample's rows: attention collapse shows in every sample
                    p = out.detach()[:1].float()
                    self._put("entropy", -torch.special.xlogy(p, p).sum(-1).mean())
                elif func in _MATMUL and isinstance(out, torch.Tensor) and out.dim() >= 3:
                    self._put("max_product", _finite_absmax(out.detach()))
                elif func is _SDPA:
                    q, k = args[0].detach(), args[1].detach()
                    scale = kwargs.get("scale") or 1.0 / math.sqrt(q.shape[-1])
                    bound = q.float().norm(dim=-1).amax() * k.float().norm(dim=-1).amax() * scale
                    self._put("max_logit", bound)
        except Exception:   # a statistic never breaks the user's step
            pass
        return out

    def _put(self, stat: str, value: torch.Tensor) -> None:
        self.sink[f"{self.name}/{stat}"].append(value)


def _finite_absmax(x: torch.Tensor) -> torch.Tensor:
    """max(|min|, |max|) of ``x`` as fp32, with a non-finite end (an intended -inf mask, an overflow) left out."""
    lo, hi = (t.float() for t in torch.aminmax(x))
    zero = torch.zeros((), device=lo.device)
    return torch.maximum(torch.where(torch.isfinite(lo), -lo, zero), torch.where(torch.isfinite(hi), hi, zero))


@dataclass(slots=True)
class Sample:
    """One monitored step's statistics: plain numbers, ``"<module>/<stat>" -> value``."""

    step: int
    values: dict[str, float] = field(default_factory=dict)
    closest: str | None = None     # the module whose output came closest to the dtype's max


class Monitor:
    """Installs the cheap per-step statistics around one step of ``model``."""

    def __init__(self, model: torch.nn.Module, cfg: MonitorConfig, *, dtype: torch.dtype | None = None,
                 every: int | None = None, activations: bool = False, live: bool = False):
        self.cfg, self.dtype = cfg, dtype
        self.every = max(1, every if every is not None else cfg.every)
        self.attention = attention_modules(model)
        self.output = next(((n, m) for n, m in reversed(list(model.named_modules()))
                            if isinstance(m, torch.nn.Linear)), None)   # the last Linear: the output head
        # activation headroom on every monitored step where the dtype's range is short (fp16); elsewhere (with
        # ``activations``: replay and smoke) the largest activation every ACTIVATIONS_EVERY steps, for
        # activation growth. A hook on every leaf module is most of the monitor's cost.
        self.short_range = dtype is not None and torch.finfo(dtype).max < 1e6
        self.leaves = [(n, m) for n, m in model.named_modules() if n and not any(True for _ in m.children())] \
            if self.short_range or activations else []
        self.named_params = list(model.named_parameters())
        self._tops = [model, *model.children()]
        # the update statistics read a fixed strided sample of each parameter (a few hundred entries): |dw|/|w|
        # and the cosine of the update with -grad, without a copy of the weights. A live run (``live``) closes its
        # step at the check, before the update: there the sample is taken at the check of the step before a
        # monitored one (``pre_sample``), and the monitored step's check measures that step's |dw|/|w|
        self.sampled = [(p, max(1, p.numel() // UPDATE_SAMPLE)) for _, p in self.named_params
                        if p.numel() and p.is_floating_point() and not hasattr(p, "full_tensor")]
        self.live = live
        self._pre: tuple[int, torch.Tensor, torch.Tensor] | None = None   # live: (step, weights, grads) samples
        self._w0: torch.Tensor | None = None
        self.trend = Trend(cfg, dtype, classes=self.output[1].out_features if self.output is not None else None,
                           live=live)
        self._handles: list[Any] = []
        self._sink: defaultdict[str, list[torch.Tensor]] = defaultdict(list)
        self._acts: list[tuple[str, torch.Tensor]] = []
        self._active = False
        self._begun, self._forward_seen = 0, False

    # -- forward: hooks installed for a monitored step only -------------------------------------------
    def begin(self, step: int) -> bool:
        """Install the forward statistics when ``step`` is monitored (every ``every`` steps); returns whether it is.

        Live, also the first steps seen until one saw the model's forward (at most ``EARLY_SAMPLES``): a
        monitor made after its run's first forward (a hand-written loop is known as one at its second
        backward) still has the level a run that breaks away early is judged against. Those extra steps
        measure no update (Adam's first steps are large relative to a fresh init)."""
        due = step % self.every == 0 or (self.live and not self._forward_seen and self._begun < EARLY_SAMPLES)
        if not self.cfg.enabled or not due or self._active:
            return False
        self._active, self._sink, self._acts = True, defaultdict(list), []
        self._begun += 1
        self._w0 = self.sample() if self.sampled and not self.live else None
        for name, m in self.attention:
            mode = _AttentionMode(self._sink, name)
            self._handles.append(m.register_forward_pre_hook(mode.pre_hook))
            # always_call: an attention forward that raises leaves the mode (else it would intercept every later op)
            self._handles.append(m.register_forward_hook(mode.post_hook, always_call=True))
        if self.output is not None:
            self._handles.append(self.output[1].register_forward_hook(self._output_hook))
        if self.short_range or step % max(ACTIVATIONS_EVERY, self.every) == 0:
            for name, m in self.leaves:
                self._handles.append(m.register_forward_hook(lambda mod, args, out, name=name: self._act(name, out)))
        if not self._forward_seen:   # a forward of the model while monitored (the top modules: one may be skipped)
            for m in self._tops:
                self._handles.append(m.register_forward_pre_hook(self._ran))
        return True

    def _ran(self, *args: Any) -> None:
        self._forward_seen = True

    def pre_sample(self, step: int) -> None:
        """Live: the check of ``step`` passed, its update comes next; when the next step is monitored, sample the
        weights and gradients now, so that its check measures the update (|dw|/|w|, cosine with -grad)."""
        if self.live and self.sampled and self.cfg.enabled and (step + 1) % self.every == 0:
            with torch.no_grad():
                self._pre = (step, self.sample(), self.sample(grads=True))

    def sample(self, grads: bool = False) -> torch.Tensor:
        """The fixed strided sample of the weights (or ``grads``) the update statistics read (no sync)."""
        with torch.no_grad():
            parts = []
            for p, stride in self.sampled:
                t = p.grad if grads else p
                if t is None or t.shape != p.shape:
                    parts.append(torch.zeros(len(range(0, p.numel(), stride)), device=p.device))
                else:
                    parts.append(t.detach().reshape(-1)[::stride].float())
            return torch.cat(parts)

    def _output_hook(self, mod, args, out) -> None:
        if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[-1] > 1:
            with torch.no_grad():
                x = out.detach().float()
                self._sink[f"{self.output[0]}/logsumexp"].append(torch.logsumexp(x, dim=-1).amax())
                # the logits' mean per row: the part of log Z no softmax sees (what z-loss pins down); a confident
                # head grows its top logit, a drifting one moves them all
                self._sink[f"{self.output[0]}/logit_mean"].append(x.mean(-1).abs().amax())

    def _act(self, name: str, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
            with torch.no_grad():
                self._acts.append((name, _finite_absmax(out.detach())))

    def _remove(self) -> None:
        """Close the monitored step: its hooks come off."""
        self._active = False
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- after the update: read everything with one sync ----------------------------------------------
    def end(self, step: int, *, loss: float | None = None, grad_norm: float | None = None, lr: float | None = None,
            scale: float | None = None, optimizers: Iterable[torch.optim.Optimizer] = ()) -> Sample | None:
        """Close a monitored step (``begin`` returned True) and record its sample."""
        if not self._active:
            return None
        self._remove()
        stats = {key: torch.stack(items).amin() if key.endswith("/entropy") else torch.stack(items).amax()
                 for key, items in self._sink.items()}
        grads = [(n, p.grad) for n, p in self.named_params if p.grad is not None]
        norms = list(torch._foreach_norm([g.float() for _, g in grads])) if grads else []
        if any(hasattr(n, "full_tensor") for n in norms):   # FSDP2 / tensor-parallel gradients: one reduction
            try:
                norms = list(full_value(torch.stack(norms)).unbind())
            except (RuntimeError, NotImplementedError):
                norms = [full_value(n) for n in norms]
        after: dict[str, torch.Tensor] = {}   # read after the per-layer gradient norms
        eps_share = self._adam_eps_share(optimizers)
        if eps_share is not None:
            after["optimizer/adam_v_below_eps"] = eps_share
        w0, g = self._w0, None
        pre, self._pre = self._pre, None
        if self.live and pre is not None and pre[0] == step - 1:   # the update of the step before, applied since
            w0, g = pre[1], pre[2]
        if w0 is not None:
            with torch.no_grad():
                d = self.sample() - w0
                g = self.sample(grads=True) if g is None else g
                dn, gn = d.norm(), g.norm()
                cos = -(d * g).sum() / (dn * gn).clamp_min(1e-30)
                after["update/ratio"] = dn / w0.norm().clamp_min(1e-30)
                after["update/cosine"] = torch.where(gn > 0, cos, torch.nan)
            self._w0 = None
        parts = [*stats.values(), *(a for _, a in self._acts), *norms, *after.values()]
        rest = iter(torch.stack(parts).tolist() if parts else [])   # one sync, read back in the order stacked
        sample = Sample(step=step)
        v = sample.values
        v.update(zip(stats, rest))
        acts = [(n, next(rest)) for n, _ in self._acts]
        if acts:
            sample.closest, top = max(acts, key=lambda a: a[1])
            v["activations/max"] = top
            if self.short_range:
                v["activations/headroom_bits"] = math.log2(torch.finfo(self.dtype).max / top) if top > 0 else 128.0
        layer_sq: defaultdict[str, float] = defaultdict(float)
        for (n, _), x in zip(grads, rest):
            layer_sq[_layer_of(n)] += x * x
        for layer, sq in layer_sq.items():
            v[f"{layer}/grad_norm"] = math.sqrt(sq)
        v.update(zip(after, rest))
        for key, x in (("train/loss", loss), ("grad/norm", grad_norm), ("optimizer/lr", lr), ("optimizer/loss_scale", scale)):
            if x is not None:
                v[key] = float(x)
        self.trend.add(sample)
        return sample

    def abort(self) -> None:
        """The step raised: drop its hooks and partial statistics."""
        self._w0 = None
        self._remove()

    @staticmethod
    def _adam_eps_share(optimizers: Iterable[torch.optim.Optimizer]) -> torch.Tensor | None:
        below: list[torch.Tensor] = []
        total = 0
        for opt in optimizers:
            for group in opt.param_groups:
                eps = group.get("eps")
                if not isinstance(eps, (int, float)) or "betas" not in group:
                    continue
                for p in group["params"]:   # FSDP2: this rank's shard (a share needs no reduction)
                    v = local_value(opt.state.get(p, {}).get("exp_avg_sq"))
                    if isinstance(v, torch.Tensor) and v.numel():
                        below.append((v < eps * eps).sum())   # sqrt(v) < eps, without a sqrt pass
                        total += v.numel()
        return torch.stack(below).sum().float() / total if below else None


# -- reading the series: onset, mechanism, warning ------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Signal:
    """A precursor that left its healthy band."""

    mechanism: Mechanism
    module: str | None
    onset: int                 # the first step outside the band
    evidence: tuple[str, ...]
    projected: tuple[int, int] | None = None   # the steps a dtype limit would be crossed (exponential, power law)
    growth: float = 0.0        # the statistic now over its healthy level
    independent: bool = True   # a signal on its own (not the LR or an activation that follows the loss): it can
                               # stand behind a break-away of the loss as the second signal of a divergence
    key: str | None = None     # the series it was read from

    def headline(self) -> str:
        where = f"{self.module}: " if self.module else ""
        return f"{where}{self.evidence[0]}"


def _fmt(x: float) -> str:
    return f"{x:.3g}"


class Trend:
    """The monitored series of one run and what they say."""

    def __init__(self, cfg: MonitorConfig, dtype: torch.dtype | None, classes: int | None = None,
                 live: bool = False):
        self.cfg, self.dtype = cfg, dtype
        # live (every ten steps): one step's gradient against an update that Adam's momentum made from other
        # batches can read as ascent on a healthy run (PPO's minibatches), so there an update that climbs the
        # gradient explains a step the judge flagged, but is no precursor of its own (no warning, no divergence)
        self.live = live
        self.classes = classes     # the output head's width (log Z is read against log of it)
        self.best_step: int | None = None   # where the loss's level was best, when the judge saw it break away
        self.series: dict[str, list[tuple[int, float]]] = {}
        self.closest: list[tuple[int, str]] = []
        self.warnings: list[dict[str, Any]] = []   # the one early warning (warn)

    def add(self, sample: Sample) -> None:
        for key, x in sample.values.items():
            if math.isfinite(x):
                self.series.setdefault(key, []).append((sample.step, x))
        if sample.closest:
            self.closest.append((sample.step, sample.closest))

    def _closest(self, step: int | None = None) -> str | None:
        """The module closest to the dtype's max at ``step`` (else at the last sample that named one)."""
        return dict(self.closest).get(step) or (self.closest[-1][1] if self.closest else None)

    # -- bands: the run's own healthy level -------------------------------------------------------------
    def warmup_end(self) -> int | None:
        """The step the LR stopped rising, when it rose at the start (a warm-up), else None. While the LR
        is still rising, the last sample's step."""
        lr = self.series.get("optimizer/lr", [])
        if len(lr) < 2 or lr[1][1] <= lr[0][1] * (1 + 1e-6):
            return None
        return next((s0 for (s0, a), (_, b) in zip(lr, lr[1:]) if b <= a * (1 + 1e-6)), lr[-1][0])

    def _band(self, pts: list[tuple[int, float]], limit: float | None = None) -> tuple[float, int]:
        """(the statistic's healthy level, the step its band starts): its level once warm-up is over, over
        the first ``baseline_samples`` samples after it (the smallest: a live run monitored every 10 steps may
        already be growing by its 3rd sample); not its value at initialisation. Without a warm-up, or where
        the statistic was already past its absolute ``limit`` when the warm-up ended (it ran away during the
        warm-up), the band starts after the first ``settle_steps`` steps; a run too short for either takes
        the samples after its first."""
        k = max(self.cfg.baseline_samples, 1)

        def level(start: int) -> list[tuple[int, float]]:
            return [(s, x) for s, x in pts if s >= start][:k]

        after = level(max(self.warmup_end() or 0, self.cfg.settle_steps))
        if limit is not None and after and min(x for _, x in after) >= limit:
            after = level(self.cfg.settle_steps)
        if len(after) < min(k, 3):
            after = pts[1:1 + k] if len(pts) > 1 else pts[:1]
        return min(x for _, x in after), after[0][0]

    @staticmethod
    def _exit(pts: list[tuple[int, float]], above, start: int, m: int = 3) -> int | None:
        """The first step from ``start`` whose sample and the ``m - 1`` after it (all there are, near the
        end) are outside the band: a sustained exit, not one sample."""
        tail = [(s, x) for s, x in pts if s >= start]
        return next((s for i, (s, _) in enumerate(tail) if all(above(x) for _, x in tail[i:i + m])), None)

    def loss_rising(self) -> bool:
        """The monitored loss has left its best level (median of 5 samples) by more than its noise and 5%."""
        pts = [x for _, x in self.series.get("train/loss", [])]
        if len(pts) < 10:
            return False
        lv = _levels(pts)
        d = sorted(abs(b - a) for a, b in zip(pts, pts[1:]))
        sigma = 1.4826 * d[len(d) // 2] / math.sqrt(2)
        best = min(lv)
        return lv[-1] > best + max(0.05 * abs(best), 3 * sigma / math.sqrt(5))

    # -- the mechanisms --------------------------------------------------------------------------------
    def signals(self) -> list[Signal]:
        """Every precursor out of its band now, independent ones first, then earliest."""
        c = self.cfg
        out: list[Signal] = []
        dmax = torch.finfo(self.dtype or torch.float32).max
        for module, key, pts in self._of("max_logit", 2):
            base, start = self._band(pts, c.attention_logit_limit)
            base = max(base, 1e-6)
            step, last = _recent_peak(pts)
            cut = c.growth_factor * base   # the band: growth_factor x the healthy level
            if last < c.attention_logit_limit or last < cut:
                continue
            onset = self._exit(pts, lambda x: x > cut, start) or step
            ev = [f"attention logits grew from {_fmt(base)} (their level from step {start}) to {_fmt(last)} by step "
                  f"{step} ({last / base:.0f}x); past {_fmt(cut)} from step {onset}"]
            for limit in (1e2, 1e3, 1e4):
                first = next((s for s, x in pts if x >= limit), None)
                if first is not None:
                    ev.append(f"{module} logits crossed {limit:.0e} at step {first}")
            ent = self.series.get(f"{module}/entropy")
            if ent:
                low = next((s for s, x in ent if x < c.entropy_floor), None)
                ev.append(f"attention entropy {_fmt(ent[0][1])} -> {_fmt(ent[-1][1])} nats"
                          + (f", below {c.entropy_floor:g} from step {low}" if low is not None else ""))
            prod = self.series.get(f"{module}/max_product", pts)
            projected = _project(prod, dmax) if dmax < 1e6 else None   # fp16: bf16/fp32 logits never reach theirs
            if projected is not None:
                ev.append(f"at this growth |q.k| reaches the {_dtype_name(self.dtype)} max {dmax:.3g} "
                          f"{_steps(projected)}")
            out.append(Signal(mechanism=Mechanism.ATTENTION_LOGIT_GROWTH, module=module, onset=onset,
                              evidence=tuple(ev), projected=projected, growth=last / base, key=key))
        for module, key, pts in self._of("entropy", 4):   # attention entropy collapse (one-hot attention) on its own
            level, start = self._band(pts)
            collapsed = level >= 4 * c.entropy_floor and pts[-1][1] < c.entropy_floor
            onset = self._exit(pts, lambda x: x < level / 4, start) if collapsed else None
            if onset is None or any(s.module == module for s in out):
                continue
            out.append(Signal(mechanism=Mechanism.ATTENTION_LOGIT_GROWTH, module=module, onset=onset,
                              evidence=(f"attention entropy collapsed from {_fmt(level)} nats (its level from step "
                                        f"{start}) to {_fmt(pts[-1][1])} by step {pts[-1][0]}: one-hot attention; "
                                        f"below a quarter of its level from step {onset}",),
                              growth=level / max(pts[-1][1], 1e-6), key=key))
        log_c = math.log(self.classes) if self.classes else 0.0
        for module, key, pts in self._of("logsumexp", 2):
            # log Z against log(number of classes): uniform logits give log C; a confident head's log Z is its
            # top logit (54 on a 10-class head is confidence, not divergence). What diverges is the logits' mean,
            # the part no softmax sees: log Z counts when it is past its band above log C and the mean moved too.
            ex = self._excess(key)
            base, start = self._band(ex, c.output_logsumexp_limit)
            step, last = _recent_peak(ex)
            cut = max(c.output_logsumexp_limit, c.growth_factor * max(base, 1.0))
            mean = self.series.get(f"{module}/logit_mean")
            drift = _recent_peak(mean)[1] if mean else last
            if last <= cut or drift < 0.5 * cut:
                continue
            onset = self._exit(ex, lambda x: x > cut, start) or step
            out.append(Signal(mechanism=Mechanism.OUTPUT_LOGIT_DIVERGENCE, module=module,
                              onset=onset, evidence=(f"output log Z grew to {_fmt(last + log_c)} by step {step} "
                                                     f"(log of {self.classes} classes {log_c:.3g}; its excess "
                                                     f"{_fmt(base)} from step {start}), its logits' mean to "
                                                     f"{_fmt(drift)}; past {_fmt(cut)} above log C from step "
                                                     f"{onset}",),
                              growth=last / max(base, 1.0), key=key))
        head = self.series.get("activations/headroom_bits", [])
        if self.dtype == torch.float16 and len(head) > 1 and head[-1][1] < c.headroom_bits:
            step, last = head[-1]
            onset = next((s for s, x in head if x < c.headroom_bits + 3), step)
            out.append(Signal(mechanism=Mechanism.ACTIVATION_GROWTH, module=self._closest(), onset=onset,
                              evidence=(f"activations {last:.1f} bits below the {_dtype_name(self.dtype)} max "
                                        f"at step {step} (from {head[0][1]:.1f} bits at step {head[0][0]})",)))
        acts = self.series.get("activations/max")
        if acts and len(acts) >= 4 and not any(s.mechanism is Mechanism.ACTIVATION_GROWTH for s in out):
            base, start = self._band(acts)
            step, last = _recent_peak(acts)
            cut = c.growth_factor * max(base, 1e-6)
            onset = self._exit(acts, lambda x: x > cut, start) if last > cut else None
            if onset is not None:
                who = self._closest(step)
                out.append(Signal(mechanism=Mechanism.ACTIVATION_GROWTH, module=who, onset=onset,
                                  evidence=(f"the largest activation grew from {_fmt(base)} (its level from step "
                                            f"{start}) to {_fmt(last)} by step {step} ({last / base:.0f}x, in "
                                            f"{who}); past {_fmt(cut)} from step {onset}",),
                                  growth=last / max(base, 1e-6), independent=False, key="activations/max"))
        eps = self.series.get("optimizer/adam_v_below_eps")
        if eps and eps[-1][1] > c.adam_eps_share and len(eps) > 3 and eps[-1][1] > eps[-4][1] + 0.02:
            # only while the share rises: a share falling from 93% as training gets going is Adam warming up
            onset = next((s for s, x in eps if x > c.adam_eps_share), eps[-1][0])
            out.append(Signal(mechanism=Mechanism.ADAM_SECOND_MOMENT, module=None, onset=onset,
                              evidence=(f"{eps[-1][1]:.0%} of Adam's second-moment entries have sqrt(v) below eps "
                                        f"at step {eps[-1][0]}, and rising (from {eps[-4][1]:.0%} at step "
                                        f"{eps[-4][0]})",), key="optimizer/adam_v_below_eps"))
        scale = self.series.get("optimizer/loss_scale")
        if scale:
            top = max(x for _, x in scale)
            step, last = scale[-1]
            if last > 0 and top / last >= c.loss_scale_drop:
                onset = next((s for s, x in scale if top / max(x, 1e-30) >= 2 and s > 0), step)
                out.append(Signal(mechanism=Mechanism.LOSS_SCALE_COLLAPSE, module=None, onset=onset,
                                  evidence=(f"GradScaler's loss scale fell from {top:g} to {last:g} by step {step}",)))
        out += self._lr_signals()
        out.sort(key=lambda s: (not s.independent, s.onset, -s.growth))
        return out

    def _of(self, stat: str, n: int) -> list[tuple[str, str, list[tuple[int, float]]]]:
        """(module, key, samples) of each series of ``stat`` with at least ``n`` samples, in the order recorded."""
        return [(key.rpartition("/")[0], key, pts) for key, pts in self.series.items()
                if key.rpartition("/")[2] == stat and len(pts) >= n]

    def _lr_signals(self) -> list[Signal]:
        """The step size that was applied: an update that climbs the gradient (an applied LR below zero), an
        applied LR of zero, or an LR the schedule kept raising past the loss's best level."""
        out: list[Signal] = []
        cos = [(s, x) for s, x in self.series.get("update/cosine", []) if math.isfinite(x)]
        # sustained: momentum turns single updates against a noisy gradient now and then, never for long
        up = self._exit(cos, lambda x: x < -0.2, 0, m=ASCENT_SAMPLES) if len(cos) >= ASCENT_SAMPLES else None
        i = next((i for i, (s, _) in enumerate(cos) if s == up), 0)
        if up is not None and sum(x for _, x in cos[i:i + ASCENT_SAMPLES]) / ASCENT_SAMPLES <= -0.3:
            at = dict(cos)[up]
            lr = self.lr_at(up)
            out.append(Signal(mechanism=Mechanism.LR_SCHEDULE, module=None, onset=up, evidence=(
                f"from step {up} the applied update climbs the gradient (cosine of the update with -grad "
                f"{at:.2f}, {_fmt(cos[-1][1])} at step {cos[-1][0]}): the LR applied inside the optimizer is negative"
                + (f" although the param group's lr is {lr:.3g}" if lr is not None and lr > 0 else ""),),
                key="update/cosine", independent=not self.live))
        ratio = self.series.get("update/ratio", [])
        norms = dict(self.series.get("grad/norm", []))
        zero = [s for s, x in ratio if x == 0 and norms.get(s, 0) > 0]
        if len(zero) >= 2 and zero[-1] == ratio[-1][0]:
            out.append(Signal(mechanism=Mechanism.LR_SCHEDULE, module=None, onset=zero[0], evidence=(
                f"from step {zero[0]} the update leaves the weights unchanged with non-zero gradients: the LR "
                "applied is zero",), independent=False, key="update/ratio"))
        lr = self.series.get("optimizer/lr", [])
        loss = self.series.get("train/loss", [])
        if len(lr) >= 3 and len(loss) >= 3:
            lv = _levels([x for _, x in loss])
            # the loss's best level: the break-away's (every step, a window of 10) where the judge found one
            b = self.best_step if self.best_step is not None else loss[min(range(len(lv)), key=lv.__getitem__)][0]
            at_best, now = self.lr_at(b - 1) or self.lr_at(b), lr[-1][1]   # the LR the best level was reached with
            if at_best and at_best > 0 and now >= 2 * at_best and now >= lr[-2][1] and b < lr[-1][0]:
                # from the loss's best level, the first step the schedule took the LR further up
                up = next((s for s, x in lr if s >= b and x > 1.2 * at_best), b)
                out.append(Signal(mechanism=Mechanism.LR_SCHEDULE, module=None, onset=up, evidence=(
                    f"the LR schedule kept raising the LR past the loss's best level: {at_best:.3g} at step {b} -> "
                    f"{now:.3g} at step {lr[-1][0]} ({now / at_best:.1f}x, still rising)",),
                    growth=now / at_best, independent=False, key="optimizer/lr"))
        return out

    def lr_at(self, step: int) -> float | None:
        at = [x for s, x in self.series.get("optimizer/lr", []) if s <= step]
        return at[-1] if at else None

    def behind(self, step: int, best_step: int | None = None) -> Signal | None:
        """An independent precursor behind a loss that broke away from its best level at ``best_step``
        (``Judge.behind``): one out of its band by ``step``, or one that grew ``growth_factor`` times (past its
        absolute limit) from its level where the loss was best. None when nothing stands behind the rise."""
        sig = next((s for s in self.signals() if s.independent and s.onset <= step), None)
        return self._grew_since(best_step) if sig is None and best_step is not None else sig

    def _excess(self, key: str) -> list[tuple[int, float]]:
        """A series against its resting level: output log Z above log(classes); the others (all >= 0) as they are."""
        log_c = math.log(self.classes) if self.classes and key.endswith("/logsumexp") else 0.0
        return [(s, abs(x - log_c)) for s, x in self.series.get(key, [])]

    def _at(self, pts: list[tuple[int, float]], best: int) -> list[float]:
        """A series' last ``baseline_samples`` values up to ``best`` (its level where the loss was at its best)."""
        return [x for s, x in pts if s <= best][-max(self.cfg.baseline_samples, 1):]

    def precursor(self, facts: dict[str, Any], patience: int) -> str | None:
        """What stands behind a break-away of the loss (``Judge``'s second signal, for replay, smoke and the live
        guards): an independent monitor signal out of its band, or, judged over a longer stretch (a warm
        restart's bump comes back, an LR jump that broke the run does not), an update size that rose past its
        level at the loss's best step."""
        self.best_step = facts["best_step"]
        sig = self.behind(facts["step"], facts["best_step"])
        if sig is not None:
            return f"{sig.mechanism.value}: {sig.headline()}"
        if facts["step"] - facts["since"] + 1 >= 3 * patience:
            return self.update_rise(facts["best_step"], facts["since"])
        return None

    def update_rise(self, best: int, since: int) -> str | None:
        """The update size |dw|/|w| over a break-away (from ``since``) against its level where the loss was best:
        ``UPDATE_RISE`` times higher is a sustained rise (an LR jump, a schedule gone wrong), or None."""
        pts = self.series.get("update/ratio", [])
        healthy = self._at(pts, best)
        now = [x for s, x in pts if s >= since]
        if len(now) < 3 or not healthy:
            return None
        a, b = statistics.median(healthy), statistics.median(now)
        if a <= 0 or b < UPDATE_RISE * a:
            return None
        return (f"the update size rose with it: |dw|/|w| {b:.2g} since step {since} against {a:.2g} where the loss was "
                f"best ({b / a:.0f}x)")

    def onset_since(self, sig: Signal, best: int) -> int | None:
        """For a run that broke away from its best level at step ``best``: the first sustained exit of ``sig``'s
        series from its level there (the end of the run's healthy stretch), growth_factor x the smallest of its
        last samples up to ``best``. None where the series gives none (entropy, the LR: their own onsets stand)."""
        vals = self._excess(sig.key or "")
        ref = self._at(vals, best)
        if (sig.key or "").rpartition("/")[2] not in ("max_logit", "logsumexp", "max") or len(vals) < 3 or not ref:
            return None
        cut = self.cfg.growth_factor * max(min(ref), 1e-6)
        return self._exit(vals, lambda x: x > cut, best)

    def _grew_since(self, best: int) -> Signal | None:
        """A precursor that left the level it had where the loss was best (the healthy stretch of a run that
        broke away early, before any band after warm-up could form)."""
        c = self.cfg
        grows = {"max_logit": (c.attention_logit_limit, Mechanism.ATTENTION_LOGIT_GROWTH, "attention logits"),
                 "logsumexp": (c.output_logsumexp_limit, Mechanism.OUTPUT_LOGIT_DIVERGENCE,
                               f"output log Z (above log {self.classes} classes)")}
        for key in self.series:
            module, _, stat = key.rpartition("/")
            if stat not in grows:
                continue
            limit, mech, what = grows[stat]
            vals = self._excess(key)
            ref = self._at(vals, best)
            if not ref or len(vals) < 3:
                continue
            base = max(min(ref), 1.0)   # logits and log Z in nats: below 1 is no level to grow from
            step, last = _recent_peak(vals)
            cut = c.growth_factor * base
            if last < limit or last < cut:
                continue
            onset = self._exit(vals, lambda x: x > cut, best) or step
            return Signal(mechanism=mech, module=module or None, onset=onset, evidence=(
                f"{what} grew from {_fmt(base)} where the loss was at its best (step {best}) to {_fmt(last)} by step "
                f"{step} ({last / base:.0f}x); past {_fmt(cut)} from step {onset}",), growth=last / base, key=key)
        acts = self.series.get("activations/max", [])
        ref = self._at(acts, best)
        if ref and len(acts) >= 3:
            # the largest activation, growth_factor^2 times its level at the loss's best: no confident head grows
            # like that (a classifier's logits do by growth_factor)
            base = max(min(ref), 1e-6)
            step, last = _recent_peak(acts)
            cut = c.growth_factor ** 2 * base
            if last >= cut:
                onset = self._exit(acts, lambda x: x > c.growth_factor * base, best) or step
                who = self._closest(step)
                return Signal(mechanism=Mechanism.ACTIVATION_GROWTH, module=who, onset=onset, evidence=(
                    f"the largest activation grew from {_fmt(base)} where the loss was at its best (step {best}) to "
                    f"{_fmt(last)} by step {step} ({last / base:.0f}x, in {who}); past {_fmt(c.growth_factor * base)} "
                    f"from step {onset}",), growth=last / base, key="activations/max")
        return None

    def lr_note(self, onset: int) -> str | None:
        """What the LR was doing at the onset, in words from its direction (and the update that was applied)."""
        lr = self.series.get("optimizer/lr", [])
        at = [x for s, x in lr if s <= onset]
        if not at:
            return None
        now, first, peak = at[-1], lr[0][1], max(x for _, x in lr)
        prev = at[-3] if len(at) >= 3 else first
        ratio = [x for s, x in self.series.get("update/ratio", []) if s <= onset]
        applied = f"; the update moved the weights by {ratio[-1]:.2g} of their norm (|dw|/|w|)" if ratio else ""
        if now > prev * 1.001:
            return (f"began while the LR was rising (LR {now:.3g} at step {onset}, from {first:.3g}; peak "
                    f"{peak:.3g}){applied}: a lower peak LR or a longer warm-up delays it")
        if now < prev * 0.999:
            return f"began while the LR was decaying (LR {now:.3g} at step {onset}, from a peak of {peak:.3g}){applied}"
        if peak <= min(x for _, x in lr) * 1.001:
            return f"LR {now:.3g}, constant{applied}"
        return f"LR {now:.3g} at step {onset} (peak {peak:.3g}){applied}"

    def warn(self, step: int) -> dict[str, Any] | None:
        """The early warning, once per run: an independent precursor trending toward failure, with a second
        sign that it is one: a dtype limit it is projected to cross, or a loss that stopped improving."""
        sig = None if self.warnings else next((s for s in self.signals() if s.independent and s.mechanism in _WARN_FIXES
                                              and (s.projected is not None or self.loss_rising())), None)
        if sig is None:
            return None
        line = f"{sig.headline()}: {sig.mechanism.value}"
        if sig.projected is not None:
            line += f"; the {_dtype_name(self.dtype)} max would be crossed {_steps(sig.projected)}"
        line += f"; fixes: {_WARN_FIXES[sig.mechanism]}"
        w = {"step": step, "mechanism": sig.mechanism.value, "module": sig.module, "onset": sig.onset,
             "projected_step": sig.projected[0] if sig.projected else None,
             "projected_range": list(sig.projected) if sig.projected else None, "message": line}
        self.warnings.append(w)
        return w

    def to_json(self, onset: int | None = None) -> dict[str, Any]:
        if onset is None:
            onset = next((sig.onset for sig in self.signals()), None)
        return {"onset": onset,
                "series": {k: [[s, _clean(x)] for s, x in pts] for k, pts in self.series.items()},
                "warnings": list(self.warnings)}


_WARN_FIXES = {
    Mechanism.LR_SCHEDULE: "check the LR the optimizer applies (a schedule inside step(), its t_total)",
    Mechanism.ATTENTION_LOGIT_GROWTH: "qk-layernorm, a lower peak LR or a longer warm-up",
    Mechanism.OUTPUT_LOGIT_DIVERGENCE: "z-loss (1e-4 * logsumexp^2), a lower LR",
    Mechanism.ACTIVATION_GROWTH: "bf16 instead of fp16, a lower LR",
    Mechanism.ADAM_SECOND_MOMENT: "a smaller AdamW eps (1e-15) or a lower beta2",
}


def _levels(vals: list[float]) -> list[float]:
    """The running median of 5 samples: a monitored series' level."""
    return [sorted(vals[max(0, i - 4):i + 1])[min(i, 4) // 2] for i in range(len(vals))]


def _clean(x: float) -> float:
    return float(f"{x:.6g}")


def _dtype_name(dtype: torch.dtype | None) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", None: "fp32"}.get(dtype, str(dtype))


def _steps(projected: tuple[int, int]) -> str:
    """``(a, b)`` as "at step a" or "between step a and b"."""
    a, b = projected
    return f"at step {a}" if a == b else f"between step {a} and {b}"


def _project(pts: list[tuple[int, float]], limit: float, window: int = 3) -> tuple[int, int] | None:
    """When a series growing over its last ``window`` samples reaches ``limit``: the earliest step
    (exponential growth at the current rate) and the latest (power-law growth at the current
    exponent; under Adam the q/k weights drift about linearly, so q.k grows about quadratically)."""
    tail = [(s, x) for s, x in pts[-window:] if x > 0]
    if len(tail) < 2:
        return None
    (s0, x0), (s1, x1) = tail[0], tail[-1]
    if x1 <= x0 or s1 <= s0 or x1 >= limit:
        return None
    rate = (math.log(x1) - math.log(x0)) / (s1 - s0)   # log growth per step
    early = s1 + math.ceil((math.log(limit) - math.log(x1)) / rate)
    power = (math.log(x1) - math.log(x0)) / (math.log(s1 + 1) - math.log(s0 + 1))
    late = math.ceil((s1 + 1) * (limit / x1) ** (1 / power)) - 1
    if early - s1 > 100_000:
        return None
    return early, min(max(late, early), s1 + 100_000)


__all__ = ["curves_at", "CURVE_SUFFIXES", "Monitor", "Sample", "Signal", "Trend", "attention_modules"]


def live_monitor(model: torch.nn.Module, config: Any, precision: Any) -> Monitor | None:
    """The monitor of a live run (Guard, watch, callbacks): every ``monitor.live_every`` steps."""
    from ..base.config import Config, load_config
    cfg = config.monitor if isinstance(config, Config) else load_config().monitor
    if not cfg.enabled:
        return None
    low = getattr(precision, "low", False)
    return Monitor(model, cfg, dtype=precision.dtype if low else None, every=cfg.live_every, live=True)


# the precursor series a live run logs beside the user's own scalars (the loss, LR and grad norm are the user's)
CURVE_SUFFIXES = ("/max_logit", "/entropy", "/logsumexp", "/logit_mean", "activations/max", "activations/headroom_bits",
                  "optimizer/adam_v_below_eps", "optimizer/loss_scale")


def curves_at(trend: Trend, step: int) -> dict[str, float]:
    """The precursor series' values recorded at ``step``, as ``nanprobe/<series>`` scalars."""
    return {f"nanprobe/{k}": v[-1][1] for k, v in trend.series.items()
            if v and v[-1][0] == step and k.endswith(CURVE_SUFFIXES) and math.isfinite(v[-1][1])}


def close_step(monitor: Monitor | None, step: int, *, loss: float | None, grad_norm: float | None,
               lr: float | None, scaler: Any, optimizers: Iterable[torch.optim.Optimizer], logger: Any
               ) -> dict[str, Any] | None:
    """End a live monitored step; log and return the run's one early warning when it comes now."""
    if monitor is None or not monitor._active:
        return None
    scale = float(scaler.get_scale()) if scaler is not None else None
    monitor.end(step, loss=loss, grad_norm=grad_norm, lr=lr, scale=scale, optimizers=optimizers)
    w = monitor.trend.warn(step)
    if w is not None:
        logger.warning("nanprobe: early warning at step %d: %s", step, w["message"])
    return w
