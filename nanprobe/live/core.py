"""The step core: what is decided about one live training step, however nanprobe sees it.

``nanprobe.Guard`` (the user's own loop calls it), the hook-driven guard (``watch`` and the Lightning and
transformers callbacks) translate their events into the core's:

* :meth:`StepCore.begin` per micro-batch: the batch by reference, the RNG state when the step reached it;
  the first one also copies persistent buffers (BatchNorm statistics) and module tensor attributes;
* :meth:`StepCore.note_loss` per backward: the loss, detached, no sync;
* :meth:`StepCore.check` before the update: the loss, the global gradient norm and the last applied
  update's weights flag read back in ONE device sync (under ``torch.distributed`` the bad flags are
  all-reduced in that same sync, so every rank decides the same), then judged by the divergence model of
  replay and smoke; the update-born check names an earlier update that made the weights non-finite;
* :meth:`StepCore.passed` after a good step (the precursor monitor, the history), :meth:`StepCore.applied`
  after its update (the weights flag queued for the next check), :meth:`StepCore.caught` on a bad one
  (buffers put back unless the policy records, weights already non-finite found out), and
  :meth:`StepCore.write_capsule` writes its capsule from the objects the adapter passes.

What follows a verdict (skip, raise, record, whether to write a capsule, diagnose in-process) is the
adapter's: the policy is a parameter of the adapter, not a kind of core.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import shlex
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..base.config import Config, GuardConfig, _build, load_config
from ..base.errors import UsageError
from ..base.report import Status, StepRecord
from ..base.sharding import full_value, weights_finite
from ..judge.divergence import Judge
from ..judge.monitor import close_step, curves_at, live_monitor
from ..judge.updates import UpdateCheck, describe, update_forensics
from ..reach.feed import Position
from ..reach.state import RngTracker, module_tensor_attrs
from .. import capsule as _capsule
from ..base.precision import device_of

RNG_MODES = ("auto", "all", "torch")


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


def resolve_config(config: Any, where: str, **guard: Any) -> Config:
    """A Config from None (the defaults), a Config, a YAML path or a dict of sections; ``guard`` keys
    that are not None override the guard section (e.g. ``check_every``)."""
    if isinstance(config, Config):
        cfg = config
    elif config is None or isinstance(config, (str, os.PathLike)):
        cfg = load_config(config)
    elif isinstance(config, Mapping):
        cfg = _build(dict(config), where, base=load_config())
    else:
        raise UsageError(f"config={type(config).__name__!s} is not a config", where,
                         "Pass a nanprobe Config, a YAML path or a dict of sections such as {'guard': {...}}")
    overrides = {k: v for k, v in guard.items() if v is not None}
    return _build({"guard": overrides}, where, base=cfg) if overrides else cfg


def current_lr(optimizers: list[torch.optim.Optimizer]) -> float | None:
    """The first optimizer's first group's LR as a float (None for a tensor LR off the CPU: no sync)."""
    if not optimizers or not optimizers[0].param_groups:
        return None
    lr = optimizers[0].param_groups[0].get("lr")
    if isinstance(lr, torch.Tensor):
        return float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else None
    return float(lr) if isinstance(lr, (int, float)) else None


def distributed() -> tuple[int, int]:
    """(rank, world size) under torch.distributed, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def at_command(entry: str | None, step: int) -> str:
    """The command that diagnoses step ``step`` by replaying it (``ENTRY`` where the entrypoint is not known)."""
    return f"nanprobe run {shlex.quote(entry) if entry else 'ENTRY'} --at {step}"


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.nn.utils.get_total_norm(grads) if grads else None


@dataclasses.dataclass(slots=True)
class Verdict:
    """What the check decided about a step before its update."""

    status: Status
    reason: str | None
    local: bool                  # this rank saw it itself (False: another rank did)
    record: StepRecord
    rank: int
    world: int
    # an earlier applied update made the weights non-finite: (its step, its optimizers); that step is the bad one
    update_born: tuple[int, list[torch.optim.Optimizer]] | None = None


