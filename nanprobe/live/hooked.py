"""HookedGuard: nanprobe.Guard's semantics, driven by the hooks of a loop nanprobe does not run.

The framework (or the user's script) calls forward, backward and ``optimizer.step()``; nanprobe
sees the step through hooks and does what :class:`nanprobe.Guard` does in a user's own loop:

* per micro-batch (:meth:`HookedGuard.micro`): the batch by reference and the RNG state when the
  step reached it (the first one also copies persistent buffers such as BatchNorm statistics);
* per backward (:meth:`HookedGuard.note_loss`): the loss, detached, no sync;
* before the update (:meth:`HookedGuard.check`): the global gradient norm (foreach kernels) and
  the loss read back in ONE device sync (under ``torch.distributed`` the bad flag is all-reduced in
  that same sync, so every rank skips the same step), judged like a replayed step (non-finite
  loss or gradient, loss / gradient-norm spikes, runs of GradScaler skips). A bad step's state
  before it is copied and its capsule written there, and the caller skips the update
  (:func:`skip_update`: gradients set to None make ``optimizer.step()`` change nothing);
* after the framework finished the step (:meth:`HookedGuard.finish`): the bad step is diagnosed
  in-process with the framework's own step as a ``step_fn`` (:func:`nanprobe.pipeline.diagnose.diagnose_target`:
  the instrumented rerun, the precision comparison, verified fixes, the fidelity check); the
  framework's state after its step (scheduler, GradScaler, RNG) is put back afterwards, so
  training goes on exactly as the framework left it, minus the update.

Nothing here prints; the callers log one line per event. Steps nanprobe reruns while diagnosing
do not reach the hooks (``busy``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import math
import os
import shlex
import struct
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import capsule as _capsule
from ..base.batch import clone_batch
from ..base.config import Config, load_config
from ..judge.divergence import Judge
from ..base.errors import UsageError
from ..reach.feed import Position, Recorded
from ..judge.monitor import close_step, live_monitor
from ..base.precision import device_of
from ..reach.replay import Reached, scheduler_info, storage_policy
from ..base.report import Origin, Phase, Report, Status, StepRecord, write_new
from ..reach.state import RngTracker, Snapshot, module_tensor_attrs
from ..reach.step import Loop
from ..reach.target import Target
from .guard import check_guard_config, loss_rank_of, rank_flags, rank_reason
from ..base.sharding import fsdp1_root, full_value, sharded, weights_finite
from ..base.sharding import total_norm as group_norm
from ..judge.updates import UpdateCheck, describe, update_finding, update_forensics
from .events import POLICIES, HookEvent, Stopped, check_policy, current_lr, distributed, grads_of, \
    total_norm


@dataclass(slots=True)
class Pending:
    """A bad step caught by check(), waiting for the framework to finish its step."""

    step: int
    status: Status
    reason: str
    local: bool
    record: StepRecord
    history: list[StepRecord]
    loop: Loop
    before: Snapshot | None           # None: this bad step is not diagnosed in-process (max_reports)
    items: list[Any]
    rng_after: list[dict[str, Any]]
    position: Position | None
    capsule: Path | None
    capsule_note: str | None
    corrupt: bool
    rank: int
    world: int
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)   # added to the JSON report
    compare: StepRecord | None = None   # what the reruns must reproduce, where it differs from ``record``
    undiagnosed: str | None = None      # why this bad step gets no in-process diagnosis (``before`` is None)
    report: Report | None = None        # made without a rerun (weights an applied update made non-finite)


class HookedGuard:
    """The guard's checks, capsule and in-process diagnosis, driven by a framework's hooks.

    ``build_target`` (called on a bad step only) returns the :class:`nanprobe.Target` whose
    ``step_fn`` is the framework's own step, over the live objects.
    """

    def __init__(self, *, command: str, who: str, model: torch.nn.Module, build_target: Callable[[], Target],
                 config: Config | None = None, policy: str = "skip", dirpath: str | os.PathLike = "nanprobe-reports",
                 entry: str | None = None, allowed: Iterable[str] = POLICIES,
                 on_bad: Callable[[Pending], None] | None = None,
                 adjust: Callable[[Report, Pending], Report] | None = None, max_reports: int = 1,
                 events: list[HookEvent] | None = None):
        self.command = command
        self.who = who
        self.cfg = config or load_config()
        self.gcfg = self.cfg.guard
        check_guard_config(self.gcfg, who)
        self.policy = check_policy(policy, allowed, who)
        self.dirpath = Path(dirpath)
        self.entry = entry
        self.model = model
        self.build_target = build_target
        self.on_bad = on_bad              # a bad step was caught (its gradients are still there)
        self.adjust = adjust              # the diagnosis is done: add to the report
        if isinstance(max_reports, bool) or not isinstance(max_reports, int) or max_reports < 0:
            raise UsageError(f"max_reports={max_reports!r}", who, "Give the number of bad steps to diagnose "
                                                                  "in-process (0: none, only capsules)")
        self.max_reports = max_reports    # bad steps diagnosed in-process; later ones get a capsule and a line
        self.reports = 0
        self.logger = logging.getLogger(f"nanprobe.{command}")
        self.judge = Judge(self.gcfg)   # the divergence model of replay and smoke, with the guard: thresholds
        self.device_type = device_of(model).type
        self.rngs = RngTracker(self.device_type, self.gcfg.rng_states)
        self.history: deque[StepRecord] = deque(maxlen=max(self.gcfg.history, 1))
        self.events: list[HookEvent] = events if events is not None else []   # the caller's list, if given
        self.capsules: list[Path] = []
        self.pending: Pending | None = None
        self.busy = False                 # nanprobe is rerunning a step: the hooks stand still
        self.consecutive = 0
        self.checks = 0
        self._world: tuple[int, int] | None = None
        self._items: list[Any] = []
        self._rng_after: list[dict[str, Any]] = []
        self._checked = True              # the step in progress is checked (check_every)
        self._updating: tuple[int, list[torch.optim.Optimizer]] | None = None   # a checked good step's update
        self._update: tuple[int, torch.Tensor, list] | None = None   # its weights flag, read at the next check
        self.updates = UpdateCheck(self.gcfg.check_updates_every)     # which updates' weights were read
        self._update_optimizers: list[torch.optim.Optimizer] = []     # those of the last applied update
        self._losses: list[tuple[torch.Tensor, torch.Tensor | float | None]] = []   # (detached loss, its scale)
        self._attrs: list[tuple[torch.nn.Module, str, str]] | None = None
        self._carried: dict[str, Any] = {}
        self._buffers = [b for m in model.modules() for name, b in m._buffers.items()
                         if b is not None and name not in m._non_persistent_buffers_set]
        self._shadow = [b.detach().clone() for b in self._buffers] if self._buffers else []
        # what the log line says of a bad step the diagnosis did not locate (step -> text; watch offers --at N)
        self.unlocated: Callable[[int], str] | None = None
        # step -> the command that replays it when the capsule's cannot (watch: a loss outside the root
        # module, which a capsule of the root's inputs does not compute), else None
        self.replay: Callable[[int], str | None] | None = None
        self.monitor = live_monitor(model, self.cfg, None)   # the precursor monitor; its one early warning:
        self.warnings: list[dict[str, Any]] = []

    # -- capture --------------------------------------------------------------------------------------

    @property
    def in_step(self) -> bool:
        return bool(self._items)

    def micro(self, batch: Any, step: int) -> None:
        """A micro-batch of step ``step`` is about to run (the first one starts the step)."""
        if self.busy:
            return
        if not self._items:
            if self.monitor is not None:
                self.monitor.begin(step)
            self._checked = step % self.gcfg.check_every == 0
            if self._checked:
                self.rngs.begin_step()
                if self._buffers:
                    torch._foreach_copy_(self._shadow, self._buffers)
                if self._attrs:
                    self._carried = {qual: getattr(m, attr, None) for m, attr, qual in self._attrs}
        if self._checked:
            self._rng_after.append(self.rngs.capture())
        self._items.append(batch)

    def note_loss(self, loss: torch.Tensor, scale: torch.Tensor | float | None = None) -> None:
        """A loss backpropagated in the step (``scale``: the GradScaler's factor it was multiplied by).
        Kept detached; read back with the norm in the check's one sync."""
        if self.busy or not self._checked or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        self._losses.append((loss.detach(), scale))

    def reset(self) -> None:
        """The step is over (checked or not): drop what was captured for it."""
        self._items, self._rng_after, self._losses = [], [], []

    def after_update(self) -> None:
        """The framework applied the update of the last checked good step: on every
        ``guard.check_updates_every``-th, queue the weights flag (:func:`nanprobe.judge.updates.weights_flag`,
        no sync) for the next check's one sync."""
        updating, self._updating = self._updating, None
        if updating is None or self.busy:
            return
        step, optimizers = updating
        self._update_optimizers = optimizers
        flag = self.updates.applied_update(step, optimizers)
        self._update = (step, flag, optimizers) if flag is not None else None

    def final_check(self) -> bool:
        """Training ended: the last checked update's weights flag (one sync). True when that update made
        weights non-finite: it is then the pending bad step (finish it)."""
        update, self._update = self._update, None
        if self.busy:
            return False
        if update is not None:
            if math.isfinite(float(update[1])):
                self.updates.read(update[0], True)
                return False
            step, optimizers = update[0], update[2]
        else:   # the last updates were not read (check_updates_every): read the weights now
            step = self.updates.unread()
            if step is None or weights_finite(self.model):
                return False
            optimizers = self._update_optimizers
        rank, world = self._world or distributed()
        record = StepRecord(step=step, loss=None, grad_norm=None, lr=current_lr(optimizers), update_ratio=None,
                            finite=False)
        return self._update_born(step, record, rank, world, optimizers)

    # -- the check ------------------------------------------------------------------------------------

    def check(self, step: int, optimizers: list[torch.optim.Optimizer], *, norm: torch.Tensor | None = None,
              scaler: torch.amp.GradScaler | None = None, position: Position | None = None,
              max_grad_norm: float | None = None) -> bool:
        """Judge the step before its update (one device sync; a GradScaler skip reads its scale, one
        more, on that step only). ``scaler``: the loop's enabled GradScaler, if any. Returns True when
        the update must be skipped (the caller calls :func:`skip_update`); a bad step is then pending
        until :meth:`finish`. The step's capture ends here (the next :meth:`micro` starts the next step)."""
        if self.busy:
            return False
        if not self._checked:
            self.updates.unchecked()
            self.reset()
            return False
        try:
            return self._check(step, optimizers, norm, scaler, position, max_grad_norm)
        finally:
            if self.monitor is not None:
                self.monitor.abort()
            self.reset()

    def _check(self, step: int, optimizers: list[torch.optim.Optimizer], norm: torch.Tensor | None,
               scaler: torch.amp.GradScaler | None, position: Position | None,
               max_grad_norm: float | None) -> bool:
        scaler_active = scaler is not None
        if self.pending is not None:   # a step whose finish() never came (the framework raised meanwhile)
            if self.pending.before is not None:
                self.pending.before.release()
            self.pending = None
        self.checks += 1
        self.rngs.end_step()
        if self._attrs is None:   # after the first forward: tensors modules keep as attributes
            self._attrs = module_tensor_attrs(self.model)
        if norm is None:   # FSDP1: the shard norms summed over its process group
            norm = group_norm(self.model, grads_of(optimizers)) if fsdp1_root(self.model) is not None \
                else total_norm(grads_of(optimizers))
        norm = full_value(norm)   # FSDP2: the global norm, reduced over the gradients' own mesh
        update, self._update = self._update, None
        if self._world is None or self.checks % 100 == 1:   # is_initialized() costs ~10 us: not every step
            self._world = distributed()
        rank, world = self._world
        loss_v, norm_v, others_bad, loss_rank, weights_bad = self._read(
            self._losses, norm, scaler_active, (rank, world) if world > 1 else None,
            update[1] if update is not None else None)
        lr = current_lr(optimizers)
        skipped = scaler_active and norm_v is not None and not math.isfinite(norm_v)
        # a skip is judged by the trajectory of the loss scale (warm-up back-off or a collapse)
        scale = float(scaler.get_scale()) if skipped else None
        finite = (loss_v is None or math.isfinite(loss_v)) and (norm_v is None or math.isfinite(norm_v) or skipped)
        record = StepRecord(step=step, loss=loss_v, grad_norm=norm_v, lr=lr, update_ratio=None, finite=finite,
                            skipped=skipped, scale=scale, epoch=position.epoch if position else None,
                            index=position.index if position else None)
        status, reason = self.judge.judge(record, params_finite=True)
        local = True
        if status is Status.FINITE and others_bad:
            status, reason, local = Status.NONFINITE, "another rank saw a non-finite value or spike at this step", \
                False
        elif status is not Status.FINITE and loss_rank not in (None, rank) and math.isfinite(loss_v or 0.0):
            # this rank's loss is finite: its non-finite gradients came through the gradient reduction
            reason, local = rank_reason(reason or "bad step", loss_rank), False
        # the flag is the largest L2 norm: finite weights whose squares pass 3.4e38 (a 1e38 sentinel row) read
        # as inf there; the exact check confirms it (rare path, every rank is here: the flag was reduced)
        weights_bad = weights_bad and not weights_finite(self.model)
        if update is not None:
            self.updates.read(update[0], not weights_bad)
        if weights_bad:   # the last checked update made weights non-finite: that step is the bad one
            return self._update_born(update[0], record, rank, world, optimizers)
        unread = self.updates.unread() if status is not Status.FINITE else None
        if unread is not None and not weights_finite(self.model):   # rare path: every rank is here (flags reduced)
            return self._update_born(unread, record, rank, world, self._update_optimizers or optimizers)
        if status is Status.FINITE:
            w = close_step(self.monitor, step, loss=loss_v, grad_norm=norm_v, lr=lr, scaler=scaler,
                           optimizers=optimizers, logger=self.logger)
            if w is not None:
                self.warnings.append(w)
            self.judge.add(record)
            self.history.append(record)
            self.consecutive = 0
            self._updating = (step, optimizers)
            return False
        settings = {"max_grad_norm": max_grad_norm, "grad_scaler": scaler_active}   # for the capsule
        return self._bad(step, status, reason or "bad step", local, record, position, rank, world, settings)

    def _thresholds(self) -> tuple[float, float]:
        """The divergence model's cut-offs for this step (for the on-device flag all ranks reduce): a
        value above them may be a spike, one below never is."""
        return self.judge.model.loss_cut(), self.judge.model.norm_cut()

    def _read(self, losses: list[tuple[torch.Tensor, torch.Tensor | float | None]], norm: torch.Tensor | None,
              scaler_active: bool, dist: tuple[int, int] | None, weights: torch.Tensor | None
              ) -> tuple[float | None, float | None, bool, int | None, bool]:
        """The step's losses (their sum), the norm, the last update's weights flag and, under
        torch.distributed (``(rank, world)``), the all-reduced bad flags (any rank's step, the first rank
        with a non-finite loss, any rank's weights) to the host in one sync: one ``stack`` and one
        ``tolist`` (few ops: each costs microseconds)."""
        parts: list[torch.Tensor] = [t for t, _ in losses]
        scales = [s for _, s in losses if isinstance(s, torch.Tensor)]
        parts += scales
        if norm is not None:
            parts.append(norm.detach())
        if weights is not None and not dist:
            parts.append(weights)
        if not parts:
            if not dist:
                return None, None, False, None, False
            flags = self._reduce_flag([], None, scaler_active, dist, weights).tolist()
            return None, None, bool(flags[0] > 0), loss_rank_of(flags[1], dist[1]), bool(flags[2] > 0)
        device = parts[0].device
        if any(t.dtype != torch.float32 or t.device != device or t.dim() for t in parts):
            parts = [t.float().reshape(()).to(device) for t in parts]
        stacked = torch.stack(parts)
        if dist:
            stacked = torch.cat([stacked, self._reduce_flag(losses, stacked[-1] if norm is not None else None,
                                                            scaler_active, dist, weights)])
        values = stacked.tolist()   # the one device sync
        loss_v = None
        it = iter(values[len(losses):len(losses) + len(scales)])
        for (_, scale), v in zip(losses, values):   # float32 sums as torch adds them, exactly (see _f32)
            if isinstance(scale, torch.Tensor):
                v = _f32(v / next(it))
            elif scale is not None:
                v = _f32(v / scale)
            loss_v = v if loss_v is None else _f32(loss_v + v)
        norm_v = values[len(losses) + len(scales)] if norm is not None else None
        if not dist:
            return loss_v, norm_v, False, None, weights is not None and not math.isfinite(values[-1])
        return loss_v, norm_v, bool(values[-3] > 0), loss_rank_of(values[-2], dist[1]), bool(values[-1] > 0)

    def _reduce_flag(self, losses: list[tuple[torch.Tensor, torch.Tensor | float | None]],
                     nv: torch.Tensor | None, scaler_active: bool, dist: tuple[int, int],
                     weights: torch.Tensor | None) -> torch.Tensor:
        """Bad on this rank (non-finite loss or gradient, a spike) and the first rank with a non-finite
        loss, all-reduced across ranks (:func:`nanprobe.live.guard.rank_flags`): every rank skips the step any
        rank saw."""
        if losses:
            device = losses[0][0].device
        elif nv is not None:
            device = nv.device
        else:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        t_loss, t_norm = self._thresholds()
        lv = None
        if losses:
            lv = torch.stack([(t.float() / s if s is not None else t.float()).reshape(()).to(device)
                              for t, s in losses]).sum()
        return rank_flags(lv, t_loss, None if nv is None else nv.float().to(device), t_norm, scaler_active,
                          device, *dist, weights=None if weights is None else weights.to(device))

    def _update_born(self, step: int, record: StepRecord, rank: int, world: int,
                     optimizers: list[torch.optim.Optimizer]) -> bool:
        """The update of checked step ``step`` made weights non-finite (seen at the next check): that step
        is the bad one. No rerun can start before an applied update: the report is made from the live
        optimizer (parameter, LR, state); the current step's update is skipped and training stops."""
        self.consecutive += 1
        names = {id(q): n for n, q in self.model.named_parameters()}
        upd = update_forensics(optimizers, names)
        rows = upd.get("nonfinite_parameters")
        reason = describe(upd, step) if rows else f"the optimizer update of step {step} made the weights " \
                                                  "non-finite" + (" on another rank" if world > 1 else "")
        record = dataclasses.replace(record, step=step, finite=False)
        report = None
        if rows and self.reports < self.max_reports:
            self.reports += 1
            report = self._update_report(upd, step)
        target = self.build_target()
        self.pending = Pending(step=step, status=Status.NONFINITE, reason=reason, local=bool(rows), record=record,
                               history=list(self.history), loop=Loop(target, self.entry or f"<{self.command}>",
                                                                     target.precision),
                               before=None, items=[], rng_after=[], position=None, capsule=None, capsule_note=None,
                               corrupt=True, rank=rank, world=world, report=report)
        self.history.append(record)
        if self.on_bad is not None:
            self.on_bad(self.pending)
        return True

    def _update_report(self, upd: dict[str, Any], step: int) -> Report:
        first = upd["nonfinite_parameters"][0]
        finding = update_finding(upd, step)
        since = self.updates.since(step)
        if since is not None:
            finding = dataclasses.replace(finding, evidence=(*finding.evidence, since))
        origin = Origin(phase=Phase.UPDATE, module=finding.module, op=None, precision=str(first.get("dtype")),
                        kind=first.get("kind"), parameter=first["parameter"])
        return Report(command=self.command, entry=self.entry or "ENTRY", step=step, status=Status.NONFINITE,
                      device=str(device_of(self.model)), precision=str(first.get("dtype")), origin=origin,
                      findings=(finding,), history=tuple(self.history),
                      reached_by=f"{self.who} in the training process: the weights right after the update of "
                                 f"step {step}",
                      notes=(f"caught in the check of a later step; the state before this "
                             f"update is gone, so it is not rerun in-process: nanprobe run ENTRY --at {step} replays "
                             "the step from your checkpoint or step 0 and reruns the update instrumented",))

    def _bad(self, step: int, status: Status, reason: str, local: bool, record: StepRecord,
             position: Position | None, rank: int, world: int, settings: dict[str, Any]) -> bool:
        self.consecutive += 1
        if self.policy != "record" and self._shadow:
            torch._foreach_copy_(self._buffers, self._shadow)   # BatchNorm statistics as before the step
        corrupt = not weights_finite(self.model)   # rare path: a sync here is fine
        if corrupt:
            local = True
            reason = (f"{reason}, and the weights were already non-finite before this step: the optimizer update "
                      f"of step {max(step - 1, 0)} made them so (skipping cannot undo an applied update)")
        target = self.build_target()
        loop = Loop(target, self.entry or f"<{self.command}>", target.precision)
        loop.objects.storage = storage_policy(self.cfg.replay)
        items = [clone_batch(b) for b in self._items]
        rng_after = list(self._rng_after)
        rng = rng_after[0] if rng_after else self.rngs.capture()
        # a step only another rank saw is finite here: the rank that saw it diagnoses it
        undiagnosed = None
        if sharded(self.model) or fsdp1_root(self.model) is not None:
            undiagnosed = ("not diagnosed in-process: the model is sharded (FSDP), so no rank can rerun its "
                           "step alone; replay the capsule (`nanprobe run` loads its full weights on one process)")
        elif local and self.reports >= self.max_reports:
            undiagnosed = "not diagnosed in-process: max_reports reached; its replay command follows"
        before = self._take_before(loop, rng) if local and undiagnosed is None else None
        if before is not None:
            self.reports += 1
        path = note = None
        if not corrupt:
            try:
                path = self._write_capsule(loop, items, rng, rng_after, step, status, reason, record, position,
                                           rank, world, local, settings)
            except OSError as exc:
                note = f"capsule not written: {exc.strerror or exc}"
        self.pending = Pending(step=step, status=status, reason=reason, local=local, record=record,
                                history=list(self.history), loop=loop, before=before, items=items,
                                rng_after=rng_after, position=position, capsule=path, capsule_note=note,
                                corrupt=corrupt, rank=rank, world=world, undiagnosed=undiagnosed)
        # StepRecord.skipped means "GradScaler skipped"; a guard skip shows as finite=False / a spike
        self.history.append(record)
        if self.on_bad is not None:
            self.on_bad(self.pending)
        return self.policy != "record"

    def _take_before(self, loop: Loop, rng: dict[str, Any]) -> Snapshot:
        """The state before the step: now (no update ran, buffers restored), with the step's start RNG
        and the module attributes as the step found them."""
        now = {qual: getattr(m, attr, None) for m, attr, qual in (self._attrs or ())}
        try:
            for m, attr, qual in self._attrs or ():
                if qual in self._carried:
                    setattr(m, attr, self._carried[qual])
            return loop.objects.take(rng=rng)
        finally:
            for m, attr, qual in self._attrs or ():
                setattr(m, attr, now[qual])

    def _write_capsule(self, loop: Loop, items, rng, rng_after, step, status, reason, record, position, rank,
                       world, local, settings: dict[str, Any]) -> Path | None:
        if _capsule.no_room(self.capsules, self.gcfg.max_capsules):
            return None
        target = loop.target
        carried = _capsule.carried_attrs(self._carried)
        pos = None if position is None else {"epoch": position.epoch, "index": position.index,
                                             "items": list(position.items)}
        data = _capsule.build(model=target.model, optimizers=[o for _, o in target.optimizers],
                              schedulers=[s for _, s in target.schedulers],
                              scalers=[s for _, s in loop.objects.scalers()], micro_batches=items, rng=rng,
                              micro_rng=rng_after, step=step, precision=target.precision, status=status.value,
                              reason=reason, record=_capsule.record_dict(record),
                              history=[_capsule.record_dict(h) for h in self.history], entry=self.entry, rank=rank,
                              world_size=world, local=local, position=pos, carried=carried, form=target.form,
                              **settings)
        path = _capsule.write(data, self.dirpath, model=target.model,
                              optimizers=[o for _, o in target.optimizers])
        self.capsules.append(path)
        _capsule.prune(self.capsules, self.gcfg.max_capsules)
        return path

    # -- after the framework's step: diagnose ---------------------------------------------------------

    def finish(self, extra: Mapping[str, Any] | None = None) -> HookEvent | None:
        """The framework finished the step: diagnose a pending bad step, write its report, say what
        happens next. Returns the event (None for a good step)."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        report: Report | None = None
        error = None
        if p.before is not None or p.report is not None:
            try:
                report = p.report if p.report is not None else self._diagnose(p)
                if self.adjust is not None:
                    report = self.adjust(report, p)
            except Exception as exc:  # noqa: BLE001 - the user's training must not die of nanprobe's diagnosis
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                self.logger.debug("in-process diagnosis failed", exc_info=True)
            finally:
                if p.before is not None:
                    p.before.release()
        why = None
        if p.corrupt:
            why = "the weights are non-finite"
        elif self.policy == "raise":
            why = "policy 'raise'"
        elif self.policy != "record" and self.consecutive >= self.gcfg.max_consecutive_skips:
            why = f"{self.consecutive} bad steps in a row, guard.max_consecutive_skips is " \
                  f"{self.gcfg.max_consecutive_skips}"
        action = "raised" if why else {"skip": "skipped", "stop": "stopped", "record": "recorded"}[self.policy]
        command = (self.replay(p.step) if self.replay is not None else None) or \
            (_capsule.replay_command(self.entry, p.capsule) if p.capsule else
             f"nanprobe run {shlex.quote(self.entry) if self.entry else 'ENTRY'} --at {p.step}" if p.report else None)
        headline = _headline(report, p, self.unlocated)
        path = None
        if report is not None:
            path = self._write_report(report, p, action, command, extra)
        event = HookEvent(step=p.step, status=p.status.value, reason=p.reason, action=action, local=p.local,
                          headline=headline, capsule=str(p.capsule) if p.capsule else None,
                          report=str(path) if path else None, command=command, rank=p.rank, loss=p.record.loss,
                          grad_norm=p.record.grad_norm, diagnosis_error=error, why=why)
        self.events.append(event)
        return event

    def conclude(self, extra: Mapping[str, Any] | None = None) -> HookEvent | None:
        """:meth:`finish`, then the one line logged; under policy ``raise`` :class:`Stopped` is raised
        here (policy ``stop`` is the caller's to carry out: its framework's way of stopping)."""
        event = self.finish(extra)
        if event is None:
            return None
        self.logger.warning(event.line(self.who))
        if event.action == "raised":
            raise Stopped(event, event.why or "")
        return event

    def _diagnose(self, p: Pending) -> Report:
        from ..pipeline.diagnose import diagnose_target
        from ..reach.entry import Loaded

        loop = p.loop
        target = loop.target
        after = loop.objects.take()   # the framework's state after its step (scheduler, scaler, RNG)
        grads = [(q, q.grad) for q in target.model.parameters()]
        self.busy = True
        try:
            how = f"{self.who} in the training process: the live state before step {p.step}"
            reached = Reached(step=p.step, recorded=Recorded(step=p.step, items=p.items, rng_after=p.rng_after,
                                                             position=p.position),
                              snapshot=p.before, loop=loop, precision=loop.precision, status=p.status,
                              reason=p.reason, record=p.compare or p.record, history=p.history, reached_by=how,
                              compiled=_capsule.compiled_graphs() > 0,
                              trend=self.monitor.trend if self.monitor is not None else None,
                              **scheduler_info(target))
            loaded = Loaded(target=target, entry=self.entry or "ENTRY", module="", function="",
                            path=None, lineno=None)
            return diagnose_target(loaded, reached=reached, config=self.cfg, command=self.command)
        finally:
            after.restore(loop.objects)
            for q, grad in grads:
                q.grad = grad
            after.release()
            self.busy = False

    def _write_report(self, report: Report, p: Pending, action: str, command: str | None,
                      extra: Mapping[str, Any] | None) -> Path | None:
        data = report.to_json()
        data.update(p.extra)
        data[self.command] = {"action": action, "policy": self.policy, "reason": p.reason, "local": p.local,
                              "rank": p.rank, "world_size": p.world,
                              "capsule": str(p.capsule) if p.capsule else None, "replay": command,
                              **({"capsule_note": p.capsule_note} if p.capsule_note else {}), **dict(extra or {})}
        stem = _capsule.report_stem(p.capsule, p.rank) if p.capsule else \
            f"step{p.step:07d}-rank{p.rank}-{_dt.datetime.now().strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        return write_new(self.dirpath, stem, data)


def _f32(x: float) -> float:
    """x rounded to float32: a float64 sum of two float32 values is exact, so rounding it gives what a
    float32 add gives (the loss the reruns report is a float32 sum of the same values)."""
    if not math.isfinite(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:   # beyond float32's range: a float32 add gives inf
        return math.copysign(math.inf, x)


def _headline(report: Report | None, p: Pending, unlocated: Callable[[int], str] | None = None) -> str:
    from ..pipeline.smoke import headline

    if report is None:
        if p.undiagnosed is None or not p.local:
            return f"step {p.step}: {p.reason}"
        return f"step {p.step}: {p.reason} ({p.undiagnosed})"
    text = headline(report)
    if report.status is Status.FINITE:   # the diagnosis found nothing: say what the check saw
        text = f"step {p.step}: {p.reason} (the in-process rerun was finite)"
    elif report.origin is None and report.top is None:   # nothing located or classified: what the check saw
        hint = unlocated(p.step) if unlocated is not None else "not located in-process: replay the capsule"
        text = f"step {p.step}: {p.reason} ({hint})"
    return text



__all__ = ["HookedGuard", "Pending"]
