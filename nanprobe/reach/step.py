"""One training step of the user's loop, as nanprobe runs it everywhere (replay, reruns, smoke).

Two forms, chosen by the target:

* ``loss_fn`` — the canonical loop: ``zero_grad``; for each micro-batch of the step, autocast
  forward + loss and ``backward`` (scaled with a GradScaler); ``unscale_``, clip, ``step`` each
  optimizer, ``update`` the scaler; step the schedulers (also when GradScaler skipped, unless
  ``scheduler_on_skip`` is false).
* ``step_fn`` — the user's whole step (several optimizers or losses, a GAN, a closure, a hand-set
  LR). nanprobe watches it through hooks: optimizer step pre/post hooks (phase, gradient norm,
  LR, fix overrides), ``torch.autograd.backward``/``grad`` (phase, the losses backpropagated),
  ``clip_grad_norm_`` (the norm before clipping), ``GradScaler.scale`` (the unscaled loss) and
  ``torch.autocast`` (the precision the step uses; a rerun in another precision rewrites it).

Neither form calls ``model.train()``: every module keeps the train/eval flag the target returned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.autocast_mode import autocast as _autocast_cls

from ..base.batch import iter_tensors
from ..base.errors import TargetError, UserExit
from .feed import LiveFeed, MicroBatches, ReplayFeed
from .hooks import Patch, ScriptHooks
from ..base.precision import Precision, autocast_context, device_of, numeric_mode, policy_context
from ..base.report import Phase
from .state import Objects, objects_of
from .target import Target, call_user, check_loss

Feed = LiveFeed | ReplayFeed
_KEEP = object()   # RunOptions.scaler: use the loop's own GradScaler


def make_scaler(target: Target, precision: Precision, device_type: str) -> torch.amp.GradScaler | None:
    """nanprobe's GradScaler for a ``loss_fn`` target with ``grad_scaler: True`` trained in fp16."""
    if precision is Precision.FP16 and target.grad_scaler is True and target.optimizers:
        return torch.amp.GradScaler(device_type)
    return None


def current_lr(optimizer: torch.optim.Optimizer) -> float | None:
    if not optimizer.param_groups:
        return None
    lr = optimizer.param_groups[0].get("lr")
    if isinstance(lr, torch.Tensor):
        return float(lr.item()) if lr.numel() == 1 else None
    return float(lr) if isinstance(lr, (int, float)) else None


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the batch's first tensor: the sample axis by convention."""
    for _, t in iter_tensors(batch):
        if t.dim() >= 1:
            return int(t.shape[0])
    return None


