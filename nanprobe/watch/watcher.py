"""The Watcher: global hooks and scoped patches that guard a script's training (see nanprobe.watch)."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..base.config import Config
from ..base.precision import Precision
from ..reach.feed import Position
from ..capsule import unwrap
from ..live.guard import POLICIES   # the guard's policies: a script has no "stop"
from ..live import HookedGuard, HookEvent, skip_update, total_norm
from ..live.core import distributed
from ..live.hooked import Pending
from ..base.report import Cause, Phase, Report, Status
from ..base.sharding import local_value
from ..reach.state import capture_rng
from ..reach.hooks import Patch, ScriptHooks, unscale_ready
from ..reach.target import Target, validate
from ..judge.updates import update_finding, update_forensics
from .record import at_command, record_json, write_run_record
from ..reach.forward import (ForwardStep, autocast_dtype, batch_of, device_of_module, find_loss,
                             loss_outside_finding, ops_between, output_tensors, params_module)


def forward_target(model: torch.nn.Module, opt: torch.optim.Optimizer | None, autocast: str | None, device: str,
                   who: str, schedulers: Any = (), **more: Any) -> tuple[Target, Precision]:
    """The root module's forward as the Target the diagnosis reruns (``watch`` and ``watch --at``): its optimizer
    and schedulers when the optimizer updates only the module's own parameters, and the precision of its
    autocast dtype."""
    own = {id(q) for q in model.parameters()}
    use_opt = opt is not None and all(id(q) in own for g in opt.param_groups for q in g["params"])
    scheds = [s for s in list(schedulers) if use_opt and getattr(s, "optimizer", None) is opt]
    precision = {"bfloat16": Precision.BF16, "float16": Precision.FP16}.get(autocast, Precision.FP32)
    return validate({"model": model, "step_fn": ForwardStep(device), "batches": [],
                     "optimizer": opt if use_opt else None, "scheduler": scheds or None, "precision": precision,
                     **more}, who), precision


def _made(note: Any, original: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """A class's ``__init__`` (``original``), then ``note(obj)``: the objects of a class the script makes."""
    original(obj, *args, **kwargs)
    note(obj)