class StepCore:
    """One live run's step state and judgement (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, cfg: Config, precision: Any, logger: Any, *, slow: bool = False):
        self.gcfg = cfg.guard
        self.model = model
        self.module = _capsule.unwrap(model)
        self.logger = logger
        self.monitor = live_monitor(self.module, cfg, precision)    # the precursor monitor
        # the divergence model of replay and smoke, with the guard: thresholds; ``slow``: a slow divergence too,
        # by smoke's rule (the loss broke away from its best level, and a precursor or the gradient norm is
        # behind it), judged once per run
        self.judge = Judge(self.gcfg, self.monitor if slow else None)
        self.device_type = device_of(self.module).type
        self.rngs = RngTracker(self.device_type, self.gcfg.rng_states)
        self.history: deque[StepRecord] = deque(maxlen=max(self.gcfg.history, 1))
        self.updates = UpdateCheck(self.gcfg.check_updates_every)   # which updates' weights were read
        self.warnings: list[dict[str, Any]] = []                     # its one early warning
        # where the precursor series go as scalars (the script's or trainer's logger), if it has one
        self.curves: Callable[[int, dict[str, float]], None] | None = None
        self.consecutive = 0
        self.checks = 0
        self.items: list[Any] = []                 # the step's micro-batches, by reference
        self.rng_after: list[dict[str, Any]] = []  # the RNG state as the step reached each micro-batch
        self.losses: list[tuple[torch.Tensor, torch.Tensor | float | None]] = []   # (detached loss, its scale)
        self.checked = True                        # the step in progress is checked (guard.check_every)
        self.attrs: list[tuple[torch.nn.Module, str, str]] | None = None   # tensors modules keep as attributes
        self.carried: dict[str, Any] = {}          # their values at the step's start
        self._world: tuple[int, int] | None = None
        self._update: tuple[int, torch.Tensor, list] | None = None   # the last checked update's weights flag
        self._update_optimizers: list[torch.optim.Optimizer] = []     # those of the last applied update
        self._buffers = [b for m in self.module.modules() for name, b in m._buffers.items()
                         if b is not None and name not in m._non_persistent_buffers_set]
        self._shadow = [b.detach().clone() for b in self._buffers]

    # -- capture --------------------------------------------------------------------------------------

    def begin(self, step: int, batch: Any) -> None:
        """A micro-batch of step ``step`` is about to run (the first one starts the step)."""
        if not self.items:
            if self.monitor is not None:
                self.monitor.begin(step)
            self.checked = step % self.gcfg.check_every == 0
            if self.checked:
                self.rngs.begin_step()
                if self._buffers:
                    torch._foreach_copy_(self._shadow, self._buffers)
                if self.attrs:
                    self.carried = {qual: getattr(m, attr, None) for m, attr, qual in self.attrs}
        if self.checked:
            self.rng_after.append(self.rngs.capture())
        self.items.append(batch)

    def note_loss(self, loss: torch.Tensor, scale: torch.Tensor | float | None = None) -> None:
        """A loss backpropagated in the step (``scale``: the GradScaler's factor it was multiplied by).
        Kept detached; read back with the norm in the check's one sync."""
        if self.checked and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.losses.append((loss.detach(), scale))

    def reset(self) -> None:
        """The step is over (checked or not): drop what was captured for it."""
        if self.monitor is not None:
            self.monitor.abort()   # a step that did not finish cleanly drops its statistics
        self.items, self.rng_after, self.losses = [], [], []

    def world(self) -> tuple[int, int]:
        if self._world is None or self.checks % 100 == 1:   # is_initialized() costs ~10 us: not every step
            self._world = distributed()
        return self._world

    # -- the check ------------------------------------------------------------------------------------

    def check(self, step: int, optimizers: list[torch.optim.Optimizer], norm: torch.Tensor | float | None,
              scaler: torch.amp.GradScaler | None, position: Position | None = None) -> Verdict:
        """Judge the checked step ``step`` before its update: one device sync (a GradScaler skip reads its
        scale, one more, on that step only). ``scaler``: the loop's enabled GradScaler, if any."""
        self.checks += 1
        self.rngs.end_step()
        if self.attrs is None:   # after the first forward: tensors modules keep as attributes
            self.attrs = module_tensor_attrs(self.module)
        norm = full_value(norm)   # FSDP2: the global norm, reduced over the gradients' own mesh
        update, self._update = self._update, None
        rank, world = self.world()
        loss_v, norm_v, others_bad, loss_rank, weights_bad = self._read(
            norm, scaler is not None, (rank, world) if world > 1 else None, update[1] if update is not None else None)
        skipped = scaler is not None and norm_v is not None and not math.isfinite(norm_v)
        # a skip is judged by the trajectory of the loss scale (warm-up back-off or a collapse)
        scale = float(scaler.get_scale()) if skipped else None
        finite = (loss_v is None or math.isfinite(loss_v)) and (norm_v is None or math.isfinite(norm_v) or skipped)
        record = StepRecord(step=step, loss=loss_v, grad_norm=norm_v, lr=current_lr(optimizers), update_ratio=None,
                            finite=finite, skipped=skipped, scale=scale, epoch=position.epoch if position else None,
                            index=position.index if position else None)
        if world > 1:   # each rank's own loss: a rank alone must not decide (its capsule write would be collective)
            self.judge.slow = None
        status, reason = self.judge.judge(record, params_finite=True)
        if status is Status.DIVERGING:
            self.judge.slow = None   # one slow divergence per run
        local = True
        if status is Status.FINITE and others_bad:
            status, reason, local = Status.NONFINITE, "another rank saw a non-finite value or spike at this step", \
                False
        elif status is not Status.FINITE and loss_rank not in (None, rank) and math.isfinite(loss_v or 0.0):
            # this rank's loss is finite: its non-finite gradients came through the gradient reduction
            reason, local = f"{reason or 'bad step'}: rank {loss_rank}'s loss was non-finite and its gradients " \
                "reached every rank", False
        verdict = Verdict(status=status, reason=reason, local=local, record=record, rank=rank, world=world)
        # the flag is the largest L2 norm: finite weights whose squares pass 3.4e38 (a 1e38 sentinel row) read
        # as inf there; the exact check confirms it (rare path, every rank is here: the flag was reduced)
        weights_bad = weights_bad and not weights_finite(self.model)
        if update is not None:
            self.updates.read(update[0], not weights_bad)
        if weights_bad:   # the last checked update made weights non-finite: that step is the bad one
            verdict.update_born = (update[0], update[2])
        elif status is not Status.FINITE and (unread := self.updates.unread()) is not None \
                and not weights_finite(self.model):   # rare path: every rank is here (flags reduced)
            verdict.update_born = (unread, self._update_optimizers or optimizers)
        return verdict

    def passed(self, verdict: Verdict, optimizers: list[torch.optim.Optimizer],
               scaler: torch.amp.GradScaler | None) -> None:
        """A checked step was judged good (a GradScaler's normal skip too): the precursor monitor, the
        divergence model's statistics, the history."""
        r = verdict.record
        if not r.skipped:
            monitored = self.monitor is not None and self.monitor._active
            w = close_step(self.monitor, r.step, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr, scaler=scaler,
                           optimizers=optimizers, logger=self.logger)
            if w is not None:
                self.warnings.append(w)
            if monitored:   # the update of the step before, measured now: on its record (step-size evidence)
                ratio = self.monitor.trend.series.get("update/ratio")
                if ratio and ratio[-1][0] == r.step and self.history and self.history[-1].step == r.step - 1:
                    self.history[-1] = dataclasses.replace(self.history[-1], update_ratio=ratio[-1][1])
            if self.monitor is not None:
                self.monitor.pre_sample(r.step)
            if monitored and self.curves is not None and (values := curves_at(self.monitor.trend, r.step)):
                try:
                    self.curves(r.step, values)
                except Exception:  # noqa: BLE001 - a logger's failure never stops training
                    self.logger.debug("logging the precursor curves failed", exc_info=True)
            self.consecutive = 0
        self.judge.add(r)
        self.history.append(r)

    def applied(self, step: int, optimizers: list[torch.optim.Optimizer]) -> None:
        """The update of checked good step ``step`` ran: on every ``guard.check_updates_every``-th, its
        weights flag (no sync) is read in the next check's one sync."""
        self._update_optimizers = optimizers
        flag = self.updates.applied_update(step, optimizers)
        self._update = (step, flag, optimizers) if flag is not None else None

    def final_update(self) -> tuple[int, list[torch.optim.Optimizer]] | None:
        """Training ended: the last checked update's weights flag (one sync). (step, optimizers) of that
        update when it made weights non-finite, else None."""
        update, self._update = self._update, None
        if update is not None:
            if math.isfinite(float(update[1])):
                self.updates.read(update[0], True)
                return None
            return update[0], update[2]
        step = self.updates.unread()   # the last updates were not read (check_updates_every): read the weights
        if step is None or weights_finite(self.model):
            return None
        return step, self._update_optimizers

    def update_born(self, step: int, optimizers: list[torch.optim.Optimizer], world: int
                    ) -> tuple[dict[str, Any], str, str | None]:
        """The update of step ``step`` made the weights non-finite: the live optimizer's forensics
        (parameter, LR, state), the reason to report and, where earlier updates were not read, the range
        that may have made them (:meth:`UpdateCheck.since`)."""
        self.consecutive += 1
        upd = update_forensics(optimizers, {id(q): n for n, q in self.module.named_parameters()})
        where = " on another rank" if world > 1 else ""
        reason = describe(upd, step) if upd.get("nonfinite_parameters") else \
            f"the optimizer update of step {step} made the weights non-finite{where}"
        return upd, reason, self.updates.since(step)

    def caught(self, verdict: Verdict, policy: str) -> bool:
        """A bad step (not update-born): the run of bad steps grows, persistent buffers are put back as
        before the step unless the policy records it, and the weights are read exactly (rare path: a sync
        here is fine). True when they were already non-finite: ``verdict`` then says so."""
        self.consecutive += 1
        if policy != "record" and self._shadow:
            torch._foreach_copy_(self._buffers, self._shadow)   # BatchNorm statistics as before the step
        if weights_finite(self.model):
            return False
        verdict.local = True
        verdict.reason = (f"{verdict.reason}, and the weights were already non-finite before this step: the "
                          f"optimizer update of step {max(verdict.record.step - 1, 0)} made them so (skipping cannot "
                          "undo an applied update)")
        return True

    def stop_reason(self, policy: str, corrupt: bool) -> str | None:
        """Why training must stop after a bad step (None: go on)."""
        if corrupt:
            return "the weights are non-finite"
        if policy == "raise":
            return "policy 'raise'"
        if policy != "record" and self.consecutive >= self.gcfg.max_consecutive_skips:
            return f"{self.consecutive} bad steps in a row, guard.max_consecutive_skips is " \
                   f"{self.gcfg.max_consecutive_skips}"
        return None

    def at_start(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with the module tensor attributes as the step found them (then back as they are)."""
        now = {qual: getattr(m, attr, None) for m, attr, qual in (self.attrs or ())}
        try:
            for m, attr, qual in self.attrs or ():
                if qual in self.carried:
                    setattr(m, attr, self.carried[qual])
            return fn()
        finally:
            for m, attr, qual in self.attrs or ():
                setattr(m, attr, now[qual])

    def write_capsule(self, v: Verdict, folder: Path, capsules: list[Path], *, optimizers: list[Any],
                      may_delete: Callable[[Path], bool] = lambda path: True, **fields: Any
                      ) -> tuple[Path | None, str | None]:
        """The capsule of bad step ``v`` in ``folder`` (``fields``: the adapter's objects, batches, RNG
        states and settings, as :func:`nanprobe.capsule.build` takes them), then the adapter's list of
        written ``capsules`` cut to ``guard.max_capsules``: (its path, None where there is no room; a
        note where it could not be written)."""
        if _capsule.no_room(capsules, self.gcfg.max_capsules):
            return None, None
        try:
            data = _capsule.build(model=self.model, optimizers=optimizers, step=v.record.step,
                                  status=v.status.value, reason=v.reason or "bad step",
                                  record=_capsule.record_dict(v.record),
                                  history=[_capsule.record_dict(h) for h in self.history], rank=v.rank,
                                  world_size=v.world, local=v.local, carried=_capsule.carried_attrs(self.carried),
                                  **fields)
            path = _capsule.write(data, folder, model=self.model, optimizers=optimizers)
            capsules.append(path)
            _capsule.prune(capsules, self.gcfg.max_capsules, may_delete)
        except OSError as exc:
            return None, f"capsule not written: {exc.strerror or exc}"
        return path, None

    # -- the one sync ---------------------------------------------------------------------------------

    def thresholds(self) -> tuple[float, float]:
        """The divergence model's cut-offs for this step (for the on-device flag all ranks reduce): a
        value above them may be a spike, one below never is."""
        return self.judge.model.loss_cut(), self.judge.model.norm_cut()

    def _read(self, norm: torch.Tensor | float | None, scaler_active: bool, dist: tuple[int, int] | None,
              weights: torch.Tensor | None) -> tuple[float | None, float | None, bool, int | None, bool]:
        """The step's losses (their sum), the norm, the last update's weights flag and, under
        torch.distributed (``(rank, world)``), the all-reduced bad flags (any rank's step, the first rank
        with a non-finite loss, any rank's weights) to the host in one sync: one ``stack`` and one
        ``tolist`` (few ops: each costs microseconds)."""
        losses = self.losses
        given = None if norm is None or isinstance(norm, torch.Tensor) else float(norm)   # the caller's number
        scales = [s for _, s in losses if isinstance(s, torch.Tensor)]
        at = len(losses) + len(scales)   # where a tensor norm is
        parts = [t for t, _ in losses] + scales + ([norm.detach()] if isinstance(norm, torch.Tensor) else [])
        if weights is not None and not dist:
            parts.append(weights)
        if not parts and not dist:
            return None, given, False, None, False
        device = parts[0].device if parts else torch.device("cuda", torch.cuda.current_device()) \
            if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        if any(t.dtype != torch.float32 or t.device != device or t.dim() for t in parts):
            parts = [t.float().reshape(()).to(device) for t in parts]
        stacked = torch.stack(parts) if parts else torch.zeros(0, device=device)
        if dist:
            nv = stacked[at] if isinstance(norm, torch.Tensor) else given
            stacked = torch.cat([stacked, self._reduce_flag(device, nv, scaler_active, dist, weights)])
        values = stacked.tolist()   # the one device sync
        loss_v = None
        it = iter(values[len(losses):at])
        for (_, scale), v in zip(losses, values):   # float32 sums as torch adds them, exactly (see _f32)
            if scale is not None:
                v = _f32(v / (next(it) if isinstance(scale, torch.Tensor) else scale))
            loss_v = v if loss_v is None else _f32(loss_v + v)
        norm_v = values[at] if isinstance(norm, torch.Tensor) else given
        if not dist:
            return loss_v, norm_v, False, None, weights is not None and not math.isfinite(values[-1])
        # the first rank whose loss was non-finite is coded ``world - rank`` (0: none)
        loss_rank = dist[1] - int(values[-2]) if values[-2] > 0 else None
        return loss_v, norm_v, bool(values[-3] > 0), loss_rank, bool(values[-1] > 0)

    def _reduce_flag(self, device: torch.device, nv: torch.Tensor | float | None, scaler_active: bool,
                     dist: tuple[int, int], weights: torch.Tensor | None) -> torch.Tensor:
        """[bad, first non-finite loss, weights], all-reduced (MAX) over the default group: every rank skips
        the step any rank saw (a non-finite loss or gradient, a spike), learns the lowest rank whose own
        loss was non-finite (coded ``world - rank``; 0: none), whose gradients every other rank received
        through the gradient reduction, and whether the last update made any rank's weights non-finite
        (``weights``: this rank's weights flag). Plain tensors on ``device`` (never DTensors: a DTensor
        norm is reduced over its own mesh first)."""
        t_loss, t_norm = self.thresholds()
        rank, world = dist
        bad = loss_bad = weights_bad = torch.zeros((), dtype=torch.bool, device=device)
        if self.losses:
            loss = torch.stack([(t.float() / s if s is not None else t.float()).reshape(()).to(device)
                                for t, s in self.losses]).sum()
            loss_bad = ~torch.isfinite(loss)
            bad = loss_bad | (loss > t_loss)
        if nv is not None:
            norm = nv if isinstance(nv, torch.Tensor) else torch.tensor(float(nv), device=device)
            norm = norm.float().to(device)
            ok = torch.isfinite(norm)
            bad = bad | (ok & (norm > t_norm))
            if not scaler_active:
                bad = bad | ~ok
        if weights is not None:
            weights_bad = ~torch.isfinite(weights.to(device))
        flag = torch.stack([bad.float(), loss_bad.float() * (world - rank), weights_bad.float()])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return flag


class Adapter:
    """What both adapters (``nanprobe.Guard``, the hook-driven guard) show of their core."""

    core: StepCore
    monitor = property(lambda self: self.core.monitor)     # the precursor monitor
    warnings = property(lambda self: self.core.warnings)   # its one early warning


def _f32(x: float) -> float:
    """x rounded to float32 (C's cast: beyond float32's range, inf): a float64 sum of two float32 values is
    exact, so rounding it gives what a float32 add gives (the loss the reruns report is a float32 sum)."""
    return ctypes.c_float(x).value


__all__ = ["StepCore", "Verdict", "Adapter", "check_guard_config", "resolve_config", "current_lr", "total_norm",
           "at_command", "RNG_MODES"]
