"""`NanprobeCallback` for ``transformers.Trainer``: the one line to add.

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NanprobeCallback()])

While ``train()`` runs, the trainer's ``training_step`` is wrapped on the instance: each micro-batch
(its inputs and ``num_items_in_batch``, the label-token count the loss is normalised by over the whole
accumulation window) is noted with the RNG state and its loss; the global gradient norm is the one the
Trainer's ``_clip_grad_norm`` / ``_get_grad_norm`` return (before clipping, unscaled), else computed.
``on_pre_optimizer_step`` checks the step (one device sync); a bad step's update is skipped, the capsule
written, and in ``on_step_end`` the step is diagnosed in-process with the Trainer's own step as the
``step_fn`` (:class:`TrainerStep`). Steps are ``state.global_step`` values; the scheduler and
``global_step`` advance on a skipped step.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from typing import Any

import torch

from ..reach.feed import MicroBatches
from ..live import total_norm, unscaled
from ..base.errors import UsageError
from ..base.precision import Precision
from ..reach.target import validate
from . import require
from ._callback import GuardedCallback, enabled, set_for

try:
    from transformers import Trainer as _Trainer
    from transformers import TrainerCallback as _Base
except ImportError:
    _Base = object
    _Trainer = None


def _find_trainer() -> Any:
    """The ``transformers.Trainer`` whose callback handler is calling us (callbacks get no reference)."""
    frame, depth = sys._getframe(1), 0
    while frame is not None and depth < 12:
        if _Trainer is not None and isinstance(frame.f_locals.get("self"), _Trainer):
            return frame.f_locals["self"]
        frame, depth = frame.f_back, depth + 1
    return None


def _log_curves(trainer: Any, step: int, values: dict[str, float]) -> None:
    """The precursor series through ``Trainer.log``, to the loggers of ``report_to`` (none: nothing)."""
    if trainer.args.report_to in (None, "none", [], ["none"]):
        return
    trainer.log(dict(values))


def _unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """accelerate's AcceleratedOptimizer -> the torch optimizer it drives (hooks live there)."""
    seen = 0
    while not type(opt).__module__.startswith("torch.") and hasattr(opt, "optimizer") and seen < 4:
        opt = opt.optimizer
        seen += 1
    return opt


class TrainerStep:
    """The Trainer's own optimizer step, as a nanprobe ``step_fn`` (``_inner_training_loop``'s body).

    Gradients start empty; for each micro-batch of the step, the trainer's ``training_step`` (the
    original, not nanprobe's wrapper) on ``trainer.model`` with the recorded ``num_items_in_batch``:
    ``compute_loss`` under accelerate's autocast, the division by the accumulation count where the loss
    is not normalised by label tokens, accelerate's ``backward`` (GradScaler scaling). Then clipping
    and the gradient norm as the trainer computes them, ``optimizer.step()`` (accelerate's: unscale, skip
    on inf), the LR scheduler unless the step was skipped, ``model.zero_grad()``. The model is called
    without its DDP wrapper: a rerun on one rank runs no collective.
    """

    def __init__(self, trainer: Any, training_step: Any):
        self.trainer = trainer
        self.training_step = training_step

    def __call__(self, model: torch.nn.Module, batch: Any, step: int) -> torch.Tensor | None:
        t = self.trainer
        micro = batch if isinstance(batch, MicroBatches) else [batch]
        n = len(micro)
        model = t.model
        model.zero_grad(set_to_none=True)
        state = t.accelerator.gradient_state
        saved_sync = state.sync_gradients
        saved_ga = getattr(t, "current_gradient_accumulation_steps", None)
        t.current_gradient_accumulation_steps = n
        total = None
        try:
            for j, item in enumerate(micro):
                state._set_sync_gradients(j == n - 1)
                loss = self.training_step(model, item["inputs"], item.get("num_items_in_batch"))
                loss = loss.detach()
                total = loss if total is None else total + loss
            grad_norm = None
            if t.args.max_grad_norm is not None and t.args.max_grad_norm > 0:
                grad_norm = t._clip_grad_norm(model)
            if hasattr(t, "_get_grad_norm"):
                t._get_grad_norm(model, grad_norm=grad_norm)
            t.optimizer.step()
            sched = t.lr_scheduler
            if sched is not None and not t.accelerator.optimizer_step_was_skipped and \
                    not isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step()
            model.zero_grad()
        finally:
            state._set_sync_gradients(saved_sync)
            if saved_ga is not None:
                t.current_gradient_accumulation_steps = saved_ga
        return total


