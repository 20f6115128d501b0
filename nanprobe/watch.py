"""`nanprobe watch -- python train.py ARGS`: an unmodified script under the guard, through PyTorch's global hooks.

The script runs in this process (``runpy``, ``sys.argv`` as it would see it), its output and exit
code untouched. While it runs:

* the first optimizer that steps is the guarded one; its steps are the step numbers (0, 1, ...);
* during the first step, global module forward hooks find the *root module*: the outermost module
  called with gradients enabled whose parameters hold the optimizer's (DDP: the module inside);
  from then on only the root carries hooks: its inputs (positional and keyword arguments, by
  reference), the RNG state and the autocast dtype at each call, and the loss its output holds
  (``loss``, ``out.loss``, ``out["loss"]``, the one scalar in a tuple);
* ``torch.autograd.backward`` notes the losses backpropagated (``GradScaler.scale`` the unscaled
  ones); ``LRScheduler.__init__`` notes the schedulers;
* the guarded optimizer's global step pre-hook (or ``GradScaler.step``, after unscaling) checks the
  step: the loss and the global gradient norm in one device sync. On a non-finite loss or gradient,
  or a spike, the update is skipped (gradients set to None) and a capsule written; once the step
  is over (the optimizer's post-hook) it is diagnosed in-process with what needs no ``loss_fn``:
  the root module's forward (and backward, when the output holds the loss) rerun on the captured
  inputs under instrumentation, the non-finite gradients by module, the data checks on the inputs,
  and the update's forensics (LR and optimizer settings; the parameters an earlier update made
  non-finite). The JSON report goes to ``dirpath`` (and ``--json OUT``); the log line names the
  ``nanprobe run ENTRY --capsule ...`` command for a full diagnosis with the script's own loss.

Weights an earlier update made non-finite cannot be recovered by skipping: that raises into the
script (as policy ``raise`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import runpy
import shutil
import sys
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from .config import Config
from .errors import UsageError
from .feed import MicroBatches, Position
from .hooked import HookedGuard, HookEvent, Stopped, check_policy, resolve_config, skip_update, total_norm
from .hooked.guard import Pending
from .precision import Precision
from .report import Cause, Finding, Phase, Report, Status
from .state import capture_rng
from .target import Target, validate

logger = logging.getLogger("nanprobe.watch")

POLICIES = ("skip", "raise", "record")
_PYTHONS = ("python", "python3")


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchResult:
    """What ``nanprobe watch`` saw: the script's own exit code, the guarded steps, the bad ones."""

    argv: tuple[str, ...]
    exit_code: int                 # the script's (1 when it raised, as Python exits)
    steps: int                     # optimizer steps of the guarded optimizer
    events: tuple[HookEvent, ...] = ()
    root: str | None = None        # the root module's class
    json: str | None = None        # where --json wrote the first bad step's report
    error: str | None = None       # the script raised: the exception's one line
    notes: tuple[str, ...] = ()


# -- the command line after `--` ----------------------------------------------------------------------

