"""The hooks of `nanprobe watch --at N`: the guarded optimizer's steps counted as ``watch`` counts them,
nothing checked before step N, step N instrumented from its first root-module forward to the end of its
optimizer update (:class:`nanprobe.locate.instrument.OriginTracker`, the instrumentation ``nanprobe run`` uses),
then the script stopped."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..capsule import compiled_graphs, unwrap
from ..live.events import current_lr, skip_update, total_norm
from ..live.core import _f32
from ..locate.instrument import LOSS_FN, OriginTracker, _anomaly_source
from ..base.precision import Precision
from ..base.report import Phase
from ..base.sharding import weights_finite
from ..reach.step import Loop, Patch
from ..reach.target import validate
from ..reach.forward import ForwardStep, autocast_dtype, batch_of, device_of_module


class Done(BaseException):
    """Step N is over: stop the script (a BaseException: the script's ``except Exception`` lets it pass)."""


OUTSIDE = "(loss outside the model)"


class _LiveTracker(OriginTracker):
    """The tracker over the script's own step: a backward origin gets its forward line from anomaly mode's
    node metadata at once (``run`` finds it in one more rerun; this step cannot be rerun); a forward op in a
    module the loop calls outside the model (a criterion) is named by that module's class."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.outside: list[str] = []   # the modules outside the model being called (outermost first)

    def _check_outputs(self, *args: Any) -> None:
        n = len(self.trace.events)
        had = self.trace.entered
        super()._check_outputs(*args)
        new = self.trace.events[n:] + ([self.trace.entered] if self.trace.entered is not had else [])
        for e in new:
            if e.phase is Phase.BACKWARD and e.source is None:
                node = torch._C._current_autograd_node()
                if node is not None:
                    e.source, e.code = _anomaly_source(node)
            if e.phase is Phase.FORWARD and e.module == LOSS_FN and self.outside:
                e.module = f"{OUTSIDE[:-1]}: {self.outside[0]})"

    def outside_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self.phase is Phase.FORWARD and id(module) not in self.names:
            self.outside.append(type(module).__name__)

    def outside_post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self.phase is Phase.FORWARD and id(module) not in self.names and self.outside:
            self.outside.pop()


class StepHooks:
    """Counts the guarded optimizer's steps as ``watch`` does; instruments step ``at`` only."""

    def __init__(self, at: int, skipped: Sequence[int] = ()):
        self.at = at
        self.skipped = set(skipped)
        self.steps = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.root: torch.nn.Module | None = None
        self.tracker: _LiveTracker | None = None
        self.loop: Loop | None = None
        self.snapshot: Any = None
        self.items: list[Any] = []
        self.autocast: str | None = None
        self.losses: list[torch.Tensor] = []
        self.scaled: set[int] = set()
        self.clip: torch.Tensor | None = None
        self.loss: float | None = None
        self.norm: float | None = None
        self.lr: float | None = None
        self.scaler_skipped = False
        self.weights_finite: bool | None = None
        self.measured = False
        self.done = False
        self._in_scaler_step = False
        self._micro = 0
        self._patches: list[Patch] = []
        self._hooks: list[Any] = []
        self._arm_hook: Any = None
        self._outside_hooks: list[Any] = []
        self._anomaly: Any = None
        self._stance: Any = None
        self.compiled = False                     # the script ran torch.compile'd code before step N
        self.arm_error: Exception | None = None   # instrumenting step N failed (a bug in nanprobe)

    @property
    def armed(self) -> bool:
        return self.tracker is not None and not self.done

    # -- install / remove --
    def __enter__(self) -> StepHooks:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        try:
            self._hooks.append(register_optimizer_step_pre_hook(self._opt_pre))
            self._hooks.append(register_optimizer_step_post_hook(self._opt_post))
            self._patches.append(Patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward)))
            self._patches.append(Patch(torch.amp.GradScaler, "scale", self._wrap_scale(torch.amp.GradScaler.scale)))
            self._patches.append(Patch(torch.amp.GradScaler, "step", self._wrap_scaler_step(torch.amp.GradScaler.step)))
            clip = self._wrap_clip(torch.nn.utils.clip_grad_norm_)
            self._patches.append(Patch(torch.nn.utils, "clip_grad_norm_", clip))
            self._patches.append(Patch(torch.nn.utils.clip_grad, "clip_grad_norm_", clip))
            if self.at == 0:
                self._wait()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._disarm()
        for p in reversed(self._patches):
            p.undo()
        for h in self._hooks:
            h.remove()
        self._patches, self._hooks = [], []

    # -- arming at step N's first root forward --
    def _wait(self) -> None:
        self._arm_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._module_pre)

    def _module_pre(self, module: torch.nn.Module, args: tuple) -> None:
        if self.done or not torch.is_grad_enabled():
            return
        if self.tracker is None:
            if self._is_root(module):
                try:
                    self._arm(module, args)
                except Exception as exc:   # nanprobe's own failure: never blamed on the script
                    self.arm_error = exc
                    self.done = True
                    self._disarm()
                    raise Done() from exc
        elif module is self.root and self.tracker.phase is Phase.BACKWARD:   # the next micro-batch
            self._micro += 1
            self.tracker.set_phase(Phase.FORWARD)
            self.tracker.set_micro(self._micro, _batch_size(args), self._micro + 1)
            self.items.append(batch_of(args, {}, autocast_dtype(module)))

    def _is_root(self, module: torch.nn.Module) -> bool:
        """The first module called with gradients enabled that holds the guarded optimizer's parameters (before
        step 0's update the optimizer is not known yet: one with trainable parameters)."""
        opt = self.optimizer
        if opt is None:
            return any(p.requires_grad for p in module.parameters())
        wanted = {id(p) for g in opt.param_groups for p in g["params"]}
        return any(id(p) in wanted for p in module.parameters())

    def _arm(self, root: torch.nn.Module, args: tuple) -> None:
        self.root = root   # the module called (DDP, torch.compile's wrapper); names come from the one inside
        model = unwrap(root)
        self.autocast = autocast_dtype(root)
        self.items.append(batch_of(args, {}, self.autocast))
        opt = self.optimizer
        own = {id(q) for q in model.parameters()}
        use_opt = opt is not None and all(id(q) in own for g in opt.param_groups for q in g["params"])
        precision = {"bfloat16": Precision.BF16, "float16": Precision.FP16}.get(self.autocast, Precision.FP32)
        target = validate({"model": model, "step_fn": ForwardStep(device_of_module(model)), "batches": [],
                           "optimizer": opt if use_opt else None, "precision": precision}, "nanprobe watch --at")
        self.loop = Loop(target, "nanprobe watch --at", precision)
        self.snapshot = self.loop.objects.take()   # the state before step N (the corrupted-state rule reads it)
        low = getattr(torch, self.autocast) if self.autocast else next(
            (p.dtype for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)), torch.float16)
        self.tracker = _LiveTracker(model, [opt] if opt is not None else [], low_dtype=low,
                                    batch_size=_batch_size(args))
        self._anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False)   # each node's forward line
        self.compiled = compiled_graphs() > 0
        if self.compiled:   # torch.compile'd code runs eagerly in step N: its ops are checked one by one
            try:
                self._stance = torch.compiler.set_stance("force_eager")
            except Exception:  # noqa: BLE001 - e.g. called inside a compiled region: the ops stay unseen
                self._stance = None
        self.tracker.__enter__()
        self.tracker.set_phase(Phase.FORWARD)
        self.tracker._pre_hook(root, args)   # this call: the tracker's own hook came after it started
        mm = torch.nn.modules.module
        self._outside_hooks = [mm.register_module_forward_pre_hook(self.tracker.outside_pre),
                               mm.register_module_forward_hook(self.tracker.outside_post, always_call=True)]

    def _disarm(self) -> None:
        if self._arm_hook is not None:
            self._arm_hook.remove()
            self._arm_hook = None
        for h in self._outside_hooks:
            h.remove()
        self._outside_hooks = []
        if self.tracker is not None and self.tracker._modes:
            self.tracker.__exit__(None, None, None)
        if self._anomaly is not None:
            self._anomaly.__exit__(None, None, None)
            self._anomaly = None
        if self._stance is not None:
            self._stance.__exit__(None, None, None)
            self._stance = None

    # -- the script's calls --
    def _wrap_backward(self, original):
        hooks = self

        def backward(tensors, *args, **kwargs):
            if hooks.armed:
                for t in (tensors if isinstance(tensors, (tuple, list)) else (tensors,)):
                    if isinstance(t, torch.Tensor) and t.numel() == 1 and id(t) not in hooks.scaled:
                        hooks.losses.append(t.detach())
                if hooks.tracker.phase is Phase.FORWARD:
                    hooks.tracker.set_phase(Phase.BACKWARD)
            return original(tensors, *args, **kwargs)
        return backward

    def _wrap_scale(self, original):
        hooks = self

        def scale(scaler, outputs):
            out = original(scaler, outputs)
            if hooks.armed and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
                hooks.scaled.add(id(out))
                hooks.losses.append(outputs.detach())
            return out
        return scale

    def _wrap_clip(self, original):
        hooks = self

        def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
            norm = original(parameters, max_norm, *args, **kwargs)
            if hooks.armed and isinstance(norm, torch.Tensor):
                hooks.clip = norm.detach()
            return norm
        return clip_grad_norm_

    def _wrap_scaler_step(self, original):
        from torch.amp.grad_scaler import OptState
        hooks = self

        def step(scaler, optimizer, *args, **kwargs):
            guarded = not hooks.done and scaler.is_enabled() and \
                (hooks.optimizer is None or optimizer is hooks.optimizer) and "closure" not in kwargs
            if not guarded:
                return original(scaler, optimizer, *args, **kwargs)
            hooks.optimizer = optimizer
            if hooks.steps == hooks.at or hooks.steps in hooks.skipped:
                if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
                    scaler.unscale_(optimizer)   # as watch does: the check sees unscaled gradients
            if hooks.steps in hooks.skipped:
                skip_update([optimizer], scaler)
            if hooks.armed:
                hooks._measure(optimizer, scaler)
            hooks._in_scaler_step = True
            try:
                out = original(scaler, optimizer, *args, **kwargs)
            finally:
                hooks._in_scaler_step = False
            hooks._step_done()
            return out
        return step

    def _opt_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.done:
            return None
        if self.optimizer is None:
            self.optimizer = opt
        if opt is not self.optimizer:
            return None
        if self._in_scaler_step:   # counted (and measured) in GradScaler.step
            if self.armed:
                self._begin_update(opt)
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure):
            # step N's forward may run inside the closure (Lightning): wrapped before the tracker is armed
            return self._wrap_closure(opt, closure, args, kwargs) if self.steps == self.at \
                or self.steps in self.skipped else None
        if self.steps in self.skipped:
            skip_update([opt])
        if self.armed:
            self._measure(opt, None)
            self._begin_update(opt)
        return None

    def _wrap_closure(self, opt, closure, args, kwargs):
        hooks = self

        step, first = self.steps, [True]

        def guarded():
            loss = closure()
            if first[0]:   # the step's own evaluation (watch checks it); the line search's come later
                first[0] = False
                if step in hooks.skipped:
                    skip_update([opt])   # watch dropped this step's gradients here: the optimizer stops
                if hooks.armed:
                    hooks._measure(opt, None)
                    hooks._begin_update(opt)
            return loss

        if "closure" in kwargs:
            return args, dict(kwargs, closure=guarded)
        return (args[0], guarded, *args[2:]), kwargs

    def _opt_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.done or opt is not self.optimizer or self._in_scaler_step:
            return
        self._step_done()

    def _step_done(self) -> None:
        step = self.steps
        self.steps += 1
        if self.armed and step == self.at:
            self.done = True
            self._disarm()
            self.weights_finite = weights_finite(self.root)
            raise Done()
        if step == self.at:   # step N ended with no module of the optimizer's called: nothing to instrument
            self.done = True
            self._disarm()
            raise Done()
        if self.steps == self.at and self.tracker is None:
            self._wait()   # step N-1's update is over: arm at step N's first forward

    def _measure(self, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        """The step's loss and gradient norm as watch's check reads them (float32 sum of the losses
        backpropagated; the script's clip norm, else the global norm), not seen by the tracker."""
        if self.measured:
            return
        self.measured = True
        tr = self.tracker
        was, tr.active = tr.active, False
        try:
            norm = self.clip if self.clip is not None else total_norm(
                [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None])
            parts = [t.float().reshape(()) for t in self.losses] + ([norm.float().reshape(())] if norm is not None
                                                                     else [])
            values = torch.stack(parts).tolist() if parts else []
            loss = None
            for v in values[:len(self.losses)]:
                loss = v if loss is None else _f32(loss + v)
            self.loss = loss
            self.norm = values[-1] if norm is not None else None
            self.lr = current_lr([opt])
            self.scaler_skipped = scaler is not None and self.norm is not None and not math.isfinite(self.norm)
            if self.tracker.optimizers == [] and opt is not None:
                self.tracker.optimizers = [opt]
        finally:
            tr.active = was

    def _begin_update(self, opt: torch.optim.Optimizer) -> None:
        if self.tracker.phase is Phase.UPDATE:
            return
        if not self.tracker.optimizers:
            self.tracker.optimizers = [opt]
        self.tracker.set_phase(Phase.UPDATE)


def _batch_size(args: tuple) -> int | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return int(a.shape[0])
    return None


__all__ = ["StepHooks", "Done", "OUTSIDE"]
