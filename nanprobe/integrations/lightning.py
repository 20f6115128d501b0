"""`NanprobeCallback` for ``lightning.Trainer``: the one line to add.

    trainer = lightning.Trainer(..., callbacks=[NanprobeCallback()])

Every optimizer step is checked in ``on_before_optimizer_step`` (after backward and, with a
GradScaler, after unscaling; before clipping): the loss noted in ``on_before_backward`` and the
global gradient norm, in one device sync. On the first bad step the update is skipped (gradients set
to None: ``optimizer.step()`` changes nothing), the capsule is written, and in ``on_train_batch_end``
the step is diagnosed in the training process with the module's own automatic optimization as the
``step_fn`` (:class:`LightningStep`), the JSON report goes into ``dirpath`` and one line is logged.
Then ``policy``: ``skip`` (go on), ``stop`` (``trainer.should_stop``), ``raise``, ``record`` (apply
the update anyway). Steps are ``trainer.global_step`` values (the number of optimizer steps done
before the step). The scheduler and ``global_step`` advance on a skipped step, as they do when a
GradScaler skips.
"""

from __future__ import annotations

import contextlib
import logging
import os
from functools import partial
from typing import Any

import torch

from ..reach.feed import MicroBatches, Position
from ..live import POLICIES, HookedGuard, HookEvent, check_policy, resolve_config, skip_update
from ..base.precision import Precision
from ..reach.target import Target, validate
from . import require

try:
    from lightning.pytorch import Callback as _Base
    _FRAMEWORK = "lightning.pytorch"
except ImportError:  # pragma: no cover - the standalone package
    try:
        from pytorch_lightning import Callback as _Base
        _FRAMEWORK = "pytorch_lightning"
    except ImportError:
        _Base = object
        _FRAMEWORK = None

logger = logging.getLogger("nanprobe.lightning")

_PRECISIONS = {"16-mixed": Precision.FP16, "bf16-mixed": Precision.BF16}


def _closure_result():
    if _FRAMEWORK == "pytorch_lightning":  # pragma: no cover
        from pytorch_lightning.loops.optimization.automatic import Closure, ClosureResult
    else:
        from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
    return Closure, ClosureResult


def _lightning_module_class() -> type:
    if _FRAMEWORK == "pytorch_lightning":  # pragma: no cover
        from pytorch_lightning import LightningModule
    else:
        from lightning.pytorch import LightningModule
    return LightningModule


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _quiet(module: torch.nn.Module):
    """``self.log`` / ``self.log_dict`` do nothing while nanprobe reruns a step (no metric counted twice)."""
    had = {name: name in vars(module) for name in ("log", "log_dict")}
    saved = {name: vars(module)[name] for name, present in had.items() if present}
    module.log = _noop
    module.log_dict = _noop
    try:
        yield
    finally:
        for name, present in had.items():
            if present:
                setattr(module, name, saved[name])
            else:
                delattr(module, name)


