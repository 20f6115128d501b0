"""`nanprobe.Guard`: a near-zero-overhead sentinel for the user's own training loop.

On a non-finite loss or gradient, or a loss / gradient-norm spike, the guard skips that
optimizer update (weights and optimizer state untouched), writes a capsule of the step, logs
one line with the exact ``nanprobe run ENTRY --capsule PATH`` command, and training goes on.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import capsule as _capsule
from ..base.config import Config, GuardConfig
from ..base.errors import EXIT_FOUND, NanprobeError, UsageError
from ..base.precision import Precision, parse_precision, weights_precision
from ..base.report import Status
from ..base.sharding import clip_norm, fsdp1_root, total_norm
from ..reach.hooks import unscale_ready
from ..reach.state import capture_rng
from ..reach.target import named
from .core import Adapter, StepCore, Verdict, at_command, check_guard_config, resolve_config

logger = logging.getLogger("nanprobe.guard")

POLICIES = ("skip", "raise", "record")


class _StepContext:
    """``guard.step(...)``'s context: a slotted object, not a generator (it is entered on every step)."""

    __slots__ = ("_guard", "_batch", "_step")

    def __init__(self, guard: Guard, batch: Any, step: int | None):
        self._guard, self._batch, self._step = guard, batch, step

    def __enter__(self) -> int:
        return self._guard._begin(self._batch, self._step)

    def __exit__(self, *exc: Any) -> bool:
        return False


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


