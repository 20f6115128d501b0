"""The hooks of `nanprobe watch --at N`: the guarded optimizer's steps counted as ``watch`` counts them,
nothing checked before step N, step N instrumented from its first root-module forward to the end of its
optimizer update (:class:`nanprobe.locate.instrument.OriginTracker`, the instrumentation ``nanprobe run`` uses),
then the script stopped."""

from __future__ import annotations

import contextlib
import functools
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..capsule import compiled_graphs, unwrap
from ..live.events import current_lr, skip_update
from ..live.core import _f32
from ..locate.instrument import LOSS_FN, OriginTracker, Probe, _anomaly_source, _floats, _tensor_stats
from ..base.report import Phase
from ..base.sharding import weights_finite
from ..reach.step import Loop
from ..reach.hooks import ScriptHooks, unscale_ready
from .watcher import forward_target
from ..reach.forward import autocast_dtype, batch_of, device_of_module, params_module


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
        # the last low-precision outputs of ops whose value can underflow to 0 (softmax, exp, sigmoid, a cast),
        # with their inputs: there is no fp32 reference rerun of the script's own step, so an origin fed an exact
        # 0 from one of them is probed by recomputing that op in float32 (run's underflow check, on one op)
        self._made: OrderedDict[int, tuple[Any, tuple, torch.Size]] = OrderedDict()

    def _check_outputs(self, *args: Any) -> None:
        n = len(self.trace.events)
        had = self.trace.entered
        super()._check_outputs(*args)
        func, fargs, kwargs, outs = args[:4]
        if func in _UNDERFLOWS and self.phase is Phase.FORWARD:
            for o in outs:
                if o.dtype in (torch.float16, torch.bfloat16):
                    self._made[o.untyped_storage().data_ptr()] = (func, fargs, o.shape)
                    while len(self._made) > 16:
                        self._made.popitem(last=False)
        if len(self.trace.events) > n and n == 0 and self.trace.probe is None:
            self._probe_underflow(self.trace.events[0], fargs, kwargs)
        new = self.trace.events[n:] + ([self.trace.entered] if self.trace.entered is not had else [])
        for e in new:
            if e.phase is Phase.BACKWARD and e.source is None:
                node = torch._C._current_autograd_node()
                if node is not None:
                    e.source, e.code = _anomaly_source(node)
            if e.phase is Phase.FORWARD and e.module == LOSS_FN and self.outside:
                e.module = f"{OUTSIDE[:-1]}: {self.outside[0]})"

    def _probe_underflow(self, e: Any, args: tuple, kwargs: dict) -> None:
        """The origin's inputs with those made by an op that can underflow recomputed in float32: the probe
        ``classify`` compares zero counts with (0 in fp16, non-zero in fp32: underflow)."""
        was, self.active = self.active, False
        try:
            stats, probed = [], False
            with torch.no_grad():
                for t in _floats((args, kwargs)):   # the origin's inputs, as its event counted them
                    made = self._made.get(t.untyped_storage().data_ptr())
                    ref = _in_float32(made[0], made[1]) if made is not None and made[2] == t.shape else None
                    probed = probed or ref is not None
                    stats.append(_tensor_stats(ref if ref is not None else t))
            if probed:
                self.trace.probe = Probe(phase=e.phase, module=e.module, op=e.op, occurrence=0, node=e.node,
                                         inputs=stats, found=True)
        finally:
            self.active = was

    def outside_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self.phase is Phase.FORWARD and id(module) not in self.names:
            self.outside.append(type(module).__name__)

    def outside_post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self.phase is Phase.FORWARD and id(module) not in self.names and self.outside:
            self.outside.pop()


_aten = torch.ops.aten
# the ops whose output can underflow to 0, each recomputed from its first input (in float32) and its arguments
_UNDERFLOWS = {_aten._softmax.default: lambda x, args: torch.softmax(x, args[1]),
               _aten.softmax.int: lambda x, args: torch.softmax(x, args[1]),
               _aten.exp.default: lambda x, args: torch.exp(x), _aten.sigmoid.default: lambda x, args: torch.sigmoid(x),
               _aten._to_copy.default: lambda x, args: x}   # a cast: its input