def _sum(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """``ts[0] + ts[1] + ...`` (each on the first's device); None for none."""
    return functools.reduce(lambda a, b: a + b.to(a.device), ts) if ts else None


def _total_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The norm of several norms (of one: itself)."""
    return norms[0] if len(norms) == 1 else torch.stack([n.float().to(norms[0].device) for n in norms]).norm()


@dataclass(slots=True)
class StepOutcome:
    """What one step did, as device tensors (read back by the caller with one sync)."""

    loss: torch.Tensor | None                  # sum of the step's losses (detached scalar)
    losses: dict[str, torch.Tensor | float] = field(default_factory=dict)  # per micro-batch / per returned key
    grad_norm: torch.Tensor | None = None      # global gradient norm (before clipping where the step clips)
    lr: float | None = None                    # the learning rate the step used (first optimizer)
    found_inf: torch.Tensor | None = None      # >0: a GradScaler found inf/NaN gradients and skipped
    scale: torch.Tensor | None = None          # the loss scale the step used
    autocast: tuple[str, ...] = ()             # autocast dtypes the step entered (step_fn)
    precision_applied: bool = True             # False: a rerun precision could not be applied (step_fn)


@dataclass(slots=True)
class RunOptions:
    """How to run one step: precision and the overrides reruns and fix verification use."""

    precision: Precision
    policy: str = "native"
    on_phase: Callable[[Phase], None] | None = None
    on_micro: Callable[[int], None] | None = None
    max_grad_norm: float | None = None        # clip at this instead (loss_fn) / in addition (step_fn)
    lr_scale: float | tuple[float, ...] | None = None   # multiply every group's LR (or each group's) this step
    param_overrides: dict[str, Any] | None = None   # e.g. {"eps": 1e-8} for every param group
    scaler: Any = _KEEP                       # loss_fn: a GradScaler to use instead of the loop's own (None: none)
    stop_before_update: bool = False          # loss_fn: end after the gradients (no optimizer step, no schedule)


class Loop:
    """The target's training loop: its form, its objects (for snapshots) and nanprobe's GradScaler."""

    def __init__(self, target: Target, where: str, precision: Precision | None = None, policy: str = "native"):
        self.target = target
        self.where = where
        self.precision = precision or target.precision
        self.policy = policy
        self.device_type = device_of(target.model).type
        users = target.user_scalers   # the user's own GradScaler object, if any, drives the canonical loop
        self.scaler = None if target.loss_fn is None else (
            users[0][1] if users else make_scaler(target, self.precision, self.device_type))
        own = [("GradScaler", self.scaler)] if self.scaler is not None and not users else []
        self.objects: Objects = objects_of(target, own_scalers=own)
        self.updates_in_step = 0
        # the parameter lists, walked once (a module tree walk costs ~1 ms on a 60-module model)
        self.named_params: list[tuple[str, torch.nn.Parameter]] = list(target.model.named_parameters())
        self.params = [p for _, p in self.named_params]

    def run(self, feed: Feed, options: RunOptions | None = None) -> StepOutcome:
        """Run one step on ``feed``'s micro-batches. ``updates_in_step`` counts the optimizer
        updates it applied (to tell, when the user's code raises, whether the state moved)."""
        o = options or RunOptions(precision=self.precision, policy=self.policy)
        feed.on_micro = o.on_micro
        self.updates_in_step = 0
        try:
            if self.target.step_fn is not None:
                return _run_user_step(self, feed, o)
            return _run_canonical(self, feed, o)
        except UserExit as exc:
            raise exc.at_step(feed.step) from None


# -- fix overrides on the optimizer update ----------------------------------------------------------

_MISSING = object()


def _override_groups(opt: torch.optim.Optimizer, lr_scale: float | None,
                     param_overrides: Mapping[str, Any] | None) -> list[tuple[dict, dict]]:
    """Scale each group's LR / set group keys; returns what :func:`_restore_groups` puts back."""
    saved: list[tuple[dict, dict]] = []
    keys = set(param_overrides or ()) | ({"lr"} if lr_scale is not None else set())
    for i, g in enumerate(opt.param_groups):
        saved.append((g, {k: g.get(k, _MISSING) for k in keys}))
        scale = lr_scale[i] if isinstance(lr_scale, tuple) and i < len(lr_scale) else lr_scale
        if isinstance(scale, (int, float)):
            g["lr"] = g["lr"] * scale
        if param_overrides:
            g.update(param_overrides)
    return saved


def _restore_groups(saved: list[tuple[dict, dict]]) -> None:
    """The same group dicts get their values back (their identity never changes)."""
    for g, values in saved:
        for k, v in values.items():
            if v is _MISSING:
                g.pop(k, None)
            else:
                g[k] = v


# -- the canonical loss_fn loop ---------------------------------------------------------------------

def _run_canonical(loop: Loop, feed: Feed, o: RunOptions) -> StepOutcome:
    t = loop.target
    opts = t.optimizers
    scaler = loop.scaler if o.scaler is _KEEP else o.scaler
    if scaler is not None and not scaler.is_enabled():
        scaler = None
    phase = o.on_phase or (lambda p: None)
    clip = o.max_grad_norm if o.max_grad_norm is not None else t.max_grad_norm
    for holder in [opt for _, opt in opts] or [t.model]:
        holder.zero_grad(set_to_none=True)
    micro: list[torch.Tensor] = []
    while (batch := feed.get(len(micro))) is not None:
        phase(Phase.FORWARD)
        # a pure low-precision run enters no autocast: its precision is its weights' dtype (a rerun in
        # another precision casts the weights, see rerun._cast_weights)
        with numeric_mode(o.precision, loop.device_type), policy_context(o.policy, o.precision, loop.device_type), \
                autocast_context(o.precision, loop.device_type, enabled=not t.pure):
            loss = call_user("loss_fn(model, batch)", t.loss_fn, t.model, batch)
        loss = check_loss(loss, loop.where)
        phase(Phase.BACKWARD)
        call_user("loss.backward()", (scaler.scale(loss) if scaler is not None else loss).backward)
        micro.append(loss.detach())
    phase(Phase.UPDATE)
    infs, scale = [], None
    if scaler is not None and opts:
        scale = scaler._scale.detach().clone() if scaler._scale is not None else None
        for _, opt in opts:
            call_user("scaler.unscale_(optimizer)", scaler.unscale_, opt)
            infs += [v.float() for v in scaler._found_inf_per_device(opt).values()]
    found = _sum(infs)
    with_grad = [p for p in loop.params if p.grad is not None]
    grad_norm = None if not with_grad else (torch.nn.utils.clip_grad_norm_(with_grad, clip) if clip
                                            else torch.nn.utils.get_total_norm([p.grad for p in with_grad])).detach()
    out = StepOutcome(loss=_sum(micro),
                      losses={f"micro-batch {i}": v for i, v in enumerate(micro)} if len(micro) > 1 else {},
                      grad_norm=grad_norm, lr=current_lr(opts[0][1]) if opts else None, found_inf=found,
                      scale=scale)
    if o.stop_before_update:
        return out
    if opts:
        saved = [s for _, opt in opts for s in _override_groups(opt, o.lr_scale, o.param_overrides)]
        try:
            for _, opt in opts:
                loop.updates_in_step += 1
                if scaler is not None:
                    call_user("scaler.step(optimizer)", scaler.step, opt)
                else:
                    call_user("optimizer.step()", opt.step)
        finally:
            _restore_groups(saved)
        if scaler is not None:
            call_user("scaler.update()", scaler.update)
    # a GradScaler skip steps no scheduler unless scheduler_on_skip (the loop branches on it, as the user's does)
    if t.schedulers and (found is None or t.scheduler_on_skip or not found.item() > 0):
        for name, sched in t.schedulers:
            call_user(f"{name}.step()", sched.step)
    return out


# -- the user's own step ----------------------------------------------------------------------------

def _as_losses(result: Any, seen: list[torch.Tensor]) -> dict[str, torch.Tensor | float]:
    """step_fn's return value -> named losses; when it returned nothing, what it scaled, else what it
    backpropagated (``seen``)."""
    if result is None:
        return {"loss": seen[0]} if len(seen) == 1 else {f"loss[{i}]": v for i, v in enumerate(seen)}
    named = result.items() if isinstance(result, Mapping) else \
        [(f"loss[{i}]", v) for i, v in enumerate(result)] if isinstance(result, (tuple, list)) else [("loss", result)]
    return {str(k): v for k, v in named if isinstance(v, (torch.Tensor, int, float)) and not isinstance(v, bool)}


def _scalar(v: torch.Tensor | float, where: str, name: str) -> torch.Tensor | float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise TargetError(f"step_fn returned {name} of shape {tuple(v.shape)}, not a scalar", where,
                              "Return the scalar loss(es) of the step, e.g. {'loss_d': loss_d, 'loss_g': loss_g}")
        return v.detach().reshape(()).float()
    return float(v)


class _StepWatch(ScriptHooks):
    """The hooks (:class:`~nanprobe.reach.hooks.ScriptHooks`, on the target's optimizers) and scoped patches
    that watch a user's step (see the module docstring)."""

    def __init__(self, loop: Loop, o: RunOptions):
        super().__init__([opt for _, opt in loop.target.optimizers])
        self.loop, self.o = loop, o
        self.current: Phase | None = None
        self.norms: list[torch.Tensor] = []
        self.pending_clip: list[torch.Tensor] = []
        self.lr: float | None = None
        self.losses: list[torch.Tensor] = []   # what the step scaled with GradScaler, else backpropagated
        self.dtypes: list[str] = []
        self.entered_autocast = False
        self._saved_groups: dict[int, list[tuple[dict, dict]]] = {}
        self._clip_original = torch.nn.utils.clip_grad_norm_
        self._model_modules = {id(m) for m in loop.target.model.modules()} if o.on_phase else set()

    def set_phase(self, p: Phase) -> None:
        if self.o.on_phase is not None and p is not self.current:
            self.current = p
            self.o.on_phase(p)

    # -- context --
    def __enter__(self) -> _StepWatch:
        self.install()
        self.set_phase(Phase.FORWARD)
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()
        for saved in self._saved_groups.values():
            _restore_groups(saved)
        self._saved_groups.clear()

    def extra_patches(self) -> list[Patch]:
        if self.o.on_phase is not None:
            self._hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(self._forward_pre))
        grad, enter, exit_ = torch.autograd.grad, _autocast_cls.__enter__, _autocast_cls.__exit__
        want = self.o.precision

        @functools.wraps(grad)
        def phased_grad(*args, **kwargs):
            before = self.current
            self.set_phase(Phase.BACKWARD)
            try:
                return grad(*args, **kwargs)
            finally:
                if before is not None:
                    self.set_phase(before)

        @functools.wraps(enter)
        def __enter__(ac):
            if getattr(ac, "device", None) == self.loop.device_type:
                self.entered_autocast = True
                if ac._enabled:
                    self.dtypes.append(str(ac.fast_dtype).replace("torch.", ""))
                    if want is not self.loop.precision:   # a rerun in another precision
                        ac._nanprobe_saved = ac.fast_dtype
                        if want.autocast:
                            ac.fast_dtype = want.dtype
                        else:
                            ac._enabled = False
            return enter(ac)

        @functools.wraps(exit_)
        def __exit__(ac, *exc):
            try:
                return exit_(ac, *exc)
            finally:
                saved = ac.__dict__.pop("_nanprobe_saved", None)
                if saved is not None:   # the user's autocast object (maybe reused each step) gets its settings back
                    ac._enabled, ac.fast_dtype = True, saved
        return [Patch(torch.autograd, "grad", phased_grad), Patch(_autocast_cls, "__enter__", __enter__),
                Patch(_autocast_cls, "__exit__", __exit__)]

    # -- phases --
    def _forward_pre(self, module, args) -> None:
        if id(module) in self._model_modules and self.current is not Phase.FORWARD and \
                torch._C._current_autograd_node() is None:
            self.set_phase(Phase.FORWARD)

    def on_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach().reshape(()).float())

    def on_backward(self) -> None:
        self.set_phase(Phase.BACKWARD)

    def after_backward(self) -> None:
        self.set_phase(Phase.UPDATE)   # gradient processing until the next forward or step

    def on_clip(self, norm: torch.Tensor, max_norm: Any) -> None:
        self.pending_clip.append(norm)

    # -- the optimizer update --
    def wants_closure(self) -> bool:
        return False   # the pre-step event comes before a closure optimizer's step too

    def before_step(self, opt: torch.optim.Optimizer) -> None:
        self.set_phase(Phase.UPDATE)
        o = self.o
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if self.pending_clip:   # the step clipped: its clip_grad_norm_ returned the norm before clipping
            norm = _total_norm(self.pending_clip)
            self.pending_clip.clear()
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else None
        if norm is not None:
            self.norms.append(norm.detach().float())
        if o.max_grad_norm is not None and params:   # a clipping fix, on top of whatever the step does
            self._clip_original(params, o.max_grad_norm)
        self._saved_groups[id(opt)] = _override_groups(opt, o.lr_scale, o.param_overrides)
        if self.lr is None:
            self.lr = current_lr(opt)
        self.loop.updates_in_step += 1

    update_begins = before_step   # inside GradScaler.step

    def step_done(self, opt: torch.optim.Optimizer) -> None:
        _restore_groups(self._saved_groups.pop(id(opt), []))