class _RootHook:
    """A hook the root module carries: it calls the watcher (held weakly) for the root itself only.

    The user's model holds it, so it must never stop them copying or saving the model: a deep copy
    (a best-model snapshot, an EMA or ``AveragedModel`` copy) or a pickle (``torch.save(model)``) of it
    is an inert ``functools.partial(sys.audit, ...)`` (a no-op without audit hooks), which needs
    neither nanprobe nor the watcher to load.
    """

    __slots__ = ("_watcher", "_method", "_root")

    def __init__(self, watcher: Watcher, method: str):
        self._watcher = weakref.ref(watcher)
        self._method = method
        self._root = weakref.ref(watcher.root)

    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        watcher = self._watcher()
        if watcher is not None and module is self._root():
            getattr(watcher, self._method)(module, *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return functools.partial, (sys.audit, "nanprobe.watch.inert_hook")


class Watcher(ScriptHooks):
    """Global hooks and scoped patches that guard the script's training (see the module docstring)."""

    def __init__(self, *, config: Config, policy: str, dirpath: str | os.PathLike, entry: str | None,
                 max_reports: int = 1, argv: Sequence[str] | None = None, start: dict[str, Any] | None = None):
        super().__init__()
        self._guard_options = {"config": config, "policy": policy, "max_reports": max_reports}
        self.argv = list(argv) if argv is not None else None   # the watched command (python train.py ARGS)
        self.start = start                        # the script's start RNG states (written with the first report)
        self._run_path = None                     # its record for `watch --at` (nanprobe.watch.at)
        self._skipped_written = 0                 # updates skipped already written to it
        self.skipped: list[int] = []              # steps whose update the guard skipped (watch --at repeats it)
        self.dirpath = dirpath
        self.entry = entry
        self.guard: HookedGuard | None = None
        self.root: torch.nn.Module | None = None
        self.steps = 0
        self.events: list[HookEvent] = []
        self.notes: list[str] = []
        self.schedulers: weakref.WeakSet = weakref.WeakSet()
        self._module_hooks: list[Any] = []        # global, first step only
        self._depth = 0
        self._first: list[list[Any]] = []   # step 0's top-level calls: [module, args, kwargs, autocast, rng, loss]
        self._early_losses: list[torch.Tensor] = []   # backpropagated before the guard existed (step 0)
        self._losses: list[torch.Tensor] = []     # the root output's loss per call in the step
        self._loss_missing = False
        self._bad_losses: tuple[list[torch.Tensor], bool] = ([], True)   # the same, of the pending bad step
        self._checked = False                     # this step was checked already (in GradScaler.step)
        self._in_closure = False                  # a closure optimizer's step, after its checked evaluation
        self._output_nodes: list[Any] = []        # grad_fn of the root's outputs in this step
        self._loss_nodes: list[Any] = []          # grad_fn of each loss backpropagated in this step
        self.handwritten = False                  # no optimizer: each backward is a step, checked after it
        self._optimizers_made = 0                 # torch.optim optimizers the script created
        self._backwards = 0                       # backward passes before any optimizer stepped
        self._w_prev: torch.Tensor | None = None  # a sample of the weights at the last backward (hand-written)
        self._writers: weakref.WeakSet | None = None   # the script's TensorBoard SummaryWriters (once it uses one)
        self._unseen: dict[str, tuple[str, str]] = {}    # what watch could not see: (short, full) by kind
        self._device_type = "cpu"

    # -- install / remove (again after an exit: the root module found before keeps its hooks) --
    def __exit__(self, *exc: Any) -> None:
        super().__exit__()
        self._writers = None   # its patch is undone: found again if the hooks come back

    def extra_patches(self) -> list[Patch]:
        from torch.optim.lr_scheduler import LRScheduler
        if self.guard is None:   # every module's calls, until the root is found (uninstall removes them too)
            mm = torch.nn.modules.module
            self._module_hooks = [mm.register_module_forward_pre_hook(self._any_pre),
                                  mm.register_module_forward_hook(self._any_post, always_call=True)]
            self._hooks.extend(self._module_hooks)
        elif self.root is not None:
            self._hook_root(self.root)
        return [Patch.around(LRScheduler, "__init__", functools.partial(_made, self.schedulers.add)),
                Patch.around(torch.optim.Optimizer, "__init__", functools.partial(_made, self._optimizer_made))]

    def _optimizer_made(self, opt: torch.optim.Optimizer) -> None:
        self._optimizers_made += 1

    def active(self) -> bool:
        return self.guard is None or not self.guard.busy

    # -- finding the root module in the first step --
    def _any_pre(self, module: torch.nn.Module, args: tuple) -> None:
        if self.root is not None:
            return
        if self._depth == 0 and torch.is_grad_enabled():
            rng = capture_rng(device_of_module(module), host=False)
            self._first.append([module, args, {}, autocast_dtype(module), rng, None])
        self._depth += 1

    def _any_post(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        if self.root is not None:
            return
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0 and self._first and self._first[-1][0] is module:
            self._first[-1][5] = find_loss(out)

    def _first_calls(self) -> list[list[Any]]:
        """Step 0's top-level calls, taken once the root is chosen: from then on only the root has hooks (the
        global ones cost a Python call per module call)."""
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        first, self._first = self._first, []
        return first

    def _adopt(self, root: torch.nn.Module) -> None:
        self.root = root
        self._device_type = device_of_module(root)
        self._hook_root(root)
        self._make_guard(unwrap(root))

    def _pick_root(self, opt: torch.optim.Optimizer) -> None:
        first = self._first_calls()
        params = {id(p) for g in opt.param_groups for p in g["params"]}
        modules = list(dict.fromkeys(call[0] for call in first))
        best = next((m for m in modules if params <= {id(p) for p in m.parameters()}), None)
        if best is None and modules:   # no single call holds all the optimizer's parameters
            best = max(modules, key=lambda m: len(params & {id(p) for p in m.parameters()}))
            self.notes.append("no module called in the first step holds all of the optimizer's parameters; "
                              f"the root is {type(best).__name__}")
        if best is None:
            self.notes.append("no module was called with gradients enabled before the first optimizer step: "
                              "no inputs to rerun")
            self._make_guard(params_module(opt))
            return
        self._adopt(best)
        for module, args, kwargs, autocast, rng, loss in first:
            if module is best:
                self._note_call(args, kwargs, autocast)
                rngs = self.guard.core.rng_after
                if rngs:   # the RNG as it was at that call, not now
                    rngs[-1] = dict(rngs[-1], **rng)
                self._note_out(loss)

    def _hook_root(self, root: torch.nn.Module) -> None:
        self._hooks.append(root.register_forward_pre_hook(_RootHook(self, "_root_pre"), with_kwargs=True))
        self._hooks.append(root.register_forward_hook(_RootHook(self, "_root_post")))

    def _make_guard(self, model: torch.nn.Module) -> None:
        self.guard = HookedGuard(command="watch", who="nanprobe watch", model=model, build_target=self._target,
                                 dirpath=self.dirpath, entry=self.entry, **self._guard_options, allowed=POLICIES,
                                 on_bad=self._on_bad, adjust=self._adjust, events=self.events)
        # --at arms at the root module's forward; a functional model (no root) at the end of the step before,
        # which step 0 has not
        armable = lambda step: self.root is not None or step > 0   # noqa: E731
        self.guard.unlocated = lambda step: f"not located in-process: {self.at_command(step)} explains it" \
            if armable(step) else None
        # re-executing the script replays the step without an entrypoint (`nanprobe run ENTRY --capsule` needs
        # one), and also where the loss is computed outside the root module, which its capsule (the root's
        # inputs) cannot compute (one process: --at does not re-execute a distributed job's ranks)
        self.guard.replay = lambda step: self.at_command(step) if (self._loss_missing or self.entry is None) \
            and distributed()[1] <= 1 and armable(step) else None
        for loss in self._early_losses:
            self.guard.note_loss(loss)
        self._early_losses = []
        self.guard.core.curves = self._log_curves

    # -- the precursor curves, to the script's own TensorBoard writers --
    def _log_curves(self, step: int, values: dict[str, float]) -> None:
        """The precursor series as scalars in every open ``SummaryWriter`` the script made (none: nothing)."""
        module = sys.modules.get("torch.utils.tensorboard.writer")
        if module is None:   # the script does not use TensorBoard
            return
        if self._writers is None:   # the first monitored step after it was imported: its writers, then new ones
            import gc
            cls = module.SummaryWriter
            self._writers = weakref.WeakSet(o for o in gc.get_objects() if issubclass(type(o), cls))
            self._patches.append(Patch.around(cls, "__init__", functools.partial(_made, self._writers.add)))
        for writer in list(self._writers):
            if getattr(writer, "file_writer", None) is not None:   # closed: add_scalar would open it again
                for key, value in values.items():
                    writer.add_scalar(key, value, step)

    # -- the root's calls --
    def _root_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.active() and not self._in_closure and torch.is_grad_enabled():
            device = self._device_type
            dtype = str(torch.get_autocast_dtype(device))[6:] if torch.is_autocast_enabled(device) else None
            self._note_call(args, kwargs, dtype)

    def _root_post(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        if self.active() and not self._in_closure and torch.is_grad_enabled():
            self._note_out(find_loss(out))
            # the outputs' autograd nodes (not the tensors: a step's logits must not outlive the script's use)
            self._output_nodes.extend(t.grad_fn for t in output_tensors(out) if t.grad_fn is not None)

    def _note_call(self, args: tuple, kwargs: dict, autocast: str | None) -> None:
        g = self.guard
        if not g.in_step:
            self._losses, self._loss_missing = [], False
        g.micro(batch_of(args, kwargs, autocast), self.steps)

    def _note_out(self, loss: torch.Tensor | None) -> None:
        if loss is None:
            self._loss_missing = True
        else:
            self._losses.append(loss.detach())

    # -- losses --
    def on_loss(self, t: torch.Tensor) -> None:
        if self._in_closure:
            return
        if t.grad_fn is not None:
            self._loss_nodes.append(t.grad_fn)   # its graph, for a bad step's loss outside the model
        if self.guard is not None:
            self.guard.note_loss(t)
        elif self.root is None:
            self._early_losses.append(t.detach())

    def on_clip(self, norm: torch.Tensor, max_norm: Any) -> None:
        s = self.scaler_seen
        if s is not None and s.is_enabled() and not any(
                getattr(st.get("stage"), "name", "") == "UNSCALED" for st in s._per_optimizer_states.values()):
            self._unseen["scaled_clip"] = (
                "clip_grad_norm_ ran on gradients still scaled by the GradScaler",
                "clip_grad_norm_ ran on gradients still scaled by the GradScaler: its norm, and the clipping, are off "
                "by the loss scale; call scaler.unscale_(optimizer) before clipping. watch judged the unscaled "
                "gradient norm instead")
            return   # that norm is not the gradients': the check computes its own
        self.clip = (norm, float(max_norm))

    def unseen(self) -> list[tuple[str, str]]:
        """What part of the steps watch could not see, and how to cover it: (short, full) lines."""
        return list(self._unseen.values())

    def before_scaler_step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        unscale_ready(scaler, optimizer)
        self._check(optimizer)
        self._checked = True

    # -- an update written by hand (no optimizer): each backward is a step, checked when it returns --
    def after_backward(self) -> None:
        if self.optimizer is not None or self._in_closure:
            return
        self._backwards += 1
        if not self.handwritten:
            # a second backward and still no optimizer made at all: the script updates the weights itself
            if self._backwards < 2 or self._optimizers_made or self.guard is not None or not self._first:
                return
            self._start_handwritten()
        g = self._begin_check()
        norm = total_norm([q.grad for q in g.model.parameters() if q.grad is not None])
        self._note_update(g)
        self._guard_check([], norm)   # nothing can be skipped: seen and reported
        self.steps += 1
        if g.pending is not None:
            self._finish()

    def _begin_check(self) -> HookedGuard:
        """The guard, with the step's capture begun (no root call was captured in it: no inputs)."""
        g = self.guard
        if not g.in_step:
            self._losses, self._loss_missing = [], True
            g.micro(None, self.steps)
        return g

    def _guard_check(self, opts: list[torch.optim.Optimizer], norm: torch.Tensor | None,
                     max_norm: float | None = None) -> bool:
        """The guard's check of this step; a bad one keeps the losses backpropagated in it."""
        g = self.guard
        position = Position(step=self.steps, epoch=None, index=self.steps, items=())
        skip = g.check(self.steps, opts, norm=norm, scaler=self.scaler, position=position, max_grad_norm=max_norm)
        if g.pending is not None and g.pending.step == self.steps:
            self._bad_losses = (list(self._losses), self._loss_missing or not self._losses)
        return skip

    def _note_update(self, g: HookedGuard) -> None:
        """The step size of the update the script made by hand since the last backward: |dw|/|w| of a strided
        sample of the weights (the monitor's), set on the previous step's record (the evidence an LR too high
        leaves). Every step here: the monitor's own update statistics come every ``monitor.live_every`` steps."""
        if g.monitor is None or not g.monitor.sampled:
            return
        sample = g.monitor.sample()
        prev, self._w_prev = self._w_prev, sample
        history = g.core.history
        if prev is None or prev.shape != sample.shape or not history or history[-1].step != self.steps - 1:
            return
        ratio = float((sample - prev).norm() / prev.norm().clamp_min(1e-30))   # hand-written loops only
        history[-1] = dataclasses.replace(history[-1], update_ratio=ratio)

    def _start_handwritten(self) -> None:
        """The root is the largest module called at the top level; this step's call is its first micro-batch."""
        first = self._first_calls()
        best = max(dict.fromkeys(call[0] for call in first), key=lambda m: sum(q.numel() for q in m.parameters()))
        self.handwritten = True
        self.steps = self._backwards - 1   # the backward passes before this one were steps too (unchecked)
        self._adopt(best)
        self.guard.can_skip = False
        self.guard.replay = self.guard.unlocated = None   # watch --at counts optimizer steps: there are none
        module, args, kwargs, autocast, rng, loss = next(c for c in reversed(first) if c[0] is best)
        self._note_call(args, kwargs, autocast)
        self._note_out(loss)
        self.notes.append("no torch.optim optimizer: the weights are updated by hand, so each backward pass is "
                          "checked as a step (loss and gradients) and a bad one is reported, never skipped")

    # -- the optimizer step --
    def before_step(self, opt: torch.optim.Optimizer) -> None:
        if not self._checked:
            self._check(opt)

    def wants_closure(self) -> bool:
        return not self._checked

    def closure_evaluated(self, opt: torch.optim.Optimizer) -> None:
        """A closure optimizer's first evaluation is the step's (checked before any update; a bad step's
        gradients dropped there: no update); later ones (LBFGS's line search) are not new steps."""
        if not self._checked:
            self._check(opt)
            self._checked = self._in_closure = True

    def _check(self, opt: torch.optim.Optimizer) -> None:
        if self.guard is None:
            self._pick_root(opt)
        if self.guard.pending is not None:   # a bad step whose end was never seen: diagnose it now
            self._finish()
        self._begin_check()
        if self._loss_missing and self.root is not None and "loss" not in self._unseen:
            self._unseen["loss"] = (
                "the loss outside the model's forward (watch --at N locates a NaN born there)",
                "the loss is computed outside the model's forward: watch reruns the forward in-process, so a NaN "
                "born in the loss or in its backward is located by re-executing the script (nanprobe watch --at N, "
                "by default within watch.explain_budget); return the loss from forward to have it checked "
                "in-process")
        if self._guard_check([opt], *self.step_norm(opt)):
            skip_update([opt], self.scaler)
            self.skipped.append(self.steps)

    def step_done(self, optimizer: torch.optim.Optimizer) -> None:
        self.clip = None   # a clip inside the optimizer's own step (BertAdam's) came after the check: not the next's
        self._checked = self._in_closure = False
        self._output_nodes, self._loss_nodes = [], []
        self.steps += 1
        if self.guard is not None:
            self.guard.after_update()
            if self.guard.pending is not None:
                self._finish()

    def _finish(self) -> None:
        g = self.guard
        p = g.pending
        losses, missing = self._bad_losses   # their float32 sum, as the forward rerun adds the losses
        total = functools.reduce(operator.add, (v.float().reshape(()) for v in losses)) if losses else None
        # fidelity: the forward rerun gives the root output's loss, not what the script backpropagated
        p.compare = dataclasses.replace(p.record, loss=None if missing or total is None else float(total),
                                        grad_norm=None)
        p.extra["watch_rerun"] = {"loss_in_forward": not missing}
        g.conclude(extra={"root": type(self.root).__name__ if self.root is not None else None,
                          "handwritten": self.handwritten,
                          "argv": list(sys.argv), "at": self._at_record(p)})

    # -- what `nanprobe watch --at N` needs from this run (see nanprobe.watch.at) --
    def at_command(self, step: int) -> str:
        """The command that re-executes the script with step ``step`` instrumented."""
        return at_command(step, self.argv or ["python", *sys.argv], self.dirpath)

    def _at_record(self, p: Pending) -> dict[str, Any]:
        """Note the bad step in the run's record (a line per bad step): what ``--at`` restores and compares
        with. Returns what the report says of it."""
        g = self.guard
        record = p.record
        if p.report is not None:   # update-born: the step's own (good) check, not the later one that saw it
            record = next((h for h in g.history if h.step == p.step and h.finite), None)
        skipped, self._skipped_written = self.skipped[self._skipped_written:], len(self.skipped)
        path = write_run_record(self.dirpath, self._run_path, {
            "argv": list(sys.argv), "command": self.argv, "start_state": self.start}, {
            "step": p.step, "status": p.status.value, "reason": p.reason, "skipped": skipped,
            "root": type(self.root).__name__ if self.root is not None else None,
            "record": record_json(record, weights_nonfinite=p.report is not None or p.corrupt),
            "history": [h.to_json() for h in p.history if h.step < p.step]})
        self._run_path = path or self._run_path
        return {"command": self.at_command(p.step), "run_record": str(path) if path is not None else None}

    def finish_at_exit(self) -> None:
        """The script ended with a caught bad step not yet diagnosed (its update was the GradScaler's to skip)."""
        if self.guard is not None and (self.guard.pending is not None or self.guard.final_check()):
            self._finish()

    # -- the bad step: what the live gradients and the optimizer say --
    def _on_bad(self, p: Pending) -> None:
        model = self.guard.model
        named = [(n, local_value(q.grad)) for n, q in model.named_parameters() if q.grad is not None]
        rows: dict[str, dict[str, Any]] = {}
        counts = torch.stack([(~torch.isfinite(g)).sum() for _, g in named]).tolist() if named else []   # one sync
        for (name, g), bad in zip(named, counts):
            module = name.rpartition(".")[0]
            row = rows.setdefault(module, {"module": module, "nonfinite": 0, "total": 0, "parameters": []})
            row["total"] += g.numel()
            if bad:
                row["nonfinite"] += int(bad)
                row["parameters"].append(name)
        p.extra["gradients"] = {"nonfinite_modules": [r for r in rows.values() if r["nonfinite"]],
                                "note": "non-finite gradient values per module in the live step (before it was "
                                        "skipped)"}
        names = {id(q): n for n, q in model.named_parameters()}
        p.extra["update"] = update_forensics([self.optimizer], names, weights=p.corrupt)
        loss = p.record.loss
        if self._output_nodes and self._loss_nodes and loss is not None and not math.isfinite(loss):
            p.extra["loss_outside_model"] = {   # the loss as a string: the report stays valid JSON
                "loss": str(loss), "kind": "nan" if math.isnan(loss) else "inf",
                "ops": ops_between(self._loss_nodes, {id(n) for n in self._output_nodes})}

    def _adjust(self, report: Report, p: Pending) -> Report:
        report = dataclasses.replace(report, notes=(*report.notes, *(f"not seen by watch: {full}"
                                                                      for _, full in self.unseen())))
        if p.status is Status.DIVERGING:   # a finite step: the report is its trajectory and mechanism
            return dataclasses.replace(report, status=Status.DIVERGING)
        loss_in_forward = p.extra.get("watch_rerun", {}).get("loss_in_forward", False)
        notes = list(report.notes)
        findings = list(report.findings)
        grads = p.extra.get("gradients", {}).get("nonfinite_modules", [])
        data_error = any(d.get("level") == "error" for d in report.extra.get("data_problems", []))
        origin = report.origin
        if origin is None:
            findings = [f for f in findings if f.cause is not Cause.NOT_REPRODUCED]
            if not loss_in_forward and not data_error:
                # the forward rerun (instrumented) found nothing non-finite in the model: the loss outside it did
                outside = loss_outside_finding(p.extra.get("loss_outside_model") or {}, report.precision)
                if outside is None:
                    notes.insert(0, "the loss is computed outside the root module's forward: watch reran the "
                                    "forward only, and it was finite, so the origin is in the loss or the backward "
                                    "pass; for the full diagnosis write an ENTRY with your loss_fn and run the "
                                    "replay command")
                else:
                    findings.insert(0, outside[0])
                    origin = outside[1]
                    notes.append(f"the op's source line, values and samples: {self.at_command(p.step)} re-executes "
                                 f"the script with step {p.step} instrumented")
            if grads:
                where = ", ".join(r["module"] or "(root)" for r in grads[:4])
                notes.insert(0, f"non-finite gradients in {len(grads)} module(s): {where}")
        upd = p.extra.get("update", {})
        if upd.get("nonfinite_parameters") and not any(f.phase is Phase.UPDATE for f in findings):
            findings.insert(0, update_finding(upd, max(p.step - 1, 0)))
        if origin is None and not data_error and self.root is not None:   # backward/update-born: --at locates it
            notes.insert(0, f"not located in-process: {self.at_command(p.step)} re-executes the script with step "
                            f"{p.step} instrumented (forward, backward and update)")
        status = p.status if report.status is Status.FINITE else report.status
        return dataclasses.replace(report, notes=tuple(notes), findings=tuple(findings), status=status, origin=origin)

    # -- the target the diagnosis reruns --
    def _target(self) -> Target:
        items = [it for it in self.guard.core.items if isinstance(it, dict)]
        return forward_target(self.guard.model, self.optimizer, items[0].get("autocast") if items else None,
                              self._device_type, "nanprobe watch", self.schedulers,
                              accumulate=max(len(self.guard.core.items), 1))[0]


__all__ = ["Watcher", "POLICIES", "forward_target"]
