"""`NanprobeCallback` for ``lightning.Trainer``: the one line to add.

    trainer = lightning.Trainer(..., callbacks=[NanprobeCallback()])

Every optimizer step is checked in ``on_before_optimizer_step`` (after backward and, with a
GradScaler, after unscaling; before clipping): the loss noted in ``on_before_backward`` and the
global gradient norm, in one device sync. A bad step's update is skipped (gradients set to None), the
capsule written, and in ``on_train_batch_end`` the step is diagnosed in-process with the module's own
automatic optimization as the ``step_fn`` (:class:`LightningStep`). Steps are ``trainer.global_step``
values; the scheduler and ``global_step`` advance on a skipped step, as they do when a GradScaler skips.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from functools import partial
from typing import Any

import torch

from ..reach.feed import MicroBatches
from ..base.precision import Precision
from ..reach.target import Target, validate
from ._callback import GuardedCallback, enabled, set_for

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


def _framework(module: str = "") -> Any:
    """``lightning.pytorch`` (or ``pytorch_lightning``) or one of its modules."""
    return importlib.import_module(_FRAMEWORK + module)


@contextlib.contextmanager
def _quiet(module: torch.nn.Module):
    """``self.log`` / ``self.log_dict`` do nothing while nanprobe reruns a step (no metric counted twice)."""
    saved = {name: vars(module)[name] for name in ("log", "log_dict") if name in vars(module)}
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log, module.log_dict
        vars(module).update(saved)


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
        self.at: dict[int, tuple[int, tuple[int, ...]]] = {}   # step -> its epoch, the batch_idx of its micro-batches

    def __call__(self, model: torch.nn.Module, batch: Any, step: int) -> torch.Tensor | None:
        trainer, module = self.trainer, self.module
        micro = batch if isinstance(batch, MicroBatches) else [batch]
        epoch, idx = self.at.get(step, (trainer.current_epoch, ()))
        raw = trainer.optimizers[0]
        lopt = trainer.strategy._lightning_optimizers[0]
        Closure = _framework(".loops.optimization.automatic").Closure
        total = None
        with _quiet(module):
            for j, mb in enumerate(micro):
                bidx = idx[j] if j < len(idx) else j
                closure = Closure(step_fn=partial(self._training_step, mb, bidx),
                                  backward_fn=partial(trainer.strategy.backward, optimizer=raw),
                                  zero_grad_fn=partial(self._zero_grad, epoch, bidx, raw) if j == 0 else None)
                closure()
                result = closure.consume_result()
                if result.loss is not None:
                    total = result.loss if total is None else total + result.loss
            # the optimizer's closure: the step's forward and backward already ran
            module.optimizer_step(epoch, bidx, lopt, lambda: result.loss)
        return total

    def _training_step(self, batch: Any, batch_idx: int):
        with self.trainer.precision_plugin.train_step_context():
            out = self.module.training_step(batch, batch_idx)
        result = _framework(".loops.optimization.automatic").ClosureResult
        return result.from_training_step_output(out, self.trainer.accumulate_grad_batches)

    def _zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        self.module.on_before_zero_grad(optimizer)
        self.module.optimizer_zero_grad(epoch, batch_idx, optimizer)


class NanprobeCallback(GuardedCallback, _Base):
    """Guard every optimizer step of a ``lightning.Trainer`` run; diagnose the first bad one in-process.

    ``dirpath``: where the capsule and the JSON report go. ``policy``: ``skip`` (default), ``stop``
    (``trainer.should_stop``: the fit ends after the step), ``raise`` (:class:`nanprobe.live.Stopped`),
    ``record`` (the update is applied). ``entry`` (``train.py:target``) makes the logged replay command
    complete. ``config``: a nanprobe Config, a YAML path or a dict of sections (``guard:`` thresholds,
    ``run:`` diagnosis settings); ``check_every`` overrides ``guard.check_every``. ``events`` lists what
    happened. Automatic optimization only (Lightning 2.x: one optimizer).
    """

    command, who, frameworks = "lightning", "nanprobe (Lightning)", ("lightning", "pytorch-lightning")
    missing = None if _FRAMEWORK else ("lightning.pytorch", "lightning",
                                       "nanprobe.integrations.lightning.NanprobeCallback")
    _deferred: torch.optim.Optimizer | None = None   # its check waits for Lightning's clipping
    _clip_plugin: Any = None
    _fit: tuple[Any, torch.amp.GradScaler | None, bool] | None = None   # (trainer, its GradScaler, clips by norm)
    _warned_manual = False

    # -- setup ------------------------------------------------------------------------------------------

    def _attach(self, trainer: Any, module: Any) -> Any:
        self._install_clip(trainer)
        if self._fit is None or self._fit[0] is not trainer:   # once per fit: a property chain per step costs
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self._fit = (trainer, scaler if isinstance(scaler, torch.amp.GradScaler) else None,
                         self._clips_by_norm(trainer, module))
        if self._guard is None or self._guard.model is not module:
            self._step = LightningStep(trainer, module)
            self._new_guard(module, partial(self._target, trainer, module), partial(_log_curves, trainer))
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

    def _scaler(self) -> torch.amp.GradScaler | None:
        """The precision plugin's enabled GradScaler."""
        return enabled(self._fit[1])

    # -- the hooks ------------------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._reset()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not pl_module.automatic_optimization:
            if not self._warned_manual:
                self._warned_manual = True
                logger.warning("nanprobe (Lightning): %s uses manual optimization, which NanprobeCallback does not "
                               "guard: nothing is checked in this fit. Use nanprobe.Guard inside training_step "
                               "instead (guard.step / guard.backward / guard.optimizer_step).",
                               type(pl_module).__name__)
            return
        if not self._attach(trainer, pl_module).busy:
            self._micro(batch, int(trainer.global_step), int(trainer.current_epoch), int(batch_idx))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        g = self._live()
        if g is not None:
            g.note_loss(loss, scale=getattr(self._scaler(), "_scale", None))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        if self._live() is None:
            return
        step, epoch = self._current
        self._step.at[step] = (epoch, tuple(self._items))
        self._stepped = True
        if self._fit[2]:
            self._deferred = optimizer   # checked right after Lightning's clipping, with the norm it computes
            return
        self._check_step(trainer, optimizer, None)

    def _check_step(self, trainer: Any, optimizer: torch.optim.Optimizer, norm: torch.Tensor | None) -> None:
        clip = trainer.gradient_clip_val if norm is not None else None
        self._check(optimizer, self._items[0] // max(int(trainer.accumulate_grad_batches), 1), norm=norm,
                    scaler=self._scaler(), max_grad_norm=float(clip) if clip else None)

    # -- the norm Lightning's clipping computes anyway ------------------------------------------------

    def _clips_by_norm(self, trainer: Any, module: Any) -> bool:
        """Lightning will clip this step's gradients by their global norm, through the precision plugin's
        clip_grad_by_norm (the module keeps Lightning's own clipping hooks)."""
        if self._clip_plugin is None or not trainer.gradient_clip_val or \
                str(trainer.gradient_clip_algorithm or "norm") != "norm":
            return False
        base = _framework().LightningModule
        return type(module).configure_gradient_clipping is base.configure_gradient_clipping and \
            type(module).clip_gradients is base.clip_gradients

    def _install_clip(self, trainer: Any) -> None:
        """Wrap the precision plugin's clip_grad_by_norm (on the instance, during fit) to keep the norm
        torch.nn.utils.clip_grad_norm_ returns and check the step there: gradients final, before the update."""
        plugin = trainer.precision_plugin
        if self._clip_plugin is plugin or not callable(getattr(plugin, "main_params", None)):
            return
        self._uninstall_clip()

        def clip_grad_by_norm(optimizer, clip_val):
            norm = torch.nn.utils.clip_grad_norm_(plugin.main_params(optimizer), clip_val)
            if self._deferred is optimizer:
                self._deferred = None
                self._check_step(trainer, optimizer, norm)
            return norm
        plugin.clip_grad_by_norm = clip_grad_by_norm
        self._clip_plugin = plugin

    def _uninstall_clip(self) -> None:
        plugin, self._clip_plugin = self._clip_plugin, None
        if plugin is not None and "clip_grad_by_norm" in vars(plugin):
            del plugin.clip_grad_by_norm

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        g = self._ended()
        if g is None:
            return
        if self._deferred is not None:   # Lightning did not clip after all: the step went unchecked
            self._deferred = None
            g.core.reset()
        try:
            if self._conclude((int(trainer.global_step) - 1, int(trainer.current_epoch)),
                              partial(_global_step_at, trainer)):
                trainer.should_stop = True
        finally:   # the reruns read the step's batch_idx and epoch there
            self._step.at.clear()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._guard is not None:
            self._guard.core.reset()
        self._uninstall_clip()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._uninstall_clip()


def _log_curves(trainer: Any, step: int, values: dict[str, float]) -> None:
    """The precursor series as scalars in the trainer's loggers, at its global step (no logger: nothing)."""
    for logger_ in trainer.loggers:
        logger_.log_metrics(values, step=trainer.global_step)


def _global_step_at(trainer: Any, step: int) -> Any:
    """``trainer.global_step`` reads ``step`` meanwhile (Lightning counts the step done once it returned)."""
    try:
        tracker = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        return set_for(tracker, "completed", step)
    except AttributeError:  # pragma: no cover - another Lightning layout
        return contextlib.nullcontext()


__all__ = ["NanprobeCallback", "LightningStep"]
