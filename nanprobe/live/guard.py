"""`nanprobe.Guard`: a near-zero-overhead sentinel for the user's own training loop.

On a non-finite loss or gradient, or a loss / gradient-norm spike, the guard skips that
optimizer update (weights and optimizer state untouched), writes a capsule of the step, logs
one line with the exact ``nanprobe run ENTRY --capsule PATH`` command, and training goes on.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import shlex
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import capsule as _capsule
from ..base.config import Config, GuardConfig, _build, load_config
from ..judge.divergence import Divergence, Rules
from ..base.errors import EXIT_FOUND, NanprobeError, UsageError
from ..judge.monitor import close_step, live_monitor
from ..base.precision import Precision, device_of, parse_precision, weights_precision
from ..base.sharding import clip_norm, fsdp1_root, full_value, total_norm, weights_finite
from ..judge.updates import UpdateCheck, describe, update_forensics
from ..reach.state import RngTracker, capture_rng, module_tensor_attrs
from ..reach.target import named

logger = logging.getLogger("nanprobe.guard")

POLICIES = ("skip", "raise", "record")
RNG_MODES = ("auto", "all", "torch")


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardEvent:
    """One bad step the guard caught."""

    step: int
    status: str               # "nonfinite" | "spike"
    reason: str               # "loss is nan", "gradient-norm spike: ...", "another rank ..."
    action: str               # "skipped" | "recorded" (update applied) | "raised"
    local: bool               # this rank saw it itself (False: another rank did)
    capsule: str | None       # the capsule written for this step
    command: str | None       # the `nanprobe run ... --capsule ...` line
    rank: int = 0
    loss: float | None = None
    grad_norm: float | None = None


class GuardTripped(NanprobeError):
    """Raised by Guard.optimizer_step under policy 'raise', after too many consecutive skips, or when
    the weights are already non-finite (skipping cannot recover them)."""

    exit_code = EXIT_FOUND

    def __init__(self, event: GuardEvent, why: str):
        self.event = event
        fix = f"Diagnose it: {event.command}" if event.command else "Diagnose it with nanprobe run ENTRY --at " \
            f"{max(event.step - 1, 0)}"
        super().__init__(f"nanprobe.Guard stopped training at step {event.step}: {event.reason}", why, fix)


class _StepContext:
    __slots__ = ("_guard", "_batch", "_step")

    def __init__(self, guard: Guard, batch: Any, step: int | None):
        self._guard, self._batch, self._step = guard, batch, step

    def __enter__(self) -> int:
        return self._guard._begin(self._batch, self._step)

    def __exit__(self, *exc) -> bool:
        return False


def _guard_config(config: Any) -> GuardConfig:
    if config is None:
        return load_config().guard
    if isinstance(config, GuardConfig):
        return config
    if isinstance(config, Config):
        return config.guard
    if isinstance(config, (str, os.PathLike)):
        return load_config(config).guard
    if isinstance(config, Mapping):
        return _build({"guard": dict(config)}, "Guard(config=...)", base=load_config()).guard
    raise UsageError(f"Guard(config=...) got {type(config).__name__}", "nanprobe.Guard",
                     "Pass a nanprobe Config, its .guard section, a YAML path or a dict of guard keys")


def distributed() -> tuple[int, int]:
    """(rank, world size) under torch.distributed, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_flags(loss: torch.Tensor | None, t_loss: float, norm: torch.Tensor | None, t_norm: float,
               scaler_active: bool, device: torch.device, rank: int, world: int,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """[bad, first non-finite loss, weights], all-reduced (MAX) over the default group: every rank skips
    the step any rank saw, learns the lowest rank whose own loss was non-finite (coded ``world - rank``;
    0: none), whose gradients every other rank received through the gradient reduction, and whether the
    last update made any rank's weights non-finite (``weights``: that rank's weights flag). Plain
    tensors on ``device`` (never DTensors: a DTensor norm is reduced over its own mesh first)."""
    bad = torch.zeros((), dtype=torch.bool, device=device)
    loss_bad = torch.zeros((), dtype=torch.bool, device=device)
    if loss is not None:
        loss_bad = ~torch.isfinite(loss)
        bad = bad | loss_bad | (loss > t_loss)
    if norm is not None:
        ok = torch.isfinite(norm)
        bad = bad | (ok & (norm > t_norm))
        if not scaler_active:
            bad = bad | ~ok
    weights_bad = ~torch.isfinite(weights) if weights is not None else torch.zeros((), dtype=torch.bool,
                                                                                   device=device)
    flag = torch.stack([bad.float(), loss_bad.float() * (world - rank), weights_bad.float()])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag


def loss_rank_of(code: float, world: int) -> int | None:
    return world - int(code) if code > 0 else None


def rank_reason(reason: str, loss_rank: int) -> str:
    return f"{reason}: rank {loss_rank}'s loss was non-finite and its gradients reached every rank"


def check_guard_config(cfg: GuardConfig, where: str) -> None:
    """The guard: settings a config file cannot check by type alone."""
    if cfg.rng_states not in RNG_MODES:
        raise UsageError(f"guard.rng_states is {cfg.rng_states!r}", where, f"Use one of: {', '.join(RNG_MODES)}")
    if cfg.check_every < 1:
        raise UsageError(f"guard.check_every is {cfg.check_every}", where,
                         "Use 1 to check every step, or k to check every k-th step")
    if cfg.check_updates_every < 1:
        raise UsageError(f"guard.check_updates_every is {cfg.check_updates_every}", where,
                         "Use 1 to read the weights after every checked update, or k for every k-th")


def current_lr(optimizers: list[torch.optim.Optimizer]) -> float | None:
    """The first optimizer's first group's LR as a float (None for a tensor LR off the CPU: no sync)."""
    if not optimizers or not optimizers[0].param_groups:
        return None
    lr = optimizers[0].param_groups[0].get("lr")
    if isinstance(lr, torch.Tensor):
        return float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else None
    return float(lr) if isinstance(lr, (int, float)) else None


class Guard:
    """Skip bad optimizer updates in your own loop, and save the step for ``nanprobe run --capsule``.

    The whole loop::

        guard = nanprobe.Guard(model, optimizer, scaler=scaler, scheduler=scheduler,
                               precision="bf16", entry="train.py:target")
        for step, batch in enumerate(loader):
            with guard.step(batch):                 # notes the RNG state (and BatchNorm-style buffers)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cuda", torch.bfloat16):
                    loss = loss_fn(model, batch)
                guard.backward(loss)                # (scaler.scale(loss) if scaler else loss).backward()
            if guard.optimizer_step(max_grad_norm=1.0):   # clip, check, then step or skip
                scheduler.step()                    # only when the update was applied

    Cost: on a checked step (every ``check_every``-th, default all) the guard computes the global
    gradient norm with foreach kernels (or reuses the one clipping computes) and reads the loss and
    norm back in ONE device sync; RNG states are copied at step start (a few microseconds); weights
    are never copied: when an update is skipped, the weights "before the step" are the current ones.
    Under torch.distributed the bad flag is all-reduced (MAX) inside that same sync, so every rank
    skips the same step; each rank writes its own capsule (rank in the file name; under FSDP/DDP one
    directory every rank writes into with torch.distributed.checkpoint: ``nanprobe.capsule.sharded``).

    A GradScaler's normal skipped steps (inf gradients while it lowers the scale) are not failures;
    a skip storm is (the scale falling below ``min_scale`` and still skipping, or ``max_scale_drop``
    below where the skips started after training had worked); reading the scale on a skipped step
    is one more sync, on that step only. Spikes are judged by the same divergence model as replay
    and smoke (``nanprobe.judge.divergence``): noise that recovers is not a spike. Persistent buffers that change in the forward pass
    (BatchNorm running stats) are copied at the start of checked steps and put back when a step is
    skipped. Gradient accumulation: enter ``guard.step(micro_batch)`` for each micro-batch (right
    after fetching it) and call ``guard.backward`` on each loss; the step number advances at
    ``optimizer_step``, and a capsule holds every micro-batch with the RNG state after each fetch.
    ``optimizer`` and ``scheduler`` may be lists (or dicts): ``optimizer_step`` steps every optimizer
    (one GradScaler ``update``), and a capsule holds all of their state.
    ``enabled=False`` turns the guard into the plain loop (no checks, no syncs).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 scaler: torch.amp.GradScaler | None = None, scheduler: Any = None,
                 precision: str | Precision = "fp32", entry: str | None = None, config: Any = None,
                 enabled: bool = True, *, policy: str | None = None, check_every: int | None = None,
                 capsule_dir: str | os.PathLike | None = None, start_step: int = 0):
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"Guard(model=...) got {type(model).__name__}", "nanprobe.Guard",
                             "Pass the torch.nn.Module being trained")
        optimizers = named(optimizer, "optimizer")
        for name, opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise UsageError(f"Guard({name}=...) got {type(opt).__name__}", "nanprobe.Guard",
                                 "Pass the torch.optim.Optimizer(s) that update the model")
        try:
            self.precision = parse_precision(precision)
        except ValueError:
            raise UsageError(f"Guard(precision={precision!r}) is not a precision", "nanprobe.Guard",
                             'Use "fp32", "bf16" or "fp16"') from None
        if self.precision is Precision.FP32:   # bf16/fp16 weights without autocast: the run's precision
            self.precision = weights_precision(_capsule.unwrap(model)) or self.precision
        cfg = _guard_config(config)
        overrides = {k: v for k, v in (("policy", policy), ("check_every", check_every),
                                       ("capsule_dir", None if capsule_dir is None else str(capsule_dir)))
                     if v is not None}
        if overrides:
            cfg = _build({"guard": overrides}, "nanprobe.Guard(...)", base=Config(guard=cfg)).guard
        check_guard_config(cfg, "nanprobe.Guard")
        self.model = model
        self.optimizer = optimizer
        self.optimizers = [o for _, o in optimizers]
        self.scaler = scaler
        self.scheduler = scheduler
        self.schedulers = [s for _, s in named(scheduler, "scheduler")]
        self.entry = entry
        self.cfg = cfg
        self.enabled = bool(enabled)
        self.capsule_dir = Path(cfg.capsule_dir).resolve()
        self.events: list[GuardEvent] = []
        self.capsules: list[Path] = []
        self._device_type = device_of(_capsule.unwrap(model)).type
        self._next = int(start_step)        # number of the next step
        self._current: int | None = None    # number of the step in progress (after guard.step entered)
        self._batches: list[Any] = []       # the step's micro-batches (by reference)
        self._rng: dict[str, Any] | None = None   # at the step's start (the first guard.step)
        self._micro_rng: list[dict[str, Any]] = []  # after each micro-batch was fetched (each guard.step)
        self._rngs = RngTracker(self._device_type, cfg.rng_states)
        self._attrs: list[tuple[torch.nn.Module, str, str]] | None = None   # module tensor attributes
        self._order: tuple[tuple[int, ...], list[torch.Tensor]] | None = None   # _params' walk, by stepped ids
        self._carried: dict[str, Any] = {}
        self._loss: torch.Tensor | None = None
        self._deferred = False              # inside a closure optimizer's step: it applies the update
        self._update: tuple[int, torch.Tensor] | None = None   # the last checked update's weights flag
        self._updates = UpdateCheck(cfg.check_updates_every)     # which updates' weights were read
        self._needs_closure = next((type(o).__name__ for o in self.optimizers if _needs_closure(o)), None)
        self._consecutive = 0
        self._div = Divergence(Rules.of(cfg))   # the same divergence model as replay's and smoke's Judge
        self._losses, self._norms = self._div.loss.values, self._div.norm.values
        self._t_loss = self._t_norm = math.inf  # a loss / norm above these is bad at the next check
        self._history: deque[dict[str, Any]] = deque(maxlen=max(cfg.history, 1))
        self._buffers = [b for m in _capsule.unwrap(model).modules()
                         for name, b in m._buffers.items()
                         if b is not None and name not in m._non_persistent_buffers_set]
        self._shadow = [b.detach().clone() for b in self._buffers] if self._buffers else []
        # the precursor monitor (every monitor.live_every steps) and its one early warning
        self.monitor = live_monitor(_capsule.unwrap(model), config, self.precision) if self.enabled else None
        self.warnings: list[dict[str, Any]] = []

    # -- the verbs ----------------------------------------------------------------------------------

    @property
    def step_index(self) -> int:
        """The number of the step in progress (or of the next one)."""
        return self._current if self._current is not None else self._next

    def step(self, *args: Any, step: int | None = None) -> _StepContext:
        """``with guard.step(batch):`` around forward and backward (``guard.step(step, batch)`` also works).

        Entering notes the RNG state; the batch is kept by reference (not copied), so a loss_fn
        that changes the batch in place makes the capsule hold the changed batch.
        """
        if len(args) == 1:
            batch = args[0]
        elif len(args) == 2:
            if step is not None:
                raise TypeError("Guard.step() got the step number twice")
            step, batch = args
        elif not args:
            batch = None
        else:
            raise TypeError(f"Guard.step() takes (batch) or (step, batch), got {len(args)} arguments")
        return _StepContext(self, batch, step)

    def _begin(self, batch: Any, step: int | None) -> int:
        if step is not None:
            self._current = int(step)
        elif self._current is None:
            self._current = self._next
        if not self.enabled:
            return self._current
        if self.monitor is not None and not self._batches:
            self.monitor.begin(self._current)
        if self._current % self.cfg.check_every != 0:
            return self._current
        if not self._batches:   # the step's first micro-batch: its start
            self._rngs.begin_step()
            self._rng = self._rngs.capture()
            self._micro_rng = [self._rng]
            if self._buffers:
                torch._foreach_copy_(self._shadow, self._buffers)
            if self._attrs:
                self._carried = {qual: getattr(m, attr, None) for m, attr, qual in self._attrs}
        else:
            self._micro_rng.append(self._rngs.capture())
        self._batches.append(batch)
        return self._current

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(scaler.scale(loss) if scaler else loss).backward(**kwargs)``, and notes the loss (no sync)."""
        if self.enabled:
            d = loss.detach().float().reshape(())
            self._loss = d if self._loss is None else self._loss + d
        scaler = self._active_scaler()
        (scaler.scale(loss) if scaler is not None else loss).backward(**kwargs)

    def optimizer_step(self, max_grad_norm: float | None = None, *,
                       grad_norm: torch.Tensor | float | None = None, closure: Any = None) -> bool:
        """Clip (if ``max_grad_norm``), check the loss and global gradient norm, then step or skip.

        Returns True when the update was applied (step the scheduler then), False when it was
        skipped (by the guard, or by the GradScaler lowering its scale). Pass ``grad_norm`` if
        you computed the total norm yourself (after unscaling) to save one pass over the gradients.

        A closure optimizer (``LBFGS``, or any ``optimizer.step(closure)``): pass the closure
        (``zero_grad``, forward, backward, return the loss) and call this inside ``with
        guard.step(batch):``. The optimizer calls it as it would; the guard checks the loss and the
        gradients of its first evaluation, before any update, and when the step is bad drops those
        gradients there (no update: LBFGS stops at a zero gradient, the others skip parameters
        without one). No evaluation is added.
        """
        step = self.step_index
        if closure is None and self._needs_closure:
            raise UsageError(f"{self._needs_closure}.step() needs a closure", "Guard.optimizer_step()",
                             "Pass it: guard.optimizer_step(closure=closure), inside with guard.step(batch):")
        try:
            if closure is not None:
                return self._closure_step(step, closure, max_grad_norm)
            return self._optimizer_step(step, max_grad_norm, grad_norm)
        finally:
            if self.monitor is not None:
                self.monitor.abort()   # a step that did not finish cleanly drops its statistics
            self._current = None
            self._next = step + 1
            self._loss = None
            self._batches = []
            self._rng = None
            self._micro_rng = []

    # -- internals ------------------------------------------------------------------------------------

    def _active_scaler(self) -> torch.amp.GradScaler | None:
        s = self.scaler
        return s if s is not None and s.is_enabled() else None

    def _params(self) -> list[torch.Tensor]:
        """The parameters with a gradient in the order of ``model.parameters()`` (what the user's own
        ``clip_grad_norm_(model.parameters(), ...)`` sums: with several param groups their order differs,
        and so would the global norm in its last bits), then optimizer tensors outside the model."""
        if not self.optimizers:
            return [p for p in self.model.parameters() if p.grad is not None]
        stepped = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        key = tuple(map(id, stepped))
        if self._order is None or self._order[0] != key:   # the module walk (~0.1 ms) once per param set
            ids, model = set(key), list(self.model.parameters())
            in_model = {id(p) for p in model}
            self._order = key, [p for p in model if id(p) in ids] + [p for p in stepped if id(p) not in in_model]
        return [p for p in self._order[1] if p.grad is not None]

    def _unscale(self, scaler: torch.amp.GradScaler) -> None:
        for opt in self.optimizers:
            try:
                scaler.unscale_(opt)
            except RuntimeError as exc:
                if "already been called" not in str(exc):
                    raise

    def _closure_step(self, step: int, closure: Any, max_grad_norm: float | None) -> bool:
        if len(self.optimizers) != 1 or self._active_scaler() is not None:
            raise UsageError("Guard.optimizer_step(closure=...) with several optimizers or a GradScaler",
                             "nanprobe.Guard", "A closure steps one optimizer (GradScaler.step takes no closure)")
        verdict: list[bool] = []

        def guarded():
            with torch.enable_grad():
                loss = closure()
            if not verdict:   # the first evaluation: the step's loss and gradients, before any update
                if self.enabled and self._loss is None and isinstance(loss, torch.Tensor):
                    self._loss = loss.detach().float().reshape(())
                self._deferred = True   # the optimizer applies (or not) the update it is computing
                try:
                    verdict.append(self._optimizer_step(step, max_grad_norm, None))
                finally:
                    self._deferred = False
            return loss

        opt = self.optimizers[0]
        opt.step(guarded)
        if verdict and verdict[0] and self.enabled and step % self.cfg.check_every == 0:
            self._queue_update(step)
        return verdict[0] if verdict else True

    def _apply(self, scaler: torch.amp.GradScaler | None) -> None:
        if not self.optimizers or self._deferred:
            return
        if scaler is not None:
            for opt in self.optimizers:
                scaler.step(opt)
            scaler.update()
        else:
            for opt in self.optimizers:
                opt.step()

    def _optimizer_step(self, step: int, max_grad_norm: float | None,
                        grad_norm: torch.Tensor | float | None) -> bool:
        scaler = self._active_scaler()
        checked = self.enabled and step % self.cfg.check_every == 0
        if scaler is not None and (max_grad_norm or checked):
            self._unscale(scaler)
        params = self._params() if (max_grad_norm or checked) else []
        norm: torch.Tensor | float | None = None
        every_rank = fsdp1_root(self.model) is not None   # FSDP1: a rank may hold no gradient, yet reduces
        if max_grad_norm and (params or every_rank):
            norm = clip_norm(self.model, params, max_grad_norm)
        elif grad_norm is not None:
            norm = grad_norm
        elif checked and (params or every_rank):
            norm = total_norm(self.model, [p.grad for p in params])   # FSDP1: shard norms summed over its group
        if not checked:
            self._apply(scaler)
            self._updates.unchecked()
            return True
        norm = full_value(norm)   # FSDP2: the global norm, reduced over the gradients' own mesh

        self._rngs.end_step()
        if self._attrs is None:   # after the first step's forward: tensors modules keep as attributes
            self._attrs = [a for a in module_tensor_attrs(_capsule.unwrap(self.model))]
        loss = self._loss
        rank, world = distributed()
        update, self._update = self._update, None
        loss_v, norm_v, others_bad, loss_rank, weights_bad = self._read(
            loss, norm, scaler, (rank, world) if world > 1 else None, update[1] if update is not None else None)
        # the flag is the largest L2 norm: finite weights whose squares pass 3.4e38 (a 1e38 sentinel row) read
        # as inf there; the exact check confirms it (rare path, every rank is here: the flag was reduced)
        weights_bad = weights_bad and not weights_finite(self.model)
        if update is not None:
            self._updates.read(update[0], not weights_bad)
        if weights_bad:   # the last checked update made weights non-finite: name it (raises, but under "record")
            self._update_born(update[0], rank, world)
        reason, status = self._judge(loss_v, norm_v, scaler is not None)
        unread = self._updates.unread() if reason is not None or others_bad else None
        if unread is not None and not weights_finite(self.model):   # rare path: every rank is here (flags reduced)
            self._update_born(unread, rank, world)
        scaler_skip = (scaler is not None and norm_v is not None and not math.isfinite(norm_v)
                       and reason is None)
        lr = self._lr()
        if reason is None and others_bad:
            reason, status = "another rank saw a non-finite value or spike at this step", "nonfinite"
            local = False
        elif reason is not None and loss_rank is not None and loss_rank != rank and math.isfinite(loss_v or 0.0):
            # this rank's loss is finite: its non-finite gradients came through the gradient reduction
            reason, local = rank_reason(reason, loss_rank), False
        else:
            local = True
        if reason is None and scaler_skip:
            # GradScaler's back-off, judged by the trajectory of its scale (rare path: reading it syncs)
            reason = self._div.scaler_skip(scaler.get_scale())
            status = "nonfinite"
            if reason is None:
                reason = self._div.spike(loss_v, None, step=step)
                status = "spike"
            if reason is None:
                self._apply(scaler)   # the scaler skips this update and lowers its scale
                self._add(loss_v, None)
                self._history.append(_hist(step, loss_v, norm_v, lr, finite=True, skipped=True))
                return False
        if reason is not None:
            return self._bad(step, reason, status, local, loss_v, norm_v, lr, scaler, max_grad_norm, rank, world)
        w = close_step(self.monitor, step, loss=loss_v, grad_norm=norm_v, lr=lr, scaler=scaler,
                       optimizers=self.optimizers, logger=logger)
        if w is not None:
            self.warnings.append(w)
        self._apply(scaler)
        if not self._deferred:   # a closure optimizer updates after this returns: _closure_step queues it
            self._queue_update(step)
        self._consecutive = 0
        self._add(loss_v, norm_v)
        self._history.append(_hist(step, loss_v, norm_v, lr, finite=True, skipped=False))
        return True

    def _queue_update(self, step: int) -> None:
        """The update of checked step ``step`` ran: on every ``guard.check_updates_every``-th, its weights
        flag is read in the next check's sync."""
        flag = self._updates.applied_update(step, self.optimizers)
        self._update = (step, flag) if flag is not None else None

    def _update_born(self, step: int, rank: int, world: int) -> None:
        """The update of step ``step`` made weights non-finite (seen in this check's sync): log it as that
        step's event, naming the parameter, LR and optimizer state; raise unless the policy is record."""
        names = {id(q): n for n, q in _capsule.unwrap(self.model).named_parameters()}
        upd = update_forensics(self.optimizers, names)
        rows = upd.get("nonfinite_parameters")
        reason = describe(upd, step) if rows else f"the optimizer update of step {step} made the weights " \
                                                  "non-finite" + (" on another rank" if world > 1 else "")
        since = self._updates.since(step)
        if since is not None:
            reason = f"{reason} ({since})"
        command = f"nanprobe run {shlex.quote(self.entry) if self.entry else 'ENTRY'} --at {step}"
        action = "recorded" if self.cfg.policy == "record" else "raised"
        event = GuardEvent(step=step, status="nonfinite", reason=reason, action=action, local=bool(rows),
                           capsule=None, command=command, rank=rank)
        self.events.append(event)
        logger.warning("nanprobe.Guard: %sstep %d: %s. Diagnose it: %s", f"rank {rank}: " if rank else "", step,
                       reason, command)
        if action == "raised":
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            raise GuardTripped(event, "the weights are non-finite")

    def _read(self, loss: torch.Tensor | None, norm: torch.Tensor | float | None,
              scaler: torch.amp.GradScaler | None, distributed: tuple[int, int] | None,
              weights: torch.Tensor | None) -> tuple[float | None, float | None, bool, int | None, bool]:
        """Loss, norm and the last update's weights flag to the host in one sync; under torch.distributed
        (``(rank, world)``), the all-reduced bad flags (any rank's step, the first rank whose loss was
        non-finite, any rank's weights) too."""
        parts: list[torch.Tensor] = []
        device = loss.device if loss is not None else (norm.device if isinstance(norm, torch.Tensor) else None)
        if loss is not None:
            parts.append(loss.float().reshape(1))
        norm_t = norm if isinstance(norm, torch.Tensor) else None
        if norm_t is not None:
            parts.append(norm_t.detach().float().reshape(1).to(device))
        if distributed:
            if device is None:
                device = torch.device("cuda", torch.cuda.current_device()) \
                    if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
            nv = parts[-1][0] if norm_t is not None else (
                torch.tensor(float(norm), device=device) if norm is not None else None)
            parts.append(rank_flags(parts[0][0] if loss is not None else None, self._t_loss, nv, self._t_norm,
                                    scaler is not None, device, *distributed,
                                    weights=None if weights is None else weights.to(device)))
        elif weights is not None:
            parts.append(weights.reshape(1).to(device) if device is not None else weights.reshape(1))
        values = torch.cat(parts).tolist() if parts else []   # the one device sync
        i = 0
        loss_v = norm_v = None
        if loss is not None:
            loss_v, i = values[0], 1
        if norm_t is not None:
            norm_v, i = values[i], i + 1
        elif norm is not None:
            norm_v = float(norm)
        if not distributed:
            return loss_v, norm_v, False, None, weights is not None and not math.isfinite(values[i])
        return loss_v, norm_v, bool(values[i] > 0), loss_rank_of(values[i + 1], distributed[1]), values[i + 2] > 0

    def _judge(self, loss: float | None, norm: float | None, scaler: bool) -> tuple[str | None, str]:
        """Non-finite values and spikes, as the replay's Judge decides them (a few comparisons here:
        the cut-offs were computed by ``_add``). A non-finite norm under a GradScaler is left to the
        scaler-skip handling in ``_optimizer_step``."""
        if loss is not None and not math.isfinite(loss):
            return f"loss is {loss}", "nonfinite"
        if norm is not None and not math.isfinite(norm):
            return (None, "nonfinite") if scaler else (f"gradient norm is {norm}", "nonfinite")
        self._div.scaler_ok()
        if (loss is not None and loss > self._t_loss) or (norm is not None and norm > self._t_norm):
            reason = self._div.spike(loss, norm, step=self.step_index)
            if reason is not None:
                return reason, "spike"
        return None, "finite"

    def _add(self, loss: float | None, norm: float | None) -> None:
        self._div.add(loss, norm, step=self.step_index)
        self._t_loss, self._t_norm = self._div.loss_cut(), self._div.norm_cut()

    def _lr(self) -> float | None:
        return current_lr(self.optimizers)

    def _bad(self, step: int, reason: str, status: str, local: bool, loss_v: float | None, norm_v: float | None,
             lr: float | None, scaler: torch.amp.GradScaler | None, max_grad_norm: float | None,
             rank: int, world: int) -> bool:
        policy = self.cfg.policy
        self._consecutive += 1
        corrupt = not weights_finite(_capsule.unwrap(self.model))   # rare path: a sync here is fine
        if corrupt:
            local = True
            last = max(step - 1, 0)
            reason = (f"{reason}, and the weights were already non-finite before this step: the optimizer "
                      f"update of step {last} made them so (skipping cannot undo an applied update)")
        if policy != "record" and self._shadow:
            torch._foreach_copy_(self._buffers, self._shadow)
        path = None
        note = ""
        if not corrupt:
            try:
                path = self._write_capsule(step, reason, status, local, loss_v, norm_v, lr, scaler,
                                           max_grad_norm, rank, world)
            except OSError as exc:
                note = f" (capsule not written: {exc.strerror or exc})"
        command = self._command(path) if path else (
            f"nanprobe run {shlex.quote(self.entry) if self.entry else 'ENTRY'} --at {max(step - 1, 0)}"
            if corrupt else None)
        if policy == "record":
            self._apply(scaler)
            applied, action = True, "recorded"
        else:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.update(scaler.get_scale())   # keep the scale; reset its per-step state
            applied = False
            stop = policy == "raise" or corrupt or self._consecutive >= self.cfg.max_consecutive_skips
            action = "raised" if stop else "skipped"
        event = GuardEvent(step=step, status=status, reason=reason, action=action, local=local,
                           capsule=str(path) if path else None, command=command, rank=rank,
                           loss=loss_v, grad_norm=norm_v)
        self.events.append(event)
        # StepRecord.skipped means "GradScaler skipped"; a guard skip shows as finite=False / a spike
        self._history.append(_hist(step, loss_v, norm_v, lr, finite=status != "nonfinite", skipped=False))
        who = f"rank {rank}: " if world > 1 else ""
        verb = {"skipped": "update skipped", "recorded": "update applied (policy record)",
                "raised": "update skipped, stopping"}[action]
        logger.warning("nanprobe.Guard: %sstep %d %s: %s.%s %s", who, step, verb, reason, note,
                       f"Replay it: {command}" if command else "")
        if action == "raised":
            if policy == "raise":
                why = "policy 'raise'"
            elif corrupt:
                why = "the weights are non-finite"
            else:
                why = f"{self._consecutive} bad steps in a row, guard.max_consecutive_skips is " \
                      f"{self.cfg.max_consecutive_skips}"
            raise GuardTripped(event, why)
        return applied

    def _write_capsule(self, step, reason, status, local, loss_v, norm_v, lr, scaler, max_grad_norm,
                       rank, world) -> Path | None:
        if _capsule.no_room(self.capsules, self.cfg.max_capsules):
            return None
        rng = dict(self._rng) if self._rng is not None else capture_rng(self._device_type)
        micro_rng = [dict(r) for r in self._micro_rng] or [rng]
        if "python" not in rng:   # not copied at step start: the step does not draw from them (rng_states)
            host = capture_rng("cpu", host=True)
            for r in [rng, *micro_rng]:
                r.update({k: v for k, v in host.items() if k in ("python", "numpy")})
        carried = _capsule.carried_attrs(self._carried)
        data = _capsule.build(model=self.model, optimizers=self.optimizers, schedulers=self.schedulers,
                              scalers=[scaler] if scaler is not None else [],
                              micro_batches=self._batches if self._batches else None, rng=rng, micro_rng=micro_rng,
                              step=step, precision=self.precision, status=status, reason=reason,
                              record=_hist(step, loss_v, norm_v, lr, finite=status != "nonfinite", skipped=False),
                              history=list(self._history), entry=self.entry, rank=rank, world_size=world,
                              local=local, max_grad_norm=max_grad_norm, carried=carried,
                              grad_scaler=scaler is not None)
        path = _capsule.write(data, self.capsule_dir, model=self.model, optimizers=self.optimizers)
        self.capsules.append(path)
        _capsule.prune(self.capsules, self.cfg.max_capsules, self._own_capsule)
        return path

    def _own_capsule(self, path: Path) -> bool:
        """A file the guard may delete: in its capsule folder, named as nanprobe names capsules, and a
        capsule by its contents. Anything else (an edited or foreign checkpoint entry) is left alone."""
        try:
            p = Path(path).resolve()
        except (OSError, RuntimeError):
            return False
        if p.is_dir():   # a sharded capsule (FSDP/DDP): a directory of rank files and DCP shards
            return p.parent == self.capsule_dir and bool(_capsule.sharded.DIR_NAME.match(p.name)) \
                and _capsule.sharded.is_capsule_dir(p)
        if p.parent != self.capsule_dir or not _capsule.io.NAME.match(p.name) or not p.is_file():
            return False
        try:
            _capsule.read(p)
        except NanprobeError:
            return False
        return True

    def _command(self, path: Path) -> str:
        return _capsule.replay_command(self.entry, path)

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The guard's running statistics and counters (for your checkpoint); weights_only-safe."""
        return {"next_step": self._next, "consecutive": self._consecutive, "scaler_skips": self._div.skips,
                "losses": list(self._losses), "norms": list(self._norms), "divergence": self._div.state_dict(),
                "history": [dict(h) for h in self._history], "capsules": [str(p) for p in self.capsules]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._next = int(state["next_step"])
        self._current = None
        self._consecutive = int(state.get("consecutive", 0))
        div = state.get("divergence")
        if div is None:   # a state_dict from before the divergence model: its windows only
            div = {"loss": {"values": state.get("losses", [])}, "norm": {"values": state.get("norms", [])},
                   "skips": state.get("scaler_skips", 0)}
        self._div.load_state_dict(div)
        self._t_loss, self._t_norm = self._div.loss_cut(), self._div.norm_cut()
        self._history.clear()
        self._history.extend(dict(h) for h in state.get("history", []))
        capsules = []
        for p in state.get("capsules", []):
            if isinstance(p, (str, os.PathLike)) and self._own_capsule(Path(p)):
                capsules.append(Path(p).resolve())
            else:
                logger.warning("nanprobe.Guard: ignoring %r from the loaded state: not a capsule this guard wrote "
                               "in %s (it will never be deleted)", p, self.capsule_dir)
        self.capsules = capsules


def _needs_closure(opt: torch.optim.Optimizer) -> bool:
    """``opt.step`` has a ``closure`` parameter without a default (LBFGS)."""
    try:
        param = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def _hist(step: int, loss: float | None, norm: float | None, lr: float | None, *, finite: bool,
          skipped: bool) -> dict[str, Any]:
    return {"step": step, "loss": loss, "grad_norm": norm, "lr": lr, "finite": finite, "skipped": skipped}


__all__ = ["Guard", "GuardEvent", "GuardTripped"]
