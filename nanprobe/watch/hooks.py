"""A script's training step as events, from PyTorch's global hooks and a few scoped patches.

``watch`` (:class:`~nanprobe.watch.watcher.Watcher`) and ``watch --at`` (:class:`~nanprobe.watch.armed.StepHooks`)
see the same script the same way: the global optimizer step pre/post hooks, and patches of
``torch.autograd.backward``, ``GradScaler.scale``/``step`` and ``clip_grad_norm_`` (undone on exit). This
base installs them and turns them into the events below; each subclass says what an event means to it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..base.precision import Precision
from ..reach.forward import ForwardStep
from ..reach.step import Patch
from ..reach.target import Target, validate


def forward_target(model: torch.nn.Module, opt: torch.optim.Optimizer | None, autocast: str | None, device: str,
                   who: str, schedulers: Any = (), **more: Any) -> tuple[Target, Precision]:
    """The root module's forward as the Target the diagnosis reruns (its optimizer and schedulers when the
    optimizer updates only the module's own parameters), and the precision of its autocast dtype."""
    own = {id(q) for q in model.parameters()}
    use_opt = opt is not None and all(id(q) in own for g in opt.param_groups for q in g["params"])
    scheds = [s for s in list(schedulers) if use_opt and getattr(s, "optimizer", None) is opt]
    precision = {"bfloat16": Precision.BF16, "float16": Precision.FP16}.get(autocast, Precision.FP32)
    return validate({"model": model, "step_fn": ForwardStep(device), "batches": [],
                     "optimizer": opt if use_opt else None, "scheduler": scheds or None, "precision": precision,
                     **more}, who), precision