def _run_user_step(loop: Loop, feed: Feed, o: RunOptions) -> StepOutcome:
    t = loop.target
    scalers = [s for _, s in t.user_scalers if s.is_enabled()]   # a disabled GradScaler scales nothing
    before = [s._scale.detach().clone() if getattr(s, "_scale", None) is not None else None for s in scalers]
    watch = _StepWatch(loop, o)
    with watch:
        batch = feed.get(0) if t.accumulate == 1 else MicroBatches(feed)
        result = call_user("step_fn(model, batch, step)", t.step_fn, t.model, batch, feed.step)
    feed.finish()
    losses = {k: _scalar(v, loop.where, k) for k, v in _as_losses(result, watch.losses).items()}
    # a dict with a "loss" key is Lightning's convention: that entry is the loss, the others are what the step
    # reports beside it (accuracy, returns, a counter); a dict without one is several losses (a GAN's), summed
    parts = [torch.as_tensor(v, dtype=torch.float32, device=device_of(t.model))
             for v in ([losses["loss"]] if "loss" in losses else losses.values())]
    # no optimizer step saw a norm: clipped, then updated without an optimizer (hand-written SGD)
    norms = watch.norms or [n.float() for n in watch.pending_clip]
    starts = [(s, b if b is not None else torch.full_like(s._scale, s._init_scale))
              for s, b in zip(scalers, before) if getattr(s, "_scale", None) is not None]
    lr = watch.lr if watch.lr is not None else (current_lr(t.optimizers[0][1]) if t.optimizers else None)
    applied = o.precision is loop.precision or watch.entered_autocast or not o.precision.autocast or t.pure
    return StepOutcome(loss=_sum(parts), losses=losses if len(losses) > 1 else {},
                       grad_norm=_total_norm(norms) if norms else None, lr=lr,
                       found_inf=_sum([(s._scale < b).float().reshape(()) for s, b in starts]),
                       scale=starts[0][1].reshape(()) if starts else None,
                       autocast=tuple(dict.fromkeys(watch.dtypes)), precision_applied=applied)


__all__ = ["Loop", "RunOptions", "StepOutcome", "make_scaler", "current_lr", "batch_size", "Patch"]