class LightningStep:
    """Lightning's automatic optimization of one optimizer step, as a nanprobe ``step_fn``.

    For each micro-batch (``accumulate_grad_batches``): ``training_step`` under the precision plugin's
    autocast, its loss divided by the accumulation count; on the first one the module's
    ``on_before_zero_grad`` and ``optimizer_zero_grad``; the strategy's ``backward`` (GradScaler
    scaling, ``on_before_backward`` / ``backward`` / ``on_after_backward``). On the last one the
    module's ``optimizer_step`` with the Lightning optimizer: the precision plugin unscales, calls
    ``on_before_optimizer_step``, clips (``configure_gradient_clipping``) and steps. The step's
    forward and backward run before ``optimizer.step()`` is called (Lightning runs them inside it, as
    the optimizer's closure; the numbers are the same), so nanprobe sees the finished gradients.
    The module is called directly (not through a DDP wrapper): a rerun on one rank runs no collective.
    ``self.log`` does nothing during a rerun. LR schedulers step outside the step, as in Lightning.
    """

    def __init__(self, trainer: Any, module: Any):
        self.trainer = trainer
        self.module = module
        self.batch_idx: dict[int, tuple[int, ...]] = {}   # step -> Lightning's batch_idx of its micro-batches
        self.epoch: dict[int, int] = {}

    def __call__(self, model: torch.nn.Module, batch: Any, step: int) -> torch.Tensor | None:
        trainer, module = self.trainer, self.module
        micro = batch if isinstance(batch, MicroBatches) else [batch]
        n = len(micro)
        epoch = self.epoch.get(step, trainer.current_epoch)
        idx = self.batch_idx.get(step, ())
        raw = trainer.optimizers[0]
        lopt = trainer.strategy._lightning_optimizers[0]
        Closure, _ = _closure_result()
        total = None
        with _quiet(module):
            for j, mb in enumerate(micro):
                bidx = idx[j] if j < len(idx) else j
                closure = Closure(step_fn=partial(self._training_step, mb, bidx),
                                  backward_fn=partial(self._backward, raw),
                                  zero_grad_fn=partial(self._zero_grad, epoch, bidx, raw) if j == 0 else None)
                closure()
                result = closure.consume_result()
                if result.loss is not None:
                    total = result.loss if total is None else total + result.loss
                if j == n - 1:
                    module.optimizer_step(epoch, bidx, lopt, partial(_done, result.loss))
        return total

    def _training_step(self, batch: Any, batch_idx: int):
        _, ClosureResult = _closure_result()
        with self.trainer.precision_plugin.train_step_context():
            out = self.module.training_step(batch, batch_idx)
        return ClosureResult.from_training_step_output(out, self.trainer.accumulate_grad_batches)

    def _backward(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        self.trainer.strategy.backward(loss, optimizer)

    def _zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        self.module.on_before_zero_grad(optimizer)
        self.module.optimizer_zero_grad(epoch, batch_idx, optimizer)


def _done(loss: torch.Tensor | None) -> torch.Tensor | None:
    """The optimizer's closure: the step's forward and backward already ran."""
    return loss


class NanprobeCallback(_Base):
    """Guard every optimizer step of a ``lightning.Trainer`` run; diagnose the first bad one in-process.

    ``dirpath``: where the capsule and the JSON report go. ``policy``: ``skip`` (default), ``stop``
    (``trainer.should_stop``: the fit ends after the step), ``raise`` (:class:`nanprobe.live.Stopped`),
    ``record`` (the update is applied). ``entry`` (``train.py:target``) makes the logged replay command
    complete. ``config``: a nanprobe Config, a YAML path or a dict of sections (``guard:`` thresholds,
    ``run:`` diagnosis settings); ``check_every`` overrides ``guard.check_every``. ``events`` lists what
    happened. Automatic optimization only (Lightning 2.x: one optimizer).
    """

    def __init__(self, dirpath: str | os.PathLike = "nanprobe-reports", policy: str = "skip", *,
                 entry: str | None = None, config: Any = None, check_every: int | None = None,
                 max_reports: int = 1):
        if _FRAMEWORK is None:
            require("lightning.pytorch", "lightning", "nanprobe.integrations.lightning.NanprobeCallback")
        self.dirpath = dirpath
        self.policy = policy
        self.entry = entry
        self.max_reports = max_reports
        self.config = resolve_config(config, "NanprobeCallback(config=...)", check_every=check_every)
        check_policy(policy, POLICIES, "NanprobeCallback(policy=...)")
        self.events: list[HookEvent] = []
        self._guard: HookedGuard | None = None
        self._step: LightningStep | None = None
        self._stepped = False
        self._deferred: torch.optim.Optimizer | None = None   # its check waits for Lightning's clipping
        self._clip_plugin: Any = None
        self._scaler_of: tuple[Any, torch.amp.GradScaler | None] | None = None
        self._clip_check: tuple[Any, bool] | None = None   # (trainer, checked in clipping) for this fit
        self._current: tuple[int, int] | None = None   # (global_step, epoch) of the step in progress
        self._batch_idx: list[int] = []
        self._warned_manual = False

    # -- setup ------------------------------------------------------------------------------------------

    def _attach(self, trainer: Any, module: Any) -> HookedGuard:
        self._install_clip(trainer)
        if self._guard is None or self._guard.model is not module:
            self._step = LightningStep(trainer, module)
            self._guard = HookedGuard(command="lightning", who="nanprobe (Lightning)", model=module,
                                      build_target=partial(self._target, trainer, module), config=self.config,
                                      policy=self.policy, dirpath=self.dirpath, entry=self.entry, allowed=POLICIES,
                                      max_reports=self.max_reports, events=self.events)
            self._guard.core.curves = partial(_log_curves, trainer)
        return self._guard

    def _target(self, trainer: Any, module: Any) -> Target:
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        scheds = [c.scheduler for c in trainer.lr_scheduler_configs]
        return validate({"model": module, "step_fn": self._step, "batches": [],
                         "optimizer": list(trainer.optimizers), "scheduler": scheds or None,
                         "grad_scaler": scaler if isinstance(scaler, torch.amp.GradScaler) else False,
                         "precision": _PRECISIONS.get(str(getattr(plugin, "precision", "32-true")), Precision.FP32),
                         "accumulate": int(trainer.accumulate_grad_batches)}, "NanprobeCallback")

    def _scaler(self, trainer: Any) -> torch.amp.GradScaler | None:
        """The precision plugin's enabled GradScaler (looked up once per fit: a property chain per step costs)."""
        if self._scaler_of is None or self._scaler_of[0] is not trainer:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self._scaler_of = (trainer, scaler if isinstance(scaler, torch.amp.GradScaler) else None)
        scaler = self._scaler_of[1]
        return scaler if scaler is not None and scaler.is_enabled() else None

    # -- the hooks ------------------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self._guard is not None and not self._guard.busy:
            self._guard.reset()
            self._batch_idx, self._stepped = [], False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not pl_module.automatic_optimization:
            if not self._warned_manual:
                self._warned_manual = True
                logger.warning("nanprobe (Lightning): %s uses manual optimization, which NanprobeCallback does not "
                               "guard: nothing is checked in this fit. Use nanprobe.Guard inside training_step "
                               "instead (guard.step / guard.backward / guard.optimizer_step).",
                               type(pl_module).__name__)
            return
        g = self._attach(trainer, pl_module)
        if g.busy:
            return
        if not g.in_step:
            self._current = (int(trainer.global_step), int(trainer.current_epoch))
            self._batch_idx = []
        self._batch_idx.append(int(batch_idx))
        g.micro(batch, self._current[0])

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        g = self._guard
        if g is None or g.busy or not g.in_step:
            return
        scaler = self._scaler(trainer)
        g.note_loss(loss, scale=scaler._scale if scaler is not None and scaler._scale is not None else None)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        g = self._guard
        if g is None or g.busy or not g.in_step or self._current is None:
            return
        step, epoch = self._current
        self._step.batch_idx[step] = tuple(self._batch_idx)
        self._step.epoch[step] = epoch
        self._stepped = True
        if self._clips_by_norm(trainer, pl_module):
            self._deferred = optimizer   # checked right after Lightning's clipping, with the norm it computes
            return
        self._check(trainer, optimizer, None)

    def _check(self, trainer: Any, optimizer: torch.optim.Optimizer, norm: torch.Tensor | None) -> None:
        g = self._guard
        step, epoch = self._current
        accumulate = max(int(trainer.accumulate_grad_batches), 1)
        position = Position(step=step, epoch=epoch, index=self._batch_idx[0] // accumulate,
                            items=tuple(self._batch_idx))
        scaler = self._scaler(trainer)
        clip = trainer.gradient_clip_val if norm is not None else None
        if g.check(step, [optimizer], norm=norm, scaler=scaler, position=position,
                   max_grad_norm=float(clip) if clip else None):
            skip_update([optimizer], scaler)

    # -- the norm Lightning's clipping computes anyway ------------------------------------------------

    def _clips_by_norm(self, trainer: Any, module: Any) -> bool:
        """Lightning will clip this step's gradients by their global norm, through the precision plugin's
        clip_grad_by_norm (the module keeps Lightning's own clipping hooks). Decided once per fit."""
        if self._clip_check is not None and self._clip_check[0] is trainer:
            return self._clip_check[1]
        clips = False
        if self._clip_plugin is not None and trainer.gradient_clip_val and \
                str(trainer.gradient_clip_algorithm or "norm") == "norm":
            base = _lightning_module_class()
            clips = type(module).configure_gradient_clipping is base.configure_gradient_clipping and \
                type(module).clip_gradients is base.clip_gradients
        self._clip_check = (trainer, clips)
        return clips

    def _install_clip(self, trainer: Any) -> None:
        """Wrap the precision plugin's clip_grad_by_norm (on the instance, during fit) to keep the norm
        torch.nn.utils.clip_grad_norm_ returns and check the step there: gradients final, before the update."""
        plugin = trainer.precision_plugin
        if self._clip_plugin is plugin or not callable(getattr(plugin, "main_params", None)):
            return
        self._uninstall_clip()
        callback = self

        def clip_grad_by_norm(optimizer, clip_val):
            norm = torch.nn.utils.clip_grad_norm_(plugin.main_params(optimizer), clip_val)
            if callback._deferred is optimizer:
                callback._deferred = None
                callback._check(trainer, optimizer, norm)
            return norm
        plugin.clip_grad_by_norm = clip_grad_by_norm
        self._clip_plugin = plugin

    def _uninstall_clip(self) -> None:
        plugin, self._clip_plugin = self._clip_plugin, None
        if plugin is not None and "clip_grad_by_norm" in vars(plugin):
            del plugin.clip_grad_by_norm

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        g = self._guard
        if g is None or g.busy or not self._stepped:
            return
        self._stepped = False
        if self._deferred is not None:   # Lightning did not clip after all: the step went unchecked
            self._deferred = None
            g.reset()
        g.after_update()
        step, epoch = self._current or (int(trainer.global_step) - 1, int(trainer.current_epoch))
        self._current = None
        try:
            if g.pending is None:   # a good step
                return
            with _global_step_at(trainer, step):   # the reruns see the trainer as the step did
                event = g.conclude(extra={"global_step": step, "epoch": epoch, "framework": _version()})
        finally:   # the reruns above read the step's batch_idx and epoch from these
            self._step.batch_idx.pop(step, None)
            self._step.epoch.pop(step, None)
        if event is not None and event.action == "stopped":
            trainer.should_stop = True

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._guard is not None:
            self._guard.reset()
        self._uninstall_clip()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._uninstall_clip()


def _log_curves(trainer: Any, step: int, values: dict[str, float]) -> None:
    """The precursor series as scalars in the trainer's loggers, at its global step (no logger: nothing)."""
    for logger_ in trainer.loggers:
        logger_.log_metrics(values, step=trainer.global_step)


@contextlib.contextmanager
def _global_step_at(trainer: Any, step: int):
    """``trainer.global_step`` reads ``step`` meanwhile (Lightning counts the step done once it returned)."""
    try:
        tracker = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        saved = tracker.completed
    except AttributeError:  # pragma: no cover - another Lightning layout
        yield
        return
    tracker.completed = step
    try:
        yield
    finally:
        tracker.completed = saved


def _version() -> str:
    import importlib.metadata as md

    for dist in ("lightning", "pytorch-lightning"):
        try:
            return f"{dist} {md.version(dist)}"
        except md.PackageNotFoundError:
            continue
    return "lightning"


__all__ = ["NanprobeCallback", "LightningStep"]
