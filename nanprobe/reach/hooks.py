"""A training step as events, from PyTorch's hooks and a few scoped patches.

The replay of a user's ``step_fn`` (:mod:`nanprobe.reach.step`), ``watch``
(:class:`~nanprobe.watch.watcher.Watcher`) and ``watch --at`` (:class:`~nanprobe.watch.armed.StepHooks`) see a
step the same way: the optimizer step pre/post hooks, and patches of ``torch.autograd.backward``,
``GradScaler.scale``/``step`` and ``clip_grad_norm_`` (undone on exit). This base installs them and turns
them into the events below; each subclass says what an event means to it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.amp.grad_scaler import OptState


class Patch:
    """Set ``obj.name`` for the duration of a context; put the original back on exit."""

    __slots__ = ("obj", "name", "original")

    def __init__(self, obj: Any, name: str, value: Any):
        self.obj, self.name = obj, name
        self.original = getattr(obj, name)
        setattr(obj, name, value)

    @classmethod
    def around(cls, obj: Any, name: str, method: Any) -> Patch:
        """``obj.name`` replaced by a function (a method, on a class) that calls ``method(original, *args)``."""
        original = getattr(obj, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            return method(original, *args, **kwargs)
        return cls(obj, name, wrapper)

    def undo(self) -> None:
        setattr(self.obj, self.name, self.original)


def unscale_ready(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """What ``GradScaler.step`` does first, done before it: the check sees unscaled gradients."""
    if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


class ScriptHooks:
    """A script's steps, seen through hooks. ``optimizers=None``: the global optimizer hooks, and the
    guarded optimizer is the first that steps (watch); else hooks on each of ``optimizers``, all guarded
    (replay of a ``step_fn``)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer] | None = None) -> None:
        self.optimizer: torch.optim.Optimizer | None = None   # the guarded one: the first that steps
        self._only = optimizers
        self._scaled = False                 # GradScaler.scale ran since the last backward: it backpropagates that
        self.scaler: torch.amp.GradScaler | None = None   # the GradScaler whose step (of the guarded one) runs now
        self.scaler_seen: torch.amp.GradScaler | None = None   # the GradScaler the script scales its loss with
        self.clip: tuple[torch.Tensor, Any] | None = None   # the script's last clip_grad_norm_: (norm before, max_norm)
        # optimizer id -> its step() calls in progress: a subclass whose step() calls super().step() runs torch's
        # step hooks at both levels once the base class has an instance too; that is one step, seen at the outer
        self._stepping: dict[int, int] = {}
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

    def on_clip(self, norm: torch.Tensor, max_norm: Any) -> None:
        """The script clipped its gradients: their norm before clipping (``max_norm`` as the script passed it)."""
        self.clip = (norm, max_norm)

    def step_norm(self, opt: torch.optim.Optimizer) -> tuple[torch.Tensor | None, Any]:
        """The step's gradient norm as watch checks it, and the max_norm it was clipped to: the norm the script's
        clip_grad_norm_ returned (it costs nothing; taken once), else the global norm of ``opt``'s gradients."""
        clip, self.clip = self.clip, None
        if clip is not None:
            return clip
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        return (torch.nn.utils.get_total_norm(grads) if grads else None), None

    def before_scaler_step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """GradScaler.step of the guarded optimizer is about to run (``self.scaler`` is set until it returns)."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step() of the guarded optimizer is about to run (not inside GradScaler.step)."""

    def update_begins(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step inside GradScaler.step begins."""

    def wants_closure(self) -> bool:
        """A closure optimizer's closure is wrapped (its first evaluation calls :meth:`closure_evaluated`)."""
        return True

    def closure_evaluated(self, optimizer: torch.optim.Optimizer) -> None:
        """A closure optimizer evaluated the step's closure for the first time (its loss and gradients)."""

    def step_done(self, optimizer: torch.optim.Optimizer) -> None:
        """The guarded optimizer's step (or GradScaler.step) returned: the script's step is over."""

    def extra_patches(self) -> list[Patch]:
        """More patches a subclass installs with the others (it may add hook handles to ``_hooks``)."""
        return []

    def guards(self, optimizer: torch.optim.Optimizer, adopt: bool = True) -> bool:
        """``optimizer``'s step is one of the script's steps (``adopt``: the first optimizer that steps is)."""
        if self._only is not None:
            return any(optimizer is o for o in self._only)
        if self.optimizer is None and adopt:
            self.optimizer = optimizer
        return optimizer is self.optimizer

    # -- install / remove -------------------------------------------------------------------------------

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        try:
            registers = [(register_optimizer_step_pre_hook, register_optimizer_step_post_hook)] if self._only is None \
                else [(opt.register_step_pre_hook, opt.register_step_post_hook) for opt in self._only]
            for pre, post in registers:
                self._hooks += [pre(self._opt_pre), post(self._opt_post)]
            for obj, name, method in ((torch.autograd, "backward", self._backward),
                                      (torch.amp.GradScaler, "scale", self._scale),
                                      (torch.amp.GradScaler, "step", self._scaler_step),
                                      (torch.nn.utils, "clip_grad_norm_", self._clip_grad_norm),
                                      (torch.nn.utils.clip_grad, "clip_grad_norm_", self._clip_grad_norm)):
                self._patches.append(Patch.around(obj, name, method))
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

    def __enter__(self) -> ScriptHooks:
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    # -- the script's calls -----------------------------------------------------------------------------

    def _backward(self, original, tensors, *args, **kwargs):
        self._stepping.clear()   # no step is in progress (one that raised never ran its post hooks)
        if self.listening():
            # after GradScaler.scale, what is backpropagated is the scaled loss (maybe divided further, as in
            # (scaler.scale(loss) / k).backward()): the loss was taken at scale
            for t in () if self._scaled else (tensors if isinstance(tensors, (tuple, list)) else (tensors,)):
                if isinstance(t, torch.Tensor) and t.numel() == 1:
                    self.on_loss(t)
            self._scaled = False
            self.on_backward()
        out = original(tensors, *args, **kwargs)
        if self.active():
            self.after_backward()
        return out

    def _scale(self, original, scaler, outputs):
        out = original(scaler, outputs)
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 and self.listening():
            self.scaler_seen = scaler
            self._scaled = True
            self.on_loss(outputs)
        return out

    def _clip_grad_norm(self, original, parameters, max_norm, *args, **kwargs):
        norm = original(parameters, max_norm, *args, **kwargs)
        if self.listening() and isinstance(norm, torch.Tensor):
            self.on_clip(norm.detach(), max_norm)
        return norm

    def _scaler_step(self, original, scaler, optimizer, *args, **kwargs):
        if not (self.active() and scaler.is_enabled() and "closure" not in kwargs and self.guards(optimizer)):
            return original(scaler, optimizer, *args, **kwargs)
        self.scaler = scaler
        try:
            self.before_scaler_step(scaler, optimizer)
            out = original(scaler, optimizer, *args, **kwargs)
        finally:
            self.scaler = None
        self.step_done(optimizer)   # also when the scaler skipped optimizer.step(): the script's step is over
        return out

    def _opt_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        depth = self._stepping[id(opt)] = self._stepping.get(id(opt), 0) + 1
        if depth > 1 or not self.active() or not self.guards(opt):   # depth > 1: super().step() of a subclass
            return None
        if self.scaler is not None:   # seen in GradScaler.step already
            self.update_begins(opt)
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)   # args: (optimizer, closure)
        if callable(closure) and self.wants_closure():   # LBFGS & co: forward and backward run inside step()
            return self._wrap_closure(opt, closure, args, kwargs)
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
        depth = self._stepping.pop(id(opt), 1) - 1
        if depth > 0:   # the inner super().step() returned: the outer step goes on
            self._stepping[id(opt)] = depth
        elif self.active() and self.scaler is None and self.guards(opt, adopt=False):
            self.step_done(opt)


__all__ = ["ScriptHooks", "Patch", "unscale_ready"]
