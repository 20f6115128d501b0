"""HookedGuard: nanprobe.Guard's semantics, driven by the hooks of a loop nanprobe does not run.

The framework (or the user's script) calls forward, backward and ``optimizer.step()``; nanprobe sees the
step through hooks and feeds them to the step core (:mod:`nanprobe.live.core`): :meth:`HookedGuard.micro`
per micro-batch, :meth:`HookedGuard.note_loss` per backward, :meth:`HookedGuard.check` before the update.
A bad step's state before it is copied and its capsule written there, and the caller skips the update
(:func:`skip_update`: gradients set to None make ``optimizer.step()`` change nothing). After the framework
finished the step (:meth:`HookedGuard.conclude`) the bad step is diagnosed in-process with the framework's
own step as a ``step_fn`` (:func:`nanprobe.pipeline.diagnose.diagnose_target`: the instrumented rerun, the
precision comparison, verified fixes, the fidelity check); the framework's state after its step
(scheduler, GradScaler, RNG) is put back afterwards, so training goes on exactly as the framework left
it, minus the update.

Nothing here prints; the callers log one line per event. Steps nanprobe reruns while diagnosing
do not reach the hooks (``busy``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .. import capsule as _capsule
from ..base.batch import clone_batch
from ..base.config import Config, load_config
from ..base.errors import UsageError
from ..base.precision import device_of
from ..base.report import Origin, Phase, Report, Status, StepRecord, write_new
from ..base.sharding import fsdp1_root, sharded, total_norm
from ..judge.updates import update_finding
from ..reach.feed import Position, Recorded
from ..reach.replay import Reached, scheduler_info, storage_policy
from ..reach.state import Snapshot
from ..reach.step import Loop
from ..reach.target import Target
from .core import Adapter, StepCore, Verdict, at_command, check_guard_config, current_lr
from .events import POLICIES, HookEvent, Stopped, check_policy


@dataclasses.dataclass(slots=True, kw_only=True)
class Pending(Verdict):
    """The verdict on a bad step caught by check(), waiting for the framework to finish its step."""

    history: list[StepRecord]
    loop: Loop | None                 # None: weights an applied update made non-finite (never rerun)
    corrupt: bool
    before: Snapshot | None = None    # None: this bad step is not diagnosed in-process (max_reports)
    recorded: Recorded | None = None  # its micro-batches, the RNG after each, its place in the epoch
    capsule: Path | None = None
    capsule_note: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)   # added to the JSON report
    compare: StepRecord | None = None   # what the reruns must reproduce, where it differs from ``record``
    undiagnosed: str | None = None      # why this bad step gets no in-process diagnosis (``before`` is None)
    report: Report | None = None        # made without a rerun (weights an applied update made non-finite)
    step = property(lambda self: self.record.step)


class HookedGuard(Adapter):
    """The guard's checks, capsule and in-process diagnosis, driven by a framework's hooks.

    ``build_target`` (called on a bad step only) returns the :class:`nanprobe.Target` whose
    ``step_fn`` is the framework's own step, over the live objects.
    """

    def __init__(self, *, command: str, who: str, model: torch.nn.Module, build_target: Callable[[], Target],
                 config: Config | None = None, policy: str = "skip", dirpath: str | os.PathLike = "nanprobe-reports",
                 entry: str | None = None, allowed: tuple[str, ...] = POLICIES,
                 on_bad: Callable[[Pending], None] | None = None,
                 adjust: Callable[[Report, Pending], Report] | None = None, max_reports: int = 1,
                 events: list[HookEvent] | None = None):
        self.command = command
        self.who = who
        self.cfg = config or load_config()
        check_guard_config(self.cfg.guard, who)
        self.policy = check_policy(policy, allowed, who)
        self.dirpath = Path(dirpath)
        self.entry = entry
        self.model = model
        self.build_target = build_target
        self.on_bad = on_bad or (lambda p: None)          # a bad step was caught (its gradients are still there)
        self.adjust = adjust or (lambda report, p: report)   # the diagnosis is done: add to the report
        if isinstance(max_reports, bool) or not isinstance(max_reports, int) or max_reports < 0:
            raise UsageError(f"max_reports={max_reports!r}", who, "Give the number of bad steps to diagnose "
                                                                  "in-process (0: none, only capsules)")
        self.max_reports = max_reports    # bad steps diagnosed in-process; later ones get a capsule and a line
        self.reports = 0
        self.logger = logging.getLogger(f"nanprobe.{command}")
        self.core = StepCore(model, self.cfg, None, self.logger, slow=True)   # the step's state and its judgement
        self.events: list[HookEvent] = events if events is not None else []   # the caller's list, if given
        self.capsules: list[Path] = []
        self.pending: Pending | None = None
        self.busy = False                 # nanprobe is rerunning a step: the hooks stand still
        self.can_skip = True              # False: the update is the script's own code (no optimizer): seen, not skipped
        self._updating: tuple[int, list[torch.optim.Optimizer]] | None = None   # a checked good step's update
        # what the log line says of a bad step the diagnosis did not locate (step -> text; watch offers --at N)
        self.unlocated: Callable[[int], str | None] | None = None
        # step -> the command that replays it when the capsule's cannot (watch: a loss outside the root
        # module, which a capsule of the root's inputs does not compute), else None
        self.replay: Callable[[int], str | None] | None = None

    # -- capture --------------------------------------------------------------------------------------

    history = property(lambda self: self.core.history)
    checks = property(lambda self: self.core.checks)
    in_step = property(lambda self: bool(self.core.items))   # a step's capture is under way

    def micro(self, batch: Any, step: int) -> None:
        """A micro-batch of step ``step`` is about to run (the first one starts the step)."""
        if not self.busy:
            self.core.begin(step, batch)

    def note_loss(self, loss: torch.Tensor, scale: torch.Tensor | float | None = None) -> None:
        """A loss backpropagated in the step (``scale``: the GradScaler's factor it was multiplied by)."""
        if not self.busy:
            self.core.note_loss(loss, scale)

    def after_update(self) -> None:
        """The framework applied the update of the last checked good step: its weights flag is queued for
        the next check's one sync (every ``guard.check_updates_every``-th)."""
        updating, self._updating = self._updating, None
        if updating is not None and not self.busy:
            self.core.applied(*updating)

    def final_check(self) -> bool:
        """Training ended: the last checked update's weights flag (one sync). True when that update made
        weights non-finite: it is then the pending bad step (conclude it)."""
        if self.busy:
            self.core._update = None
            return False
        born = self.core.final_update()
        if born is None:
            return False
        record = StepRecord(step=born[0], loss=None, grad_norm=None, lr=current_lr(born[1]), update_ratio=None,
                            finite=False)
        return self._update_born(born[0], record, *self.core.world(), born[1])

    # -- the check ------------------------------------------------------------------------------------

    def check(self, step: int, optimizers: list[torch.optim.Optimizer], *, norm: torch.Tensor | None = None,
              scaler: torch.amp.GradScaler | None = None, position: Position | None = None,
              max_grad_norm: float | None = None) -> bool:
        """Judge the step before its update (:meth:`StepCore.check`). ``scaler``: the loop's enabled
        GradScaler, if any. Returns True when the update must be skipped (the caller calls
        :func:`skip_update`); a bad step is then pending until :meth:`conclude`. The step's capture ends here
        (the next :meth:`micro` starts the next step)."""
        if self.busy:
            return False
        core = self.core
        if not core.checked:
            core.updates.unchecked()   # its update runs unread (guard.check_every)
            core.reset()
            return False
        try:
            # a step whose conclude() never came (the framework raised meanwhile)
            if self.pending is not None and self.pending.before is not None:
                self.pending.before.release()
            self.pending = None
            if norm is None:   # FSDP1: the shard norms summed over its process group
                norm = total_norm(self.model, [p.grad for opt in optimizers for group in opt.param_groups
                                               for p in group["params"] if p.grad is not None])
            v = core.check(step, optimizers, norm, scaler, position)
            if v.update_born is not None:
                return self._update_born(v.update_born[0], v.record, v.rank, v.world, v.update_born[1])
            if v.status in (Status.FINITE, Status.DIVERGING):
                core.passed(v, optimizers, scaler)
                self._updating = (step, optimizers)
                # a slow divergence: the loss broke away with a precursor behind it; diagnosed after the
                # framework's step (trajectory, mechanism), nothing skipped, no capsule (the step is finite)
                if v.status is Status.DIVERGING:
                    self._pend(v, position, None, corrupt=False)
                return False
            corrupt = core.caught(v, self.policy if self.can_skip else "record")   # nothing skipped: buffers kept
            self._pend(v, position, {"max_grad_norm": max_grad_norm, "grad_scaler": scaler is not None},
                       corrupt=corrupt)
            # StepRecord.skipped means "GradScaler skipped"; a guard skip shows as finite=False / a spike
            core.history.append(v.record)
            self.on_bad(self.pending)
            return self.policy != "record" and self.can_skip
        finally:
            core.reset()

    def _update_born(self, step: int, record: StepRecord, rank: int, world: int,
                     optimizers: list[torch.optim.Optimizer]) -> bool:
        """The update of checked step ``step`` made weights non-finite (seen at the next check): that step
        is the bad one. No rerun can start before an applied update: the report is made from the live
        optimizer (parameter, LR, state); the current step's update is skipped and training stops."""
        upd, reason, since = self.core.update_born(step, optimizers, world)
        rows = upd.get("nonfinite_parameters")
        record = dataclasses.replace(record, step=step, finite=False)
        report = None
        if rows and self.reports < self.max_reports:
            self.reports += 1
            report = self._update_report(upd, step, since)
        self.pending = Pending(status=Status.NONFINITE, reason=reason, local=bool(rows), record=record,
                               history=list(self.history), loop=None, corrupt=True, rank=rank, world=world,
                               report=report)
        self.history.append(record)
        self.on_bad(self.pending)
        return True

    def _update_report(self, upd: dict[str, Any], step: int, since: str | None) -> Report:
        first = upd["nonfinite_parameters"][0]
        finding = update_finding(upd, step)
        if since is not None:
            finding = dataclasses.replace(finding, evidence=(*finding.evidence, since))
        origin = Origin(phase=Phase.UPDATE, module=finding.module, op=None, precision=str(first.get("dtype")),
                        kind=first.get("kind"), parameter=first["parameter"])
        return Report(command=self.command, entry=self.entry or "ENTRY", step=step, status=Status.NONFINITE,
                      device=str(device_of(self.model)), precision=str(first.get("dtype")), origin=origin,
                      findings=(finding,), history=tuple(self.core.history),
                      reached_by=f"{self.who} in the training process: the weights right after the update of "
                                 f"step {step}",
                      notes=(f"caught in the check of a later step; the state before this "
                             f"update is gone, so it is not rerun in-process: nanprobe run ENTRY --at {step} replays "
                             "the step from your checkpoint or step 0 and reruns the update instrumented",))

    def _pend(self, v: Verdict, position: Position | None, settings: dict[str, Any] | None, *, corrupt: bool) -> None:
        """The step waits for the framework to finish it: its batches, RNG and the state before it (for the
        in-process diagnosis), and its capsule (``settings``; None: none, the step is finite)."""
        core = self.core
        target = self.build_target()
        loop = Loop(target, self.entry or f"<{self.command}>", target.precision)
        loop.objects.storage = storage_policy(self.cfg.replay)
        items = [clone_batch(b) for b in core.items]
        rng_after = list(core.rng_after)
        rng = rng_after[0] if rng_after else core.rngs.capture()
        # a step only another rank saw is finite here: the rank that saw it diagnoses it
        undiagnosed = None
        if sharded(self.model) or fsdp1_root(self.model) is not None:
            undiagnosed = ("not diagnosed in-process: the model is sharded (FSDP), so no rank can rerun its "
                           "step alone; replay the capsule (`nanprobe run` loads its full weights on one process)")
        elif v.local and self.reports >= self.max_reports:
            undiagnosed = "not diagnosed in-process: max_reports reached; its replay command follows"
        before = core.at_start(lambda: loop.objects.take(rng=rng)) if v.local and undiagnosed is None else None
        if before is not None:
            self.reports += 1
        path = note = None
        if settings is not None and not corrupt:
            pos = None if position is None else {"epoch": position.epoch, "index": position.index,
                                                 "items": list(position.items)}
            path, note = core.write_capsule(v, self.dirpath, self.capsules,
                                            optimizers=[o for _, o in target.optimizers],
                                            schedulers=[s for _, s in target.schedulers],
                                            scalers=[s for _, s in loop.objects.scalers()], micro_batches=items,
                                            rng=rng, micro_rng=rng_after, precision=target.precision,
                                            entry=self.entry, position=pos, form=target.form, **settings)
        default = "slow divergence" if settings is None else "bad step"
        self.pending = Pending(status=v.status, reason=v.reason or default, local=v.local,
                               record=v.record, history=list(core.history), loop=loop, before=before,
                               recorded=Recorded(step=v.record.step, items=items, rng_after=rng_after,
                                                 position=position), capsule=path, capsule_note=note,
                               corrupt=corrupt, rank=v.rank, world=v.world, undiagnosed=undiagnosed)

    # -- after the framework's step: diagnose ---------------------------------------------------------

    def conclude(self, extra: Mapping[str, Any] | None = None) -> HookEvent | None:
        """The framework finished the step: diagnose a pending bad step, write its report, log the one line
        and return the event (None for a good step). Under policy ``raise`` :class:`Stopped` is raised here
        (policy ``stop`` is the caller's to carry out: its framework's way of stopping)."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        report: Report | None = None
        error = None
        if p.before is not None or p.report is not None:
            try:
                report = self.adjust(p.report if p.report is not None else self._diagnose(p), p)
            except Exception as exc:  # noqa: BLE001 - the user's training must not die of nanprobe's diagnosis
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                self.logger.debug("in-process diagnosis failed", exc_info=True)
            finally:
                if p.before is not None:
                    p.before.release()
        diverging = p.status is Status.DIVERGING
        why = None if diverging else self.core.stop_reason(self.policy, p.corrupt)
        action = "reported" if diverging else "raised" if why else "seen" if not self.can_skip else \
            {"skip": "skipped", "stop": "stopped", "record": "recorded"}[self.policy]
        command = (self.replay(p.step) if self.replay is not None else None) or (_capsule.replay_command(
            self.entry, p.capsule) if p.capsule else at_command(self.entry, p.step) if p.report else None)
        headline = _headline(report, p, self.unlocated)
        path = self._write_report(report, p, action, command, extra) if report is not None else None
        event = HookEvent(step=p.step, status=p.status.value, reason=p.reason, action=action, local=p.local,
                          headline=headline, capsule=str(p.capsule) if p.capsule else None,
                          report=str(path) if path else None, command=command, rank=p.rank, loss=p.record.loss,
                          grad_norm=p.record.grad_norm, diagnosis_error=error, why=why,
                          skipped=self.can_skip)
        self.events.append(event)
        self.logger.warning(event.line(self.who))
        if action == "raised":
            raise Stopped(event, why)
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
            reached = Reached(step=p.step, recorded=p.recorded, snapshot=p.before, loop=loop, precision=loop.precision,
                              status=p.status, reason=p.reason, record=p.compare or p.record, history=p.history,
                              reached_by=how, compiled=_capsule.compiled_graphs() > 0,
                              trend=self.core.monitor.trend if self.core.monitor is not None else None,
                              breakaway=self.core.judge.breakaway if p.status is Status.DIVERGING else None,
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


def _headline(report: Report | None, p: Pending, unlocated: Callable[[int], str | None] | None = None) -> str:
    from ..pipeline.smoke import headline

    if report is None:
        why = f" ({p.undiagnosed})" if p.undiagnosed is not None and p.local else ""
        return f"step {p.step}: {p.reason}{why}"
    if report.status is Status.FINITE:   # the diagnosis found nothing: say what the check saw
        return f"step {p.step}: {p.reason} (the in-process rerun was finite)"
    if report.origin is None and report.top is None:   # nothing located or classified: what the check saw
        hint = (unlocated(p.step) if unlocated is not None else None) or "not located in-process: replay the capsule"
        return f"step {p.step}: {p.reason} ({hint})"
    return headline(report)



__all__ = ["HookedGuard", "Pending"]