def parse_command(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """``python train.py ARGS`` / ``python -m pkg.train ARGS`` -> (kind, target, args)."""
    argv = list(argv)
    if not argv:
        raise UsageError("no command to watch", "nanprobe watch", "Give it after --: nanprobe watch -- python "
                                                                   "train.py ARGS")
    exe = argv[0]
    name = os.path.basename(exe)
    known = name.startswith(_PYTHONS) or os.path.realpath(shutil.which(exe) or exe) == os.path.realpath(sys.executable)
    if not known:
        raise UsageError(f"{exe!r} is not a Python interpreter", "nanprobe watch",
                         "Watch a Python script: nanprobe watch -- python train.py ARGS (or python -m pkg.train); "
                         "under torchrun: torchrun ... --no-python nanprobe watch -- python train.py")
    rest = argv[1:]
    if rest[:1] == ["-m"]:
        if len(rest) < 2:
            raise UsageError("python -m needs a module", "nanprobe watch",
                             "Write: nanprobe watch -- python -m pkg.train")
        return "module", rest[1], rest[2:]
    if not rest or rest[0].startswith("-"):
        raise UsageError(f"cannot watch {' '.join(argv)!r}", "nanprobe watch",
                         "Give a script: nanprobe watch -- python train.py ARGS (or python -m pkg.train ARGS)")
    if not Path(rest[0]).is_file():
        raise UsageError(f"script {rest[0]!r} not found", "nanprobe watch",
                         f"Check the path (relative to {os.getcwd()})")
    return "script", rest[0], rest[1:]


# -- what the root module's output holds ---------------------------------------------------------------

def find_loss(out: Any) -> torch.Tensor | None:
    """The scalar loss a forward returned: the output itself, ``.loss``, ``["loss"]``, or the one
    floating scalar (with a graph) in a tuple/list."""
    def scalar(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point() and t.requires_grad
    if scalar(out):
        return out
    loss = getattr(out, "loss", None) if not isinstance(out, (dict, tuple, list, torch.Tensor)) else None
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if scalar(loss):
        return loss
    if isinstance(out, (tuple, list)):
        found = [t for t in out if scalar(t)]
        if len(found) == 1:
            return found[0]
    return None


def _batch_of(args: tuple, kwargs: dict, autocast: str | None) -> dict[str, Any]:
    return {"args": tuple(args), "kwargs": dict(kwargs), "autocast": autocast}


class ForwardStep:
    """What ``watch`` reruns without the script's loss_fn: the root module's forward on the captured
    inputs, under the autocast dtype the script used, and its backward when the output holds the loss.
    No optimizer step: the update is the script's."""

    def __init__(self, device_type: str):
        self.device_type = device_type

    def __call__(self, model: torch.nn.Module, batch: Any, step: int) -> torch.Tensor | None:
        micro = batch if isinstance(batch, MicroBatches) else [batch]
        total = None
        for item in micro:
            if not isinstance(item, dict):   # a step in which the root module was not called
                continue
            dtype = item.get("autocast")
            ctx = torch.autocast(self.device_type, dtype=getattr(torch, dtype)) if dtype else \
                torch.autocast(self.device_type, enabled=False)
            with torch.enable_grad():
                with ctx:
                    out = model(*item["args"], **item["kwargs"])
                loss = find_loss(out)
                if loss is not None:
                    loss.backward()
            if loss is not None:
                d = loss.detach().float()
                total = d if total is None else total + d
        return total


# -- the watcher -----------------------------------------------------------------------------------------

class _Patch:
    __slots__ = ("obj", "name", "original")

    def __init__(self, obj: Any, name: str, value: Any):
        self.obj, self.name = obj, name
        self.original = getattr(obj, name)
        setattr(obj, name, value)

    def undo(self) -> None:
        setattr(self.obj, self.name, self.original)


class Watcher:
    """Global hooks and scoped patches that guard the script's training (see the module docstring)."""

    def __init__(self, *, config: Config, policy: str, dirpath: str | os.PathLike, entry: str | None,
                 max_reports: int = 1):
        self.cfg = config
        self.max_reports = max_reports
        self.policy = policy
        self.dirpath = dirpath
        self.entry = entry
        self.guard: HookedGuard | None = None
        self.optimizer: torch.optim.Optimizer | None = None   # the guarded one: the first that steps
        self.root: torch.nn.Module | None = None
        self.steps = 0
        self.events: list[HookEvent] = []
        self.notes: list[str] = []
        self.schedulers: weakref.WeakSet = weakref.WeakSet()
        self._optimizer_hooks: list[Any] = []
        self._module_hooks: list[Any] = []        # global, first step only
        self._root_hooks: list[Any] = []
        self._patches: list[_Patch] = []
        self._depth = 0
        self._first: list[list[Any]] = []   # step 0's top-level calls: [module, args, kwargs, autocast, rng, loss]
        self._early_losses: list[torch.Tensor] = []   # backpropagated before the guard existed (step 0)
        self._losses: list[torch.Tensor] = []     # the root output's loss per call in the step
        self._loss_missing = False
        self._bad_losses: tuple[list[torch.Tensor], bool] = ([], True)   # the same, of the pending bad step
        self._scaled: set[int] = set()            # ids of GradScaler.scale outputs (noted unscaled already)
        self._checked = False                     # this step was checked already (in GradScaler.step)
        self._in_scaler_step = False              # inside the guarded optimizer's GradScaler.step
        self._scaler: torch.amp.GradScaler | None = None
        self._clip: tuple[torch.Tensor, float] | None = None   # the step's clip_grad_norm_: (norm before, max_norm)
        self._device_type = "cpu"

    # -- install / remove --
    def __enter__(self) -> Watcher:
        from torch.optim.lr_scheduler import LRScheduler
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        try:
            self._optimizer_hooks.append(register_optimizer_step_pre_hook(self._opt_pre))
            self._optimizer_hooks.append(register_optimizer_step_post_hook(self._opt_post))
            self._module_hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(self._any_pre))
            self._module_hooks.append(torch.nn.modules.module.register_module_forward_hook(self._any_post,
                                                                                          always_call=True))
            self._patches.append(_Patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward)))
            self._patches.append(_Patch(torch.amp.GradScaler, "scale", self._wrap_scale(torch.amp.GradScaler.scale)))
            self._patches.append(_Patch(torch.amp.GradScaler, "step",
                                        self._wrap_scaler_step(torch.amp.GradScaler.step)))
            self._patches.append(_Patch(LRScheduler, "__init__", self._wrap_sched_init(LRScheduler.__init__)))
            clip = self._wrap_clip(torch.nn.utils.clip_grad_norm_)
            self._patches.append(_Patch(torch.nn.utils, "clip_grad_norm_", clip))
            self._patches.append(_Patch(torch.nn.utils.clip_grad, "clip_grad_norm_", clip))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in reversed(self._patches):
            p.undo()
        for h in self._optimizer_hooks + self._module_hooks + self._root_hooks:
            h.remove()
        self._patches, self._optimizer_hooks, self._module_hooks, self._root_hooks = [], [], [], []

    @property
    def busy(self) -> bool:
        return self.guard is not None and self.guard.busy

    # -- finding the root module in the first step --
    def _any_pre(self, module: torch.nn.Module, args: tuple) -> None:
        if self.root is not None:
            return
        if self._depth == 0 and torch.is_grad_enabled():
            self._first.append([module, args, {}, _autocast_dtype(module), capture_rng(_device(module), host=False),
                                None])
        self._depth += 1

    def _any_post(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        if self.root is not None:
            return
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0 and self._first and self._first[-1][0] is module:
            self._first[-1][5] = find_loss(out)

    def _pick_root(self, opt: torch.optim.Optimizer) -> None:
        for h in self._module_hooks:   # a Python call per module call: from now on only the root has hooks
            h.remove()
        self._module_hooks = []
        params = {id(p) for g in opt.param_groups for p in g["params"]}
        modules = list(dict.fromkeys(call[0] for call in self._first))
        best = next((m for m in modules if params <= {id(p) for p in m.parameters()}), None)
        if best is None and modules:   # no single call holds all the optimizer's parameters
            best = max(modules, key=lambda m: len(params & {id(p) for p in m.parameters()}))
            self.notes.append("no module called in the first step holds all of the optimizer's parameters; "
                              f"the root is {type(best).__name__}")
        self.root = best
        first, self._first = self._first, []
        if best is None:
            self.notes.append("no module was called with gradients enabled before the first optimizer step: "
                              "no inputs to rerun")
            self._make_guard(_params_module(opt))
            return
        self._device_type = _device(best)
        self._root_hooks.append(best.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._root_hooks.append(best.register_forward_hook(self._root_post))
        self._make_guard(_inner(best))
        for module, args, kwargs, autocast, rng, loss in first:
            if module is best:
                self._note_call(args, kwargs, autocast)
                rngs = self.guard._rng_after
                if rngs:   # the RNG as it was at that call, not now
                    rngs[-1] = dict(rngs[-1], **rng)
                self._note_out(loss)

    def _make_guard(self, model: torch.nn.Module) -> None:
        self.guard = HookedGuard(command="watch", who="nanprobe watch", model=model, build_target=self._target,
                                 config=self.cfg, policy=self.policy, dirpath=self.dirpath, entry=self.entry,
                                 allowed=POLICIES, on_bad=self._on_bad, adjust=self._adjust,
                                 max_reports=self.max_reports)
        for loss in self._early_losses:
            self.guard.note_loss(loss)
        self._early_losses = []

    # -- the root's calls --
    def _root_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.busy and torch.is_grad_enabled():
            self._note_call(args, kwargs, _autocast_dtype(module))

    def _root_post(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        if not self.busy and torch.is_grad_enabled():
            self._note_out(find_loss(out))

    def _note_call(self, args: tuple, kwargs: dict, autocast: str | None) -> None:
        g = self.guard
        if not g.in_step:
            self._losses, self._loss_missing = [], False
        g.micro(_batch_of(args, kwargs, autocast), self.steps)

    def _note_out(self, loss: torch.Tensor | None) -> None:
        if loss is None:
            self._loss_missing = True
        else:
            self._losses.append(loss.detach().float().reshape(()))

    # -- losses --
    def _note_loss(self, t: torch.Tensor) -> None:
        if self.guard is not None:
            self.guard.note_loss(t)
        elif self.root is None:
            self._early_losses.append(t.detach().float().reshape(()))

    def _wrap_backward(self, original):
        watcher = self

        def backward(tensors, *args, **kwargs):
            if not watcher.busy:
                for t in (tensors if isinstance(tensors, (tuple, list)) else (tensors,)):
                    if isinstance(t, torch.Tensor) and t.numel() == 1 and id(t) not in watcher._scaled:
                        watcher._note_loss(t)
            return original(tensors, *args, **kwargs)
        return backward

    def _wrap_scale(self, original):
        watcher = self

        def scale(scaler, outputs):
            out = original(scaler, outputs)
            if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 and not watcher.busy:
                watcher._scaled.add(id(out))
                watcher._note_loss(outputs)
            return out
        return scale

    def _wrap_scaler_step(self, original):
        watcher = self

        def step(scaler, optimizer, *args, **kwargs):
            guarded = not watcher.busy and scaler.is_enabled() and \
                (watcher.optimizer is None or optimizer is watcher.optimizer) and "closure" not in kwargs
            if not guarded:
                return original(scaler, optimizer, *args, **kwargs)
            if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
                scaler.unscale_(optimizer)   # what step() does first: the check sees unscaled gradients
            watcher._scaler = scaler
            try:
                watcher._check(optimizer)
            finally:
                watcher._scaler = None
            watcher._checked = watcher._in_scaler_step = True
            try:
                out = original(scaler, optimizer, *args, **kwargs)
            finally:
                watcher._in_scaler_step = False
            watcher._step_done()   # also when the scaler skipped optimizer.step(): the script's step is over
            return out
        return step

    def _wrap_clip(self, original):
        watcher = self

        def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
            norm = original(parameters, max_norm, *args, **kwargs)
            if not watcher.busy and isinstance(norm, torch.Tensor):
                watcher._clip = (norm.detach(), float(max_norm))
            return norm
        return clip_grad_norm_

    def _wrap_sched_init(self, original):
        watcher = self

        def __init__(sched, *args, **kwargs):
            original(sched, *args, **kwargs)
            watcher.schedulers.add(sched)
        return __init__

    # -- the optimizer step --
    def _opt_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.busy:
            return
        if self.optimizer is None:
            self.optimizer = opt
        if opt is self.optimizer and not self._checked:
            self._check(opt)

    def _check(self, opt: torch.optim.Optimizer) -> None:
        if self.optimizer is None:
            self.optimizer = opt
        if self.guard is None:
            self._pick_root(opt)
        g = self.guard
        if g.pending is not None:   # a bad step whose end was never seen: diagnose it now
            self._finish()
        if not g.in_step:   # no root call captured in this step
            self._losses, self._loss_missing = [], True
            g.micro(None, self.steps)
        scaler = self._scaler
        position = Position(step=self.steps, epoch=None, index=self.steps, items=())
        clip, self._clip = self._clip, None
        if clip is not None:   # the script clipped: its norm is the one before clipping (and costs nothing)
            norm, max_norm = clip
        else:
            norm, max_norm = total_norm([p.grad for grp in opt.param_groups for p in grp["params"]
                                         if p.grad is not None]), None
        if g.check(self.steps, [opt], norm=norm, scaler_active=scaler is not None, position=position,
                   max_grad_norm=max_norm):
            skip_update([opt], scaler)
        if g.pending is not None and g.pending.step == self.steps:
            self._bad_losses = (list(self._losses), self._loss_missing or not self._losses)

    def _opt_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.busy or opt is not self.optimizer or self._in_scaler_step:
            return
        self._step_done()

    def _step_done(self) -> None:
        self._checked = False
        self._scaled.clear()
        self.steps += 1
        if self.guard is not None and self.guard.pending is not None:
            self._finish()

    def _finish(self) -> None:
        g = self.guard
        p = g.pending
        losses, missing = self._bad_losses
        total = None
        for v in losses:
            total = v if total is None else total + v
        # fidelity: the forward rerun gives the root output's loss, not what the script backpropagated
        p.compare = dataclasses.replace(p.record, loss=None if missing or total is None else float(total),
                                        grad_norm=None)
        p.extra["watch_rerun"] = {"loss_in_forward": not missing}
        event = g.finish(extra={"root": type(self.root).__name__ if self.root is not None else None,
                                "argv": list(sys.argv)})
        if event is None:
            return
        self.events.append(event)
        logger.warning(event.line("nanprobe watch"))
        if event.action == "raised":
            raise Stopped(event, event.why or "")

    def finish_at_exit(self) -> None:
        """The script ended with a caught bad step not yet diagnosed (its update was the GradScaler's to skip)."""
        if self.guard is not None and self.guard.pending is not None:
            self._finish()

    # -- the bad step: what the live gradients and the optimizer say --
    def _on_bad(self, p: Pending) -> None:
        model = self.guard.model
        named = [(n, q.grad) for n, q in model.named_parameters() if q.grad is not None]
        rows: dict[str, dict[str, Any]] = {}
        if named:
            counts = torch.stack([(~torch.isfinite(g)).sum() for _, g in named]).tolist()   # one sync
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
        p.extra["update"] = _update_forensics(self.optimizer, model, p.corrupt)

    def _adjust(self, report: Report, p: Pending) -> Report:
        loss_in_forward = p.extra.get("watch_rerun", {}).get("loss_in_forward", False)
        notes = list(report.notes)
        findings = list(report.findings)
        grads = p.extra.get("gradients", {}).get("nonfinite_modules", [])
        if report.origin is None:
            findings = [f for f in findings if f.cause is not Cause.NOT_REPRODUCED]
            data_error = any(d.get("level") == "error" for d in report.extra.get("data_problems", []))
            if not loss_in_forward and not data_error:
                notes.insert(0, "the loss is computed outside the root module's forward: watch reran the forward "
                                "only, and it was finite, so the origin is in the loss or the backward pass; for "
                                "the full diagnosis write an ENTRY with your loss_fn and run the replay command")
            if grads:
                where = ", ".join(r["module"] or "(root)" for r in grads[:4])
                notes.insert(0, f"non-finite gradients in {len(grads)} module(s): {where}")
        upd = p.extra.get("update", {})
        if upd.get("nonfinite_parameters"):
            findings.insert(0, _update_finding(upd, p.step))
        status = p.status if report.status is Status.FINITE else report.status
        return dataclasses.replace(report, notes=tuple(notes), findings=tuple(findings), status=status)

    # -- the target the diagnosis reruns --
    def _target(self) -> Target:
        model = self.guard.model
        own = {id(q) for q in model.parameters()}
        opt = self.optimizer
        use_opt = opt is not None and all(id(q) in own for g in opt.param_groups for q in g["params"])
        scheds = [s for s in list(self.schedulers) if use_opt and getattr(s, "optimizer", None) is opt]
        items = [it for it in self.guard._items if isinstance(it, dict)]
        dtype = items[0].get("autocast") if items else None
        precision = {"bfloat16": Precision.BF16, "float16": Precision.FP16}.get(dtype, Precision.FP32)
        return validate({"model": model, "step_fn": ForwardStep(self._device_type), "batches": [],
                         "optimizer": opt if use_opt else None, "scheduler": scheds or None,
                         "precision": precision, "accumulate": max(len(self.guard._items), 1)}, "nanprobe watch")


def _inner(module: torch.nn.Module) -> torch.nn.Module:
    from .capsule import unwrap
    return unwrap(module)


def _device(module: torch.nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _autocast_dtype(module: torch.nn.Module) -> str | None:
    device = _device(module)
    if torch.is_autocast_enabled(device):
        return str(torch.get_autocast_dtype(device)).replace("torch.", "")
    return None


def _params_module(opt: torch.optim.Optimizer) -> torch.nn.Module:
    """A module holding the optimizer's parameters (no root module was found)."""
    holder = torch.nn.Module()
    holder.params = torch.nn.ParameterList([p for g in opt.param_groups for p in g["params"]])
    return holder


def _update_forensics(opt: torch.optim.Optimizer | None, model: torch.nn.Module, corrupt: bool) -> dict[str, Any]:
    """The optimizer's settings and, where an earlier update made weights non-finite, those parameters
    with their optimizer state."""
    if opt is None:
        return {}
    groups = []
    for g in opt.param_groups:
        groups.append({k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else
                           list(v) if isinstance(v, tuple) else v)
                       for k, v in g.items() if k in ("lr", "eps", "weight_decay", "betas", "momentum")})
    out: dict[str, Any] = {"optimizer": type(opt).__name__, "param_groups": groups}
    if not corrupt:
        return out
    names = {id(q): n for n, q in model.named_parameters()}
    bad = []
    for gi, g in enumerate(opt.param_groups):
        for q in g["params"]:
            if bool(torch.isfinite(q.detach()).all()):
                continue
            row: dict[str, Any] = {"parameter": names.get(id(q), "?"), "group": gi,
                                   "nonfinite": int((~torch.isfinite(q.detach())).sum())}
            st = opt.state.get(q, {})
            for key in ("exp_avg_sq", "exp_avg", "momentum_buffer"):
                v = st.get(key)
                if isinstance(v, torch.Tensor):
                    a = v.detach().float().abs()
                    row[key] = {"min": float(a.min()), "max": float(a.max()), "zeros": int((a == 0).sum())}
            if "step" in st:
                row["step"] = float(st["step"])
            bad.append(row)
    out["nonfinite_parameters"] = bad
    return out


def _update_finding(upd: dict[str, Any], step: int) -> Finding:
    bad = upd["nonfinite_parameters"]
    first = bad[0]
    group = upd["param_groups"][first["group"]] if upd.get("param_groups") else {}
    lines = [f"the weights were non-finite before step {step}: the {upd.get('optimizer')} update of step "
             f"{max(step - 1, 0)} made {len(bad)} parameter(s) non-finite, first {first['parameter']} "
             f"({first['nonfinite']} values)",
             "optimizer settings: " + ", ".join(f"{k}={v}" for k, v in group.items())]
    v = first.get("exp_avg_sq")
    if v is not None:
        lines.append(f"its Adam second moment: min {v['min']:.3g}, max {v['max']:.3g}, {v['zeros']} zero(s)"
                     + (f" with eps={group.get('eps')}" if "eps" in group else ""))
    return Finding(cause=Cause.LR_SPIKE, confidence=0.6, phase=Phase.UPDATE,
                   module=first["parameter"].rpartition(".")[0] or None, op=None, evidence=tuple(lines))


# -- running the script -----------------------------------------------------------------------------------

@contextlib.contextmanager
def _script_environment(kind: str, target: str, args: list[str]):
    argv, path0 = list(sys.argv), sys.path[0] if sys.path else None
    if kind == "script":
        sys.argv = [target, *args]
        folder = str(Path(target).resolve().parent)
        if sys.path:
            sys.path[0] = folder
        else:
            sys.path.insert(0, folder)
    else:
        sys.argv = [target, *args]
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.argv = argv
        if path0 is not None and sys.path:
            sys.path[0] = path0


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def watch(command: Sequence[str], *, json_out: str | os.PathLike | None = None, policy: str = "skip",
          config: Any = None, dirpath: str | os.PathLike = "nanprobe-reports", entry: str | None = None,
          check_every: int | None = None, max_reports: int = 1) -> WatchResult:
    """Run ``python train.py ARGS`` (or ``python -m pkg.train ARGS``) in this process under the guard.

    The script's output goes where it would; its exit code is the result's (an exception it raises is
    printed as Python would, exit code 1). Bad steps are logged on the ``nanprobe.watch`` logger.
    """
    check_policy(policy, POLICIES, "--policy")
    kind, target, args = parse_command(command)
    cfg = resolve_config(config, "nanprobe watch", check_every=check_every)
    if json_out is not None and str(json_out) == "-":
        raise UsageError("--json - would mix the report with the script's output", "--json",
                         "Give a file: --json report.json")
    if isinstance(max_reports, bool) or not isinstance(max_reports, int) or max_reports < 0:
        raise UsageError(f"--max-reports {max_reports!r}", "nanprobe watch",
                         "Give the number of bad steps to diagnose in-process (0: none, only capsules)")
    watcher = Watcher(config=cfg, policy=policy, dirpath=dirpath, entry=entry, max_reports=max_reports)
    code = 0
    error = None
    with _script_environment(kind, target, args):
        with watcher:
            try:
                if kind == "script":
                    runpy.run_path(target, run_name="__main__")
                else:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                code = _exit_code(exc.code)
            except KeyboardInterrupt:
                traceback.print_exc()
                code = 130
            except Stopped as exc:
                error = exc.message
                code = 1
            except BaseException as exc:  # noqa: BLE001 - the script's own error, printed as Python does
                traceback.print_exc()
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
                code = 1
            finally:
                try:
                    watcher.finish_at_exit()
                except Stopped as exc:
                    error = error or exc.message
                    code = code or 1
    written = None
    if json_out is not None and watcher.events and watcher.events[0].report:
        Path(json_out).write_text(Path(watcher.events[0].report).read_text())
        written = str(json_out)
    root = type(watcher.root).__name__ if watcher.root is not None else None
    return WatchResult(argv=tuple(command), exit_code=code, steps=watcher.steps, events=tuple(watcher.events),
                       root=root, json=written, error=error, notes=tuple(watcher.notes))


__all__ = ["watch", "WatchResult", "Watcher", "ForwardStep", "find_loss", "parse_command", "POLICIES"]