def unscale_ready(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """What ``GradScaler.step`` does first, done before it: the check sees unscaled gradients."""
    if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


class ScriptHooks:
    """The guarded optimizer (the first that steps) and its steps, seen through global hooks."""

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None   # the guarded one: the first that steps
        self.scaled: set[int] = set()        # ids of this step's GradScaler.scale outputs (not losses)
        self._in_scaler_step = False         # inside GradScaler.step: the optimizer step is its
        self.scaler_seen: torch.amp.GradScaler | None = None   # the GradScaler the script scales its loss with
        self._patches: list[Patch] = []
        self._hooks: list[Any] = []

    # -- what a subclass says ---------------------------------------------------------------------------

    def active(self) -> bool:
        """The hooks act on the script's calls (False: nanprobe is rerunning, or its work is done)."""
        return True

    def listening(self) -> bool:
        """The script's losses, backward and clip norm are taken now."""
        return self.active()

    def on_loss(self, loss: torch.Tensor) -> None:
        """A one-element tensor the script backpropagates (or hands to GradScaler.scale)."""

    def on_backward(self) -> None:
        """The script calls backward."""

    def after_backward(self) -> None:
        """The script's backward returned (its gradients are there)."""

    def on_clip(self, norm: torch.Tensor, max_norm: float) -> None:
        """The script clipped its gradients: their norm before clipping."""

    def before_scaler_step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """GradScaler.step of the guarded optimizer is about to run."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step() of the guarded optimizer is about to run (not inside GradScaler.step)."""

    def update_begins(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step inside GradScaler.step begins."""

    def wants_closure(self) -> bool:
        """A closure optimizer's closure is wrapped (its first evaluation calls :meth:`closure_evaluated`)."""
        return True

    def closure_evaluated(self, optimizer: torch.optim.Optimizer) -> None:
        """A closure optimizer evaluated the step's closure for the first time (its loss and gradients)."""

    def step_done(self) -> None:
        """The guarded optimizer's step (or GradScaler.step) returned: the script's step is over."""

    def extra_patches(self) -> list[Patch]:
        """More patches a subclass installs with the others."""
        return []

    # -- install / remove -------------------------------------------------------------------------------

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        try:
            self._hooks.append(register_optimizer_step_pre_hook(self._opt_pre))
            self._hooks.append(register_optimizer_step_post_hook(self._opt_post))
            self._patches.append(Patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward)))
            self._patches.append(Patch(torch.amp.GradScaler, "scale", self._wrap_scale(torch.amp.GradScaler.scale)))
            self._patches.append(Patch(torch.amp.GradScaler, "step",
                                       self._wrap_scaler_step(torch.amp.GradScaler.step)))
            clip = self._wrap_clip(torch.nn.utils.clip_grad_norm_)
            self._patches.append(Patch(torch.nn.utils, "clip_grad_norm_", clip))
            self._patches.append(Patch(torch.nn.utils.clip_grad, "clip_grad_norm_", clip))
            self._patches.extend(self.extra_patches())
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        for p in reversed(self._patches):
            p.undo()
        for h in self._hooks:
            h.remove()
        self._patches, self._hooks = [], []

    # -- the script's calls -----------------------------------------------------------------------------

    def _wrap_backward(self, original):
        def backward(tensors, *args, **kwargs):
            if self.listening():
                for t in (tensors if isinstance(tensors, (tuple, list)) else (tensors,)):
                    if isinstance(t, torch.Tensor) and t.numel() == 1 and id(t) not in self.scaled:
                        self.on_loss(t)
                self.on_backward()
            out = original(tensors, *args, **kwargs)
            if self.active():
                self.after_backward()
            return out
        return backward

    def _wrap_scale(self, original):
        def scale(scaler, outputs):
            out = original(scaler, outputs)
            if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 and self.listening():
                self.scaler_seen = scaler
                self.scaled.add(id(out))
                self.on_loss(outputs)
            return out
        return scale

    def _wrap_clip(self, original):
        def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
            norm = original(parameters, max_norm, *args, **kwargs)
            if self.listening() and isinstance(norm, torch.Tensor):
                self.on_clip(norm.detach(), float(max_norm))
            return norm
        return clip_grad_norm_

    def _wrap_scaler_step(self, original):
        def step(scaler, optimizer, *args, **kwargs):
            guarded = self.active() and scaler.is_enabled() and \
                (self.optimizer is None or optimizer is self.optimizer) and "closure" not in kwargs
            if not guarded:
                return original(scaler, optimizer, *args, **kwargs)
            self.optimizer = optimizer
            self.before_scaler_step(scaler, optimizer)
            self._in_scaler_step = True
            try:
                out = original(scaler, optimizer, *args, **kwargs)
            finally:
                self._in_scaler_step = False
            self.step_done()   # also when the scaler skipped optimizer.step(): the script's step is over
            return out
        return step

    def _opt_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self.active():
            return None
        if self.optimizer is None:
            self.optimizer = opt
        if opt is not self.optimizer:
            return None
        if self._in_scaler_step:   # seen in GradScaler.step already
            self.update_begins(opt)
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)   # args: (optimizer, closure)
        if callable(closure):   # LBFGS & co: the step's forward and backward happen inside step()
            return self._wrap_closure(opt, closure, args, kwargs) if self.wants_closure() else None
        self.before_step(opt)
        return None

    def _wrap_closure(self, opt: torch.optim.Optimizer, closure: Any, args: tuple,
                      kwargs: dict) -> tuple[tuple, dict]:
        """The closure the optimizer gets instead: its first evaluation is the step's; later ones (LBFGS's
        line search) are not new steps."""
        first = [True]

        def guarded():
            loss = closure()
            if first[0]:
                first[0] = False
                self.closure_evaluated(opt)
            return loss

        if "closure" in kwargs:
            return args, dict(kwargs, closure=guarded)
        return (args[0], guarded, *args[2:]), kwargs

    def _opt_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.active() and opt is self.optimizer and not self._in_scaler_step:
            self.step_done()


__all__ = ["ScriptHooks", "unscale_ready", "forward_target"]