class NanprobeCallback(GuardedCallback, _Base):
    """Guard every optimizer step of a ``transformers.Trainer`` run; diagnose the first bad one in-process.

    ``dirpath``: where the capsule and the JSON report go. ``policy``: ``skip`` (default), ``stop``
    (``control.should_training_stop``), ``raise`` (:class:`nanprobe.live.Stopped` out of ``train()``),
    ``record`` (the update is applied). ``entry`` makes the logged replay command complete. ``config``:
    a nanprobe Config, a YAML path or a dict of sections; ``check_every`` overrides
    ``guard.check_every``. ``max_reports``: bad steps diagnosed in-process (later ones get their capsule and
    a line). ``events`` lists what happened.
    """

    command, who, frameworks = "transformers", "nanprobe (transformers)", ("transformers",)
    missing = None if _Trainer else ("transformers", "transformers",
                                     "nanprobe.integrations.transformers.NanprobeCallback")
    _trainer: Any = None
    _original: Any = None               # the Trainer's own training_step
    _norm: torch.Tensor | None = None
    _params: tuple[torch.nn.Parameter, ...] = ()
    _epoch = 0
    _steps_in_epoch = 0       # optimizer steps done in the current epoch
    _items_in_epoch = 0       # micro-batches seen in the current epoch

    # -- setup ------------------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer = _find_trainer()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _find_trainer() or self._trainer
        if trainer is None:
            raise UsageError("NanprobeCallback found no transformers.Trainer calling it", "on_train_begin",
                             "Pass it to Trainer(callbacks=[NanprobeCallback()]) or trainer.add_callback()")
        self._trainer = trainer
        self._uninstall()
        self._original = trainer.training_step
        self._install()
        self._step = TrainerStep(trainer, self._original)
        self._params = tuple(trainer.model.parameters())   # walked once: a module walk per step costs ~0.1 ms
        self._new_guard(trainer.model, lambda: validate(_target_dict(trainer, self._step), "NanprobeCallback"),
                        partial(_log_curves, trainer))
        self._epoch = int(math.floor(state.epoch or 0)) - 1   # on_epoch_begin counts it up
        self._steps_in_epoch = self._items_in_epoch = 0

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._uninstall()

    def _install(self) -> None:
        """Wrap the Trainer's training_step and keep the norm it computes each step anyway (on the
        instance, for this train() call)."""
        t = self._trainer
        t.training_step = self._training_step
        for name in ("_clip_grad_norm", "_get_grad_norm"):
            if callable(getattr(t, name, None)):
                setattr(t, name, self._keep_norm(getattr(t, name)))

    def _uninstall(self) -> None:
        t = self._trainer
        if t is None:
            return
        if vars(t).get("training_step") == self._training_step:
            del t.training_step
        for name in ("_clip_grad_norm", "_get_grad_norm"):
            if getattr(vars(t).get(name), "_nanprobe", False):
                delattr(t, name)

    def _keep_norm(self, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            norm = original(*args, **kwargs)
            if isinstance(norm, torch.Tensor) and self._guard is not None and not self._guard.busy:
                self._norm = norm.detach()   # before clipping, unscaled (accelerate unscales first)
            return norm
        wrapper._nanprobe = True
        return wrapper

    def _scaler(self) -> torch.amp.GradScaler | None:
        return enabled(getattr(self._trainer.accelerator, "scaler", None))

    # -- the wrapped training_step ------------------------------------------------------------------------

    def _training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None, *args: Any,
                       **kwargs: Any) -> torch.Tensor:
        g = self._guard
        live = g is not None and not g.busy
        if live:
            self._micro({"inputs": dict(inputs) if isinstance(inputs, dict) else inputs,
                         "num_items_in_batch": num_items_in_batch}, int(self._trainer.state.global_step),
                        self._epoch, self._items_in_epoch)
            self._items_in_epoch += 1
        loss = self._original(model, inputs, num_items_in_batch, *args, **kwargs)
        if live:
            g.note_loss(loss)
        return loss

    # -- the callback events ----------------------------------------------------------------------------

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._epoch += 1
        self._steps_in_epoch = self._items_in_epoch = 0
        self._reset()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._live() is None:
            return
        opt = _unwrap_optimizer(self._trainer.optimizer)
        scaler = self._scaler()
        norm, self._norm = self._norm, None
        if norm is None:   # the Trainer computed none (older versions without clipping): the gradients are final
            norm = total_norm([p.grad for p in self._params if p.grad is not None])
            if norm is not None and scaler is not None and scaler._scale is not None and not unscaled(scaler, opt):
                norm = norm / scaler._scale
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        self._check(opt, self._steps_in_epoch, norm=norm, scaler=scaler, max_grad_norm=clip)
        self._stepped = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._ended() is None:
            return None
        self._steps_in_epoch += 1
        if self._conclude((int(state.global_step) - 1, self._epoch), partial(set_for, state, "global_step")):
            control.should_training_stop = True
        return control