class Guard(Adapter):
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
        if not isinstance(config, (type(None), GuardConfig, Config, str, os.PathLike, Mapping)):
            raise UsageError(f"Guard(config=...) got {type(config).__name__}", "nanprobe.Guard",
                             "Pass a nanprobe Config, its .guard section, a YAML path or a dict of guard keys")
        base = Config(guard=config) if isinstance(config, GuardConfig) else resolve_config(
            {"guard": dict(config)} if isinstance(config, Mapping) else config, "Guard(config=...)")
        config = resolve_config(base, "nanprobe.Guard(...)", policy=policy, check_every=check_every,
                                capsule_dir=None if capsule_dir is None else str(capsule_dir))
        check_guard_config(config.guard, "nanprobe.Guard")
        self.model = model
        self.optimizer = optimizer
        self.optimizers = [o for _, o in optimizers]
        self.scaler = scaler
        self.scheduler = scheduler
        self.schedulers = [s for _, s in named(scheduler, "scheduler")]
        self.entry = entry
        self.cfg = config.guard
        self.enabled = bool(enabled)
        self.capsule_dir = Path(self.cfg.capsule_dir).resolve()
        self.events: list[GuardEvent] = []
        self.capsules: list[Path] = []
        self._next = int(start_step)        # number of the next step
        self._current: int | None = None    # number of the step in progress (after guard.step entered)
        self._order: tuple[tuple[int, ...], list[torch.Tensor]] | None = None   # _params' walk, by stepped ids
        self._deferred = False              # inside a closure optimizer's step: it applies the update
        self._needs_closure = next((type(o).__name__ for o in self.optimizers if _needs_closure(o)), None)
        # the step's state and judgement (the precursor monitor: every monitor.live_every steps, from the same
        # config: a YAML file's monitor section too)
        self.core = StepCore(model, config, self.precision, logger)
        if not self.enabled:
            self.core.monitor = None

    # -- the verbs ----------------------------------------------------------------------------------

    @property
    def step_index(self) -> int:
        """The number of the step in progress (or of the next one)."""
        return self._current if self._current is not None else self._next

    def step(self, *args: Any, step: int | None = None) -> contextlib.AbstractContextManager[int]:
        """``with guard.step(batch):`` around forward and backward (``guard.step(step, batch)`` also works).

        Entering notes the RNG state; the batch is kept by reference (not copied), so a loss_fn
        that changes the batch in place makes the capsule hold the changed batch.
        """
        if len(args) > 2:
            raise TypeError(f"Guard.step() takes (batch) or (step, batch), got {len(args)} arguments")
        if len(args) == 2:
            if step is not None:
                raise TypeError("Guard.step() got the step number twice")
            step = args[0]
        return _StepContext(self, args[-1] if args else None, step)

    def _begin(self, batch: Any, step: int | None) -> int:
        if step is not None:
            self._current = int(step)
        elif self._current is None:
            self._current = self._next
        if self.enabled:
            self.core.begin(self._current, batch)
        return self._current

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(scaler.scale(loss) if scaler else loss).backward(**kwargs)``, and notes the loss (no sync)."""
        if self.enabled:
            self.core.note_loss(loss)
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
            self.core.reset()
            self._current = None
            self._next = step + 1

    # -- internals ------------------------------------------------------------------------------------

    def _active_scaler(self) -> torch.amp.GradScaler | None:
        return self.scaler if self.scaler is not None and self.scaler.is_enabled() else None

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

    def _closure_step(self, step: int, closure: Any, max_grad_norm: float | None) -> bool:
        if len(self.optimizers) != 1 or self._active_scaler() is not None:
            raise UsageError("Guard.optimizer_step(closure=...) with several optimizers or a GradScaler",
                             "nanprobe.Guard", "A closure steps one optimizer (GradScaler.step takes no closure)")
        verdict: list[bool] = []

        def guarded():
            with torch.enable_grad():
                loss = closure()
            if not verdict:   # the first evaluation: the step's loss and gradients, before any update
                if self.enabled and not self.core.losses and isinstance(loss, torch.Tensor):
                    self.core.note_loss(loss)
                self._deferred = True   # the optimizer applies (or not) the update it is computing
                try:
                    verdict.append(self._optimizer_step(step, max_grad_norm, None))
                finally:
                    self._deferred = False
            return loss

        self.optimizers[0].step(guarded)
        if verdict and verdict[0] and self.enabled and step % self.cfg.check_every == 0:
            self.core.applied(step, self.optimizers)
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
            for opt in self.optimizers:
                unscale_ready(scaler, opt)   # unless the loop unscaled them itself
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
            self.core.updates.unchecked()   # its update runs unread (guard.check_every)
            return True
        v = self.core.check(step, self.optimizers, norm, scaler)
        if v.update_born is not None:   # an earlier update made the weights non-finite (raises, but under "record")
            self._update_born(*v.update_born, v.rank, v.world)
        if v.status is not Status.FINITE:
            return self._bad(v, scaler, max_grad_norm)
        self.core.passed(v, self.optimizers, scaler)
        self._apply(scaler)   # a GradScaler skip: the scaler skips this update and lowers its scale
        if not v.record.skipped and not self._deferred:   # a closure optimizer updates later: _closure_step queues it
            self.core.applied(step, self.optimizers)
        return not v.record.skipped

    def _update_born(self, step: int, optimizers: list[torch.optim.Optimizer], rank: int, world: int) -> None:
        """The update of step ``step`` made weights non-finite (seen in this check's sync): log it as that
        step's event, naming the parameter, LR and optimizer state; raise unless the policy is record."""
        upd, reason, since = self.core.update_born(step, optimizers, world)
        if since is not None:
            reason = f"{reason} ({since})"
        command = at_command(self.entry, step)
        action = "recorded" if self.cfg.policy == "record" else "raised"
        event = GuardEvent(step=step, status="nonfinite", reason=reason, action=action,
                           local=bool(upd.get("nonfinite_parameters")), capsule=None, command=command, rank=rank)
        self.events.append(event)
        logger.warning("nanprobe.Guard: %sstep %d: %s. Diagnose it: %s", f"rank {rank}: " if rank else "", step,
                       reason, command)
        if action == "raised":
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            raise GuardTripped(event, "the weights are non-finite")

    def _bad(self, v: Verdict, scaler: torch.amp.GradScaler | None, max_grad_norm: float | None) -> bool:
        policy, core, step, r = self.cfg.policy, self.core, v.record.step, v.record
        corrupt = core.caught(v, policy)
        path = note = None
        if not corrupt and not _capsule.no_room(self.capsules, self.cfg.max_capsules):   # before copying RNG states
            micro_rng = [dict(state) for state in core.rng_after] or [capture_rng(core.device_type)]
            if "python" not in micro_rng[0]:   # not copied at step start: the step does not draw from them
                host = capture_rng("cpu", host=True)
                for state in micro_rng:
                    state.update({k: val for k, val in host.items() if k in ("python", "numpy")})
            path, note = core.write_capsule(v, self.capsule_dir, self.capsules, optimizers=self.optimizers,
                                            may_delete=self._own_capsule, schedulers=self.schedulers,
                                            scalers=[scaler] if scaler is not None else [],
                                            micro_batches=core.items or None, rng=micro_rng[0], micro_rng=micro_rng,
                                            precision=self.precision, entry=self.entry, max_grad_norm=max_grad_norm,
                                            grad_scaler=scaler is not None)
        command = _capsule.replay_command(self.entry, path) if path else \
            at_command(self.entry, max(step - 1, 0)) if corrupt else None
        why = core.stop_reason(policy, corrupt)
        if policy == "record":
            self._apply(scaler)
            applied, action = True, "recorded"
        else:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.update(scaler.get_scale())   # keep the scale; reset its per-step state
            applied, action = False, "raised" if why else "skipped"
        event = GuardEvent(step=step, status=v.status.value, reason=v.reason, action=action, local=v.local,
                           capsule=str(path) if path else None, command=command, rank=v.rank,
                           loss=r.loss, grad_norm=r.grad_norm)
        self.events.append(event)
        # StepRecord.skipped means "GradScaler skipped"; a guard skip shows as finite=False / a spike
        core.history.append(r)
        who = f"rank {v.rank}: " if v.world > 1 else ""
        verb = {"skipped": "update skipped", "recorded": "update applied (policy record)",
                "raised": "update skipped, stopping"}[action]
        logger.warning("nanprobe.Guard: %sstep %d %s: %s.%s %s", who, step, verb, v.reason,
                       f" ({note})" if note else "", f"Replay it: {command}" if command else "")
        if action == "raised":
            raise GuardTripped(event, why)
        return applied

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

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The guard's running statistics and counters (for your checkpoint); weights_only-safe."""
        div = self.core.judge.model
        return {"next_step": self._next, "consecutive": self.core.consecutive, "scaler_skips": div.skips,
                "losses": list(div.loss.values), "norms": list(div.norm.values), "divergence": div.state_dict(),
                "history": [_capsule.record_dict(h) for h in self.core.history],
                "capsules": [str(p) for p in self.capsules]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._next = int(state["next_step"])
        self._current = None
        self.core.consecutive = int(state.get("consecutive", 0))
        div = state.get("divergence")
        if div is None:   # a state_dict from before the divergence model: its windows only
            div = {"loss": {"values": state.get("losses", [])}, "norm": {"values": state.get("norms", [])},
                   "skips": state.get("scaler_skips", 0)}
        self.core.judge.model.load_state_dict(div)
        self.core.history.clear()
        self.core.history.extend(_capsule.io.to_record(dict(h)) for h in state.get("history", []))
        self.capsules = []
        for p in state.get("capsules", []):
            if isinstance(p, (str, os.PathLike)) and self._own_capsule(Path(p)):
                self.capsules.append(Path(p).resolve())
            else:
                logger.warning("nanprobe.Guard: ignoring %r from the loaded state: not a capsule this guard wrote "
                               "in %s (it will never be deleted)", p, self.capsule_dir)


def _needs_closure(opt: torch.optim.Optimizer) -> bool:
    """``opt.step`` has a ``closure`` parameter without a default (LBFGS)."""
    try:
        param = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


__all__ = ["Guard", "GuardEvent", "GuardTripped"]