def _in_float32(func: Any, args: tuple) -> torch.Tensor | None:
    """What ``func`` made, recomputed in float32 from its inputs."""
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        return _UNDERFLOWS[func](args[0].float(), args)
    return None


class StepHooks(ScriptHooks):
    """Counts the guarded optimizer's steps as ``watch`` does; instruments step ``at`` only."""

    def __init__(self, at: int, skipped: Sequence[int] = (), functional: bool = False):
        super().__init__()
        self.at = at
        self.skipped = set(skipped)
        # the watched run called no module holding the optimizer's parameters (a functional model): step N is
        # armed when step N-1's update ends, over a module holding those parameters
        self.functional = functional
        self.steps = 0
        self.root: torch.nn.Module | None = None
        self.tracker: _LiveTracker | None = None
        self.loop: Loop | None = None
        self.snapshot: Any = None
        self.items: list[Any] = []
        self.losses: list[torch.Tensor] = []
        self.loss: float | None = None
        self.norm: float | None = None
        self.lr: float | None = None
        self.scaler_skipped = False
        self.weights_finite: bool | None = None
        self.measured = False
        self.done = False
        self._micro = 0
        self._armed = contextlib.ExitStack()   # what arming installs (hooks, anomaly mode, the tracker): undone at once
        self.compiled = False                     # the script ran torch.compile'd code before step N
        self.arm_error: Exception | None = None   # instrumenting step N failed (a bug in nanprobe)

    @property
    def armed(self) -> bool:
        return self.tracker is not None and not self.done

    def active(self) -> bool:
        return not self.done

    def listening(self) -> bool:
        return self.armed

    # -- install / remove --
    def __enter__(self) -> StepHooks:
        super().__enter__()
        if self.at == 0:
            self._wait()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._armed.close()
        super().__exit__()

    # -- arming at step N's first root forward --
    def _wait(self) -> None:
        self._armed.callback(torch.nn.modules.module.register_module_forward_pre_hook(self._module_pre).remove)

    def _module_pre(self, module: torch.nn.Module, args: tuple) -> None:
        if self.done or not torch.is_grad_enabled():
            return
        if self.tracker is None:
            if self._is_root(module):
                self._arm(module, args)
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
        try:
            self._instrument(root, args)
        except Exception as exc:   # nanprobe's own failure: never blamed on the script
            self.arm_error = exc
            self._stop()
            raise Done() from exc

    def _stop(self) -> None:
        self.done = True
        self._armed.close()

    def _instrument(self, root: torch.nn.Module, args: tuple) -> None:
        self.root = root   # the module called (DDP, torch.compile's wrapper); names come from the one inside
        model = unwrap(root)
        autocast = autocast_dtype(root)
        self.items.append(batch_of(args, {}, autocast))
        opt = self.optimizer
        target, precision = forward_target(model, opt, autocast, device_of_module(model), "nanprobe watch --at")
        self.loop = Loop(target, "nanprobe watch --at", precision)
        self.snapshot = self.loop.objects.take()   # the state before step N (the corrupted-state rule reads it)
        low = getattr(torch, autocast) if autocast else next(
            (p.dtype for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)), torch.float16)
        self.tracker = _LiveTracker(model, [opt] if opt is not None else [], low_dtype=low,
                                    batch_size=_batch_size(args))
        self._armed.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))   # each node's forward line
        self.compiled = compiled_graphs() > 0
        if self.compiled:   # torch.compile'd code runs eagerly in step N: its ops are checked one by one
            with contextlib.suppress(Exception):   # e.g. called inside a compiled region: the ops stay unseen
                self._armed.enter_context(torch.compiler.set_stance("force_eager"))
        self._armed.push(self.tracker.__exit__)   # before entering: a failed entry still removes its global hooks
        self.tracker.__enter__()
        self.tracker.set_phase(Phase.FORWARD)
        self.tracker._pre_hook(root, args)   # this call: the tracker's own hook came after it started
        mm = torch.nn.modules.module
        for h in (mm.register_module_forward_pre_hook(self.tracker.outside_pre),
                  mm.register_module_forward_hook(self.tracker.outside_post, always_call=True)):
            self._armed.callback(h.remove)

    # -- the script's calls --
    def on_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())

    def on_backward(self) -> None:
        if self.tracker.phase is Phase.FORWARD:
            self.tracker.set_phase(Phase.BACKWARD)

    def before_scaler_step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        if self.steps == self.at or self.steps in self.skipped:
            unscale_ready(scaler, optimizer)   # as watch does: the check sees unscaled gradients
        self._check(optimizer)

    def update_begins(self, optimizer: torch.optim.Optimizer) -> None:
        if self.armed:
            self._begin_update(optimizer)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.closure_evaluated(optimizer)

    def wants_closure(self) -> bool:
        # step N's forward may run inside the closure (Lightning): wrapped before the tracker is armed
        return self.steps == self.at or self.steps in self.skipped

    def closure_evaluated(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's own evaluation (watch checks it); the line search's come later."""
        self._check(optimizer)
        self.update_begins(optimizer)

    def step_done(self, optimizer: torch.optim.Optimizer) -> None:
        step = self.steps
        self.steps += 1
        if step == self.at:   # (not armed: no module of the optimizer's was called, nothing was instrumented)
            armed = self.armed
            self._stop()
            if armed:
                self.weights_finite = weights_finite(self.root)
            raise Done()
        if self.steps == self.at and self.tracker is None:
            if self.functional and self.optimizer is not None:   # no forward to arm at: arm now
                self._arm(params_module(self.optimizer), ())
            else:
                self._wait()   # step N-1's update is over: arm at step N's first forward

    def after_backward(self) -> None:
        # a functional model's steps have no root forward to mark the next forward: once a backward returns, the
        # ops that follow are forward ops (another loss, another model's) until the guarded update begins
        if self.functional and self.armed and self.tracker.phase is Phase.BACKWARD:
            self.tracker.set_phase(Phase.FORWARD)

    def _check(self, opt: torch.optim.Optimizer) -> None:
        """Where watch checks the step: an update it skipped is skipped again (its gradients dropped: the optimizer
        stops); step N's loss and gradient norm are read as watch's check reads them (float32 sum of the losses
        backpropagated; the script's clip norm, else the global norm), not seen by the tracker."""
        if self.steps in self.skipped:
            skip_update([opt], self.scaler)
        if not self.armed or self.measured:
            return
        self.measured = True
        tr = self.tracker
        was, tr.active = tr.active, False
        try:
            norm = self.step_norm(opt)[0]
            parts = [t.float().reshape(()) for t in self.losses] + ([norm.float().reshape(())] if norm is not None
                                                                     else [])
            values = torch.stack(parts).tolist() if parts else []
            n = len(self.losses)
            self.loss = functools.reduce(lambda a, b: _f32(a + b), values[:n]) if n else None
            self.norm = values[-1] if norm is not None else None
            self.lr = current_lr([opt])
            self.scaler_skipped = self.scaler is not None and self.norm is not None and not math.isfinite(self.norm)
            self.tracker.optimizers = self.tracker.optimizers or [opt]
        finally:
            tr.active = was

    def _begin_update(self, opt: torch.optim.Optimizer) -> None:
        if self.tracker.phase is not Phase.UPDATE:
            self.tracker.optimizers = self.tracker.optimizers or [opt]
            self.tracker.set_phase(Phase.UPDATE)


def _batch_size(args: tuple) -> int | None:
    return next((int(a.shape[0]) for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1), None)


__all__ = ["StepHooks", "Done", "OUTSIDE"]