def _target_dict(trainer: Any, step: TrainerStep) -> dict[str, Any]:
    scaler = getattr(trainer.accelerator, "scaler", None)
    sched = trainer.lr_scheduler
    return {"model": trainer.model, "step_fn": step, "batches": [],
            "optimizer": _unwrap_optimizer(trainer.optimizer),
            "scheduler": sched if callable(getattr(sched, "step", None)) else None,
            "grad_scaler": scaler if isinstance(scaler, torch.amp.GradScaler) else False,
            "precision": Precision.BF16 if getattr(trainer.args, "bf16", False) else
                         Precision.FP16 if getattr(trainer.args, "fp16", False) else Precision.FP32,
            "accumulate": int(trainer.args.gradient_accumulation_steps)}


def replay_target(trainer: Any, num_training_steps: int | None = None) -> dict[str, Any]:
    """What an ENTRY returns to replay a :class:`NanprobeCallback` capsule with ``nanprobe run ENTRY
    --capsule FILE``: ``def target(): return replay_target(build_trainer())``, the ``Trainer`` your
    script builds (model, ``TrainingArguments``, datasets; not trained). Its optimizer and LR scheduler
    are created as ``train()`` creates them (the total steps from ``max_steps``, else the epochs and
    the train dataloader's length; or ``num_training_steps``), the capsule fills their state, and the
    step is the Trainer's own (:class:`TrainerStep`), as the callback ran it."""
    if _Trainer is None:
        require("transformers", "transformers", "nanprobe.integrations.transformers.replay_target")
    if not isinstance(trainer, _Trainer):
        raise UsageError(f"replay_target got a {type(trainer).__name__}, not a transformers.Trainer",
                         "replay_target", "Pass the Trainer your script builds: replay_target(Trainer(model=..., "
                                          "args=..., train_dataset=...))")
    args = trainer.args
    if num_training_steps is None:
        if args.max_steps > 0:
            num_training_steps = int(args.max_steps)
        else:
            n = len(trainer.get_train_dataloader())
            ga = max(int(args.gradient_accumulation_steps), 1)
            num_training_steps = math.ceil(args.num_train_epochs * max(n // ga + int(n % ga > 0), 1))
    if trainer.optimizer is None or trainer.lr_scheduler is None:
        trainer.create_optimizer_and_scheduler(num_training_steps=num_training_steps)
    return _target_dict(trainer, TrainerStep(trainer, trainer.training_step))


__all__ = ["NanprobeCallback", "TrainerStep", "replay_target"]
