"""`nanprobe watch --at N -- python train.py ARGS`: re-execute the unmodified script and explain its step N.

The in-process diagnosis of ``watch`` reruns the root module's forward only: a NaN born in backward (the
gradient of ``sqrt`` at 0) or in the optimizer update is caught at the right step but not located. This
module re-executes the same script in this process (``runpy``, as ``watch`` does) with the step counting
of ``watch`` (the guarded optimizer's steps 0, 1, ...; a GradScaler skip is a step) and nothing checked
before step N (a Python call per optimizer step). From the first forward of the root module in step N (the
first module called with gradients enabled once step N-1's update is over) to the end of step N's optimizer
update, the run's own ops go through the instrumentation ``nanprobe run`` uses
(:class:`nanprobe.instrument.OriginTracker`, forward / backward / update phases, anomaly mode's forward
lines for the backward nodes); then the script is stopped and the trace is classified with the same
``classify`` and ``fixes`` code into the same JSON report.

Determinism. torch's default generator starts from the same seed in every process, Python's ``random``
and numpy's global generator do not: the first ``watch`` run stores their states at the script's start
in its run record (JSON, ``<dir>/watch-*.run.json``, written at each bad step, named in its reports) and
``--at`` restores them. The record (found in ``--dir`` by command) also holds each bad step's loss,
gradient norm and whether its update broke the weights, and the updates watch skipped: ``--at`` skips
those again, compares step N with the watched run, and a rerun that differs says "not reproduced"
instead of a diagnosis.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import random
import runpy
import shlex
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..classify import Evidence, classify, scaler_skip_note
from ..classify.mechanism import mechanism_findings
from ..config import Config
from ..errors import UsageError
from ..feed import Recorded
from ..fixes import attach
from ..hooked import resolve_config
from ..hooked.events import current_lr, skip_update, total_norm
from ..hooked.guard import _f32
from ..instrument import LOSS_FN, OriginTracker, _anomaly_source
from ..precision import Precision, describe_device
from ..replay import Reached, scheduler_info
from ..report import Cause, Finding, Fidelity, Phase, PrecisionResult, Report, Status, StepRecord, _num, dumps
from ..sharding import weights_finite
from ..step import Loop, Patch
from ..target import validate
from .forward import ForwardStep, autocast_dtype, batch_of, device_of_module

RUN_SUFFIX = ".run.json"
OUTSIDE = "(loss outside the model)"
DEFAULT_DIR = "nanprobe-reports"


# -- the first run's record: the script's start state, the bad step's numbers --------------------------------

def start_state() -> dict[str, Any]:
    """The host RNG states a script starts from (taken by ``watch`` before the script runs): JSON-able."""
    state: dict[str, Any] = {"python_random": _jsonable(random.getstate()),
                             "torch": torch.get_rng_state().tolist(),
                             "hash_randomization": bool(sys.flags.hash_randomization),
                             "pythonhashseed": os.environ.get("PYTHONHASHSEED")}
    try:
        import numpy as np
    except ImportError:   # pragma: no cover - numpy comes with torch's usual installs
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    return state


def _jsonable(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    return x


def restore_start_state(state: dict[str, Any]) -> list[str]:
    """Put the recorded RNG states back; returns what was restored."""
    done = []
    py = state.get("python_random")
    if isinstance(py, list) and len(py) == 3:
        random.setstate((int(py[0]), tuple(int(v) for v in py[1]), py[2]))
        done.append("python random")
    t = state.get("torch")
    if isinstance(t, list) and t:
        torch.set_rng_state(torch.tensor(t, dtype=torch.uint8))
        done.append("torch")
    npst = state.get("numpy")
    if isinstance(npst, list) and len(npst) == 5:
        import numpy as np
        np.random.set_state((str(npst[0]), np.array(npst[1], dtype=np.uint32), int(npst[2]), int(npst[3]),
                             float(npst[4])))
        done.append("numpy")
    return done


def write_run_record(dirpath: str | os.PathLike, path: Path | None, data: dict[str, Any]) -> Path | None:
    """Write (or rewrite, at each bad step) the watched run's record for ``--at``: its command, its start RNG
    states, the updates it skipped, each bad step's numbers. None when it cannot be written."""
    folder = Path(dirpath)
    try:
        if path is None:
            folder.mkdir(parents=True, exist_ok=True)
            stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
            path = folder / f"watch-{stamp}-{os.getpid()}{RUN_SUFFIX}"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
        return path
    except OSError:
        return None


def at_command(step: int, argv: Sequence[str], dirpath: str | os.PathLike | None) -> str:
    """The command that explains step ``step`` of the watched script (``argv``: ``python train.py ARGS``)."""
    where = "" if dirpath is None or str(dirpath) == DEFAULT_DIR else f" --dir {shlex.quote(str(dirpath))}"
    return f"nanprobe watch --at {step}{where} -- {shlex.join(argv)}"


def record_json(record: StepRecord | None, *, weights_nonfinite: bool) -> dict[str, Any]:
    """What ``--at`` compares its rerun with: the watched step's loss, gradient norm and whether its update
    made the weights non-finite."""
    if record is None:
        return {"loss": None, "grad_norm": None, "weights_nonfinite": weights_nonfinite}
    return {"loss": _num(record.loss), "grad_norm": _num(record.grad_norm), "skipped": record.skipped,
            "weights_nonfinite": weights_nonfinite}


def _same_argv(a: Sequence[str] | None, b: Sequence[str]) -> bool:
    if not a or not b or len(a) != len(b):
        return False
    return os.path.realpath(a[0]) == os.path.realpath(b[0]) and list(a[1:]) == list(b[1:])


def find_run(dirpath: str | os.PathLike, step: int, script_argv: Sequence[str], command: Sequence[str] = ()
             ) -> tuple[Path, dict[str, Any], dict[str, Any] | None] | None:
    """The newest record of a watched run of this script with these arguments in ``dirpath`` that saw step
    ``step`` bad (else the newest of any such run, with None for the step): (path, record, the step's entry)."""
    folder = Path(dirpath)
    if not folder.is_dir():
        return None
    fallback = None
    for path in sorted(folder.glob(f"*{RUN_SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not (_same_argv(data.get("argv"), script_argv)
                                              or command and data.get("command") == list(command)):
            continue
        entry = next((b for b in data.get("bad_steps", []) if isinstance(b, dict) and b.get("step") == step), None)
        if entry is not None:
            return path, data, entry
        fallback = fallback or (path, data, None)
    return fallback


# -- the rerun's hooks -----------------------------------------------------------------------------------

class _Done(BaseException):
    """Step N is over: stop the script (a BaseException: the script's ``except Exception`` lets it pass)."""


class _LiveTracker(OriginTracker):
    """The tracker over the script's own step: a backward origin gets its forward line from anomaly mode's
    node metadata at once (``run`` finds it in one more rerun; this step cannot be rerun)."""

    def _check_outputs(self, *args: Any) -> None:
        n = len(self.trace.events)
        super()._check_outputs(*args)
        if len(self.trace.events) > n:
            e = self.trace.events[-1]
            if e.phase is Phase.BACKWARD and e.source is None:
                node = torch._C._current_autograd_node()
                if node is not None:
                    e.source, e.code = _anomaly_source(node)


class StepHooks:
    """Counts the guarded optimizer's steps as ``watch`` does; instruments step ``at`` only."""

    def __init__(self, at: int, skipped: Sequence[int] = ()):
        self.at = at
        self.skipped = set(skipped)
        self.steps = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.root: torch.nn.Module | None = None
        self.tracker: _LiveTracker | None = None
        self.loop: Loop | None = None
        self.snapshot: Any = None
        self.items: list[Any] = []
        self.autocast: str | None = None
        self.losses: list[torch.Tensor] = []
        self.scaled: set[int] = set()
        self.clip: torch.Tensor | None = None
        self.loss: float | None = None
        self.norm: float | None = None
        self.lr: float | None = None
        self.scaler_skipped = False
        self.weights_finite: bool | None = None
        self.measured = False
        self.done = False
        self._in_scaler_step = False
        self._micro = 0
        self._patches: list[Patch] = []
        self._hooks: list[Any] = []
        self._arm_hook: Any = None
        self._anomaly: Any = None

    @property
    def armed(self) -> bool:
        return self.tracker is not None and not self.done

    # -- install / remove --
    def __enter__(self) -> StepHooks:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        try:
            self._hooks.append(register_optimizer_step_pre_hook(self._opt_pre))
            self._hooks.append(register_optimizer_step_post_hook(self._opt_post))
            self._patches.append(Patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward)))
            self._patches.append(Patch(torch.amp.GradScaler, "scale", self._wrap_scale(torch.amp.GradScaler.scale)))
            self._patches.append(Patch(torch.amp.GradScaler, "step", self._wrap_scaler_step(torch.amp.GradScaler.step)))
            clip = self._wrap_clip(torch.nn.utils.clip_grad_norm_)
            self._patches.append(Patch(torch.nn.utils, "clip_grad_norm_", clip))
            self._patches.append(Patch(torch.nn.utils.clip_grad, "clip_grad_norm_", clip))
            if self.at == 0:
                self._wait()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._disarm()
        for p in reversed(self._patches):
            p.undo()
        for h in self._hooks:
            h.remove()
        self._patches, self._hooks = [], []

    # -- arming at step N's first root forward --
    def _wait(self) -> None:
        self._arm_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._module_pre)

    def _module_pre(self, module: torch.nn.Module, args: tuple) -> None:
        if self.done or not torch.is_grad_enabled():
            return
        if self.tracker is None:
            if self._is_root(module):
                self._arm(module, args)
        elif module is self.root and self.tracker.phase is Phase.BACKWARD:   # the next micro-batch
            self._micro += 1
            self.tracker.set_phase(Phase.FORWARD)
            self.tracker.set_micro(self._micro, _batch_size(args), self._micro + 1)
            self.items.append(batch_of(args, {}, autocast_dtype(module)))

    def _is_root(self, module: torch.nn.Module) -> bool:
        """The first module called with gradients enabled that holds the guarded optimizer's parameters (before
        step 0's update the optimizer is not known yet: one with trainable parameters)."""
        opt = self.optimizer
        if opt is None:
            return any(p.requires_grad for p in module.parameters())
        wanted = {id(p) for g in opt.param_groups for p in g["params"]}
        return any(id(p) in wanted for p in module.parameters())

    def _arm(self, root: torch.nn.Module, args: tuple) -> None:
        self.root = root
        self.autocast = autocast_dtype(root)
        self.items.append(batch_of(args, {}, self.autocast))
        opt = self.optimizer
        own = {id(q) for q in root.parameters()}
        use_opt = opt is not None and all(id(q) in own for g in opt.param_groups for q in g["params"])
        precision = {"bfloat16": Precision.BF16, "float16": Precision.FP16}.get(self.autocast, Precision.FP32)
        target = validate({"model": root, "step_fn": ForwardStep(device_of_module(root)), "batches": [],
                           "optimizer": opt if use_opt else None, "precision": precision}, "nanprobe watch --at")
        self.loop = Loop(target, "nanprobe watch --at", precision)
        self.snapshot = self.loop.objects.take()   # the state before step N (the corrupted-state rule reads it)
        low = getattr(torch, self.autocast) if self.autocast else next(
            (p.dtype for p in root.parameters() if p.dtype in (torch.float16, torch.bfloat16)), torch.float16)
        self.tracker = _LiveTracker(root, [opt] if opt is not None else [], low_dtype=low,
                                    batch_size=_batch_size(args))
        self._anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False)   # each node's forward line
        self.tracker.__enter__()
        self.tracker.set_phase(Phase.FORWARD)
        self.tracker._pre_hook(root, args)   # this call: the tracker's own hook came after it started

    def _disarm(self) -> None:
        if self._arm_hook is not None:
            self._arm_hook.remove()
            self._arm_hook = None
        if self.tracker is not None and self.tracker._modes:
            self.tracker.__exit__(None, None, None)
        if self._anomaly is not None:
            self._anomaly.__exit__(None, None, None)
            self._anomaly = None

    # -- the script's calls --
    def _wrap_backward(self, original):
        hooks = self

        def backward(tensors, *args, **kwargs):
            if hooks.armed:
                for t in (tensors if isinstance(tensors, (tuple, list)) else (tensors,)):
                    if isinstance(t, torch.Tensor) and t.numel() == 1 and id(t) not in hooks.scaled:
                        hooks.losses.append(t.detach())
                if hooks.tracker.phase is Phase.FORWARD:
                    hooks.tracker.set_phase(Phase.BACKWARD)
            return original(tensors, *args, **kwargs)
        return backward

    def _wrap_scale(self, original):
        hooks = self

        def scale(scaler, outputs):
            out = original(scaler, outputs)
            if hooks.armed and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
                hooks.scaled.add(id(out))
                hooks.losses.append(outputs.detach())
            return out
        return scale

    def _wrap_clip(self, original):
        hooks = self

        def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
            norm = original(parameters, max_norm, *args, **kwargs)
            if hooks.armed and isinstance(norm, torch.Tensor):
                hooks.clip = norm.detach()
            return norm
        return clip_grad_norm_

    def _wrap_scaler_step(self, original):
        from torch.amp.grad_scaler import OptState
        hooks = self

        def step(scaler, optimizer, *args, **kwargs):
            guarded = not hooks.done and scaler.is_enabled() and \
                (hooks.optimizer is None or optimizer is hooks.optimizer) and "closure" not in kwargs
            if not guarded:
                return original(scaler, optimizer, *args, **kwargs)
            hooks.optimizer = optimizer
            if hooks.steps == hooks.at or hooks.steps in hooks.skipped:
                if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
                    scaler.unscale_(optimizer)   # as watch does: the check sees unscaled gradients
            if hooks.steps in hooks.skipped:
                skip_update([optimizer], scaler)
            if hooks.armed:
                hooks._measure(optimizer, scaler)
            hooks._in_scaler_step = True
            try:
                out = original(scaler, optimizer, *args, **kwargs)
            finally:
                hooks._in_scaler_step = False
            hooks._step_done()
            return out
        return step

    def _opt_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.done:
            return None
        if self.optimizer is None:
            self.optimizer = opt
        if opt is not self.optimizer:
            return None
        if self._in_scaler_step:   # counted (and measured) in GradScaler.step
            if self.armed:
                self._begin_update(opt)
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure):
            return self._wrap_closure(opt, closure, args, kwargs) if self.armed or self.steps in self.skipped \
                else None
        if self.steps in self.skipped:
            skip_update([opt])
        if self.armed:
            self._measure(opt, None)
            self._begin_update(opt)
        return None

    def _wrap_closure(self, opt, closure, args, kwargs):
        hooks = self

        step, first = self.steps, [True]

        def guarded():
            loss = closure()
            if first[0]:   # the step's own evaluation (watch checks it); the line search's come later
                first[0] = False
                if step in hooks.skipped:
                    skip_update([opt])   # watch dropped this step's gradients here: the optimizer stops
                if hooks.armed:
                    hooks._measure(opt, None)
                    hooks._begin_update(opt)
            return loss

        if "closure" in kwargs:
            return args, dict(kwargs, closure=guarded)
        return (args[0], guarded, *args[2:]), kwargs

    def _opt_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.done or opt is not self.optimizer or self._in_scaler_step:
            return
        self._step_done()

    def _step_done(self) -> None:
        step = self.steps
        self.steps += 1
        if self.armed and step == self.at:
            self.done = True
            self._disarm()
            self.weights_finite = weights_finite(self.root)
            raise _Done()
        if self.steps == self.at and self.tracker is None:
            self._wait()   # step N-1's update is over: arm at step N's first forward

    def _measure(self, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        """The step's loss and gradient norm as watch's check reads them (float32 sum of the losses
        backpropagated; the script's clip norm, else the global norm), not seen by the tracker."""
        if self.measured:
            return
        self.measured = True
        tr = self.tracker
        was, tr.active = tr.active, False
        try:
            norm = self.clip if self.clip is not None else total_norm(
                [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None])
            parts = [t.float().reshape(()) for t in self.losses] + ([norm.float().reshape(())] if norm is not None
                                                                     else [])
            values = torch.stack(parts).tolist() if parts else []
            loss = None
            for v in values[:len(self.losses)]:
                loss = v if loss is None else _f32(loss + v)
            self.loss = loss
            self.norm = values[-1] if norm is not None else None
            self.lr = current_lr([opt])
            self.scaler_skipped = scaler is not None and self.norm is not None and not math.isfinite(self.norm)
            if self.tracker.optimizers == [] and opt is not None:
                self.tracker.optimizers = [opt]
        finally:
            tr.active = was

    def _begin_update(self, opt: torch.optim.Optimizer) -> None:
        if self.tracker.phase is Phase.UPDATE:
            return
        if not self.tracker.optimizers:
            self.tracker.optimizers = [opt]
        self.tracker.set_phase(Phase.UPDATE)


def _batch_size(args: tuple) -> int | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return int(a.shape[0])
    return None


# -- the result ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class AtResult:
    """What ``nanprobe watch --at N`` did: the report of step N, where it went, how the script ended."""

    report: Report
    path: Path | None              # the JSON report written in --dir
    json: str | None = None        # --json OUT
    steps: int = 0                 # optimizer steps the rerun reached
    reproduced: bool | None = None

    @property
    def exit_code(self) -> int:
        return self.report.exit_code

    def summary(self) -> str:
        r = self.report
        where = f"; report: {self.path}" if self.path else ""
        if self.reproduced is False:
            return f"nanprobe watch --at {r.step}: not reproduced{where}"
        o = r.origin
        if o is None:
            return f"nanprobe watch --at {r.step}: {r.status.value}, no origin located{where}"
        top = f", cause {r.top.cause.value}" if r.top is not None else ""
        return (f"nanprobe watch --at {r.step}: origin in {o.phase.value}, module {o.module or '(root)'!s}, "
                f"{o.node or o.op}{' at ' + o.source if o.source else ''}{top}{where}")


def watch_at(command: Sequence[str], at: int, *, dirpath: str | os.PathLike = DEFAULT_DIR,
             json_out: str | os.PathLike | None = None, config: Config | None = None) -> AtResult:
    """Re-execute ``python train.py ARGS`` in this process and explain its optimizer step ``at``
    (see the module docstring). The script's output goes where it would; it is stopped after step ``at``."""
    from .run import _script_environment, parse_command
    if isinstance(at, bool) or not isinstance(at, int) or at < 0:
        raise UsageError(f"--at {at!r}", "nanprobe watch", "Give the optimizer step to explain (0, 1, ...), "
                                                           "as watch's log line numbers it")
    kind, target, args = parse_command(command)
    cfg = resolve_config(config, "nanprobe watch")
    if json_out is not None and str(json_out) == "-":
        raise UsageError("--json - would mix the report with the script's output", "--json",
                         "Give a file: --json report.json")
    script_argv = [target, *args]
    found = find_run(dirpath, at, script_argv, command)
    notes: list[str] = []
    expected: dict[str, Any] | None = None
    skipped: list[int] = []
    first: dict[str, Any] = {}
    restored: list[str] = []
    if found is None:
        notes.append(f"no record of a watched run of this command in {dirpath}: the rerun is not compared with "
                     "the watched step, and Python random/numpy start as in any fresh process (run nanprobe watch "
                     "first, with the same --dir)")
    else:
        run_path, run, entry_ = found
        skipped = [int(s) for s in run.get("skipped", []) if int(s) < at]
        state = run.get("start_state")
        if isinstance(state, dict):
            restored = restore_start_state(state)
        else:
            notes.append(f"the watched run's record {run_path} holds no start state: Python random/numpy start as "
                         "in any fresh process")
        if entry_ is None:
            notes.append(f"the watched run ({run_path}) saw no bad step {at}: the rerun is not compared with it")
        else:
            expected = entry_.get("record")
            first = entry_
            notes.append(f"compared with the watched run's record {run_path}")
    hooks = StepHooks(at, skipped)
    script_error = None
    with _script_environment(kind, target, args):
        with hooks:
            try:
                if kind == "script":
                    runpy.run_path(target, run_name="__main__")
                else:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
            except _Done:
                pass
            except SystemExit:
                pass
            except BaseException as exc:  # noqa: BLE001 - the script's own error, printed as Python does
                traceback.print_exc()
                script_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    try:
        report, reproduced = _report(hooks, at, command, expected, first, cfg, notes, restored, script_error)
    finally:
        if hooks.snapshot is not None:
            hooks.snapshot.release()
    data = report.to_json()
    data["watch"] = {"at": at, "argv": script_argv, "command": list(command), "python_random_restored": restored,
                     "skipped_before": skipped, "steps_reached": hooks.steps}
    path = _write(data, dirpath, at)
    written = None
    if json_out is not None:
        Path(json_out).write_text(dumps(data) + "\n")
        written = str(json_out)
    return AtResult(report=report, path=path, json=written, steps=hooks.steps, reproduced=reproduced)


def _write(data: dict[str, Any], dirpath: str | os.PathLike, at: int) -> Path | None:
    folder = Path(dirpath)
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for attempt in range(1000):
            path = folder / f"at-step{at:07d}-{stamp}-{os.getpid()}{'-' + str(attempt) if attempt else ''}.json"
            try:
                with open(path, "x") as fh:
                    fh.write(dumps(data) + "\n")
                return path
            except FileExistsError:
                continue
    except OSError:
        return None
    return None


def _kind(x: Any) -> str | float | None:
    if x is None:
        return None
    if isinstance(x, str):
        return x if x in ("nan", "inf", "-inf") else float(x)
    x = float(x)
    return _num(x) if not math.isfinite(x) else x


def _matches(expected: Any, got: float | None, rtol: float) -> bool:
    a, b = _kind(expected), _kind(got)
    if a is None or b is None:
        return True   # not measured on one side: nothing to compare
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-30)


def _status_of(loss: float | None, norm: float | None, weights_ok: bool | None, skipped: bool) -> Status:
    finite = (loss is None or math.isfinite(loss)) and (norm is None or math.isfinite(norm) or skipped)
    return Status.NONFINITE if not finite or weights_ok is False else Status.FINITE


def _report(hooks: StepHooks, at: int, command: Sequence[str], expected: dict[str, Any] | None,
            first: dict[str, Any], cfg: Config, notes: list[str], restored: list[str],
            script_error: str | None) -> tuple[Report, bool | None]:
    from ..diagnose import _context, _event_json, autocast_policy, check_data, mark_masked, origin_of
    from ..precision import device_of
    from ..rerun import StepTrace

    entry = shlex.join(command)
    first_status = Status(first["status"]) if first.get("status") in {s.value for s in Status} else None
    reason = first.get("reason")
    what = "; restored at the start: " + ", ".join(restored) if restored else ""
    reached_by = f"nanprobe watch --at {at}: the script re-executed in-process, step {at} instrumented{what}"
    partial = not hooks.done and script_error is not None and hooks.tracker is not None \
        and bool(hooks.tracker.trace.events)
    if partial:   # the script raised inside step N after a non-finite value was born (its own NaN check)
        notes.insert(0, f"the script raised during step {at} ({script_error}): the report is built from the ops "
                        "it ran before that")
    if not hooks.done and not partial:
        why = f"the script raised before step {at} ended ({script_error})" if script_error else \
            f"the script ended after {hooks.steps} optimizer step(s), before step {at} ended"
        rows = [f"not reproduced: {why}",
                *([f"the watched run saw {reason} at step {at}"] if reason else []),
                "the script takes another path when re-executed (arguments, files it reads or writes, the "
                "time, unseeded generators other than Python random/numpy/torch, its data order)"]
        return _not_reproduced(at, entry, first_status, rows, notes, reached_by, device=None), False
    root = hooks.root
    device = device_of(root)
    prec = hooks.loop.precision
    rec = StepRecord(step=at, loss=hooks.loss, grad_norm=hooks.norm, lr=hooks.lr, update_ratio=None,
                     finite=_status_of(hooks.loss, hooks.norm, hooks.weights_finite, hooks.scaler_skipped)
                     is Status.FINITE, skipped=hooks.scaler_skipped)
    got = {"loss": _num(hooks.loss), "grad_norm": _num(hooks.norm), "weights_nonfinite": not hooks.weights_finite}
    reproduced: bool | None = None
    reasons: list[str] = []
    rtol = 1e-4
    if expected is not None and not hooks.measured:
        notes.append(f"not compared with the watched run: the script did not reach step {at}'s optimizer step")
    elif expected is not None:
        mismatches = []
        for key in ("loss", "grad_norm"):
            if not _matches(expected.get(key), getattr(hooks, "loss" if key == "loss" else "norm"), rtol):
                mismatches.append(f"{key.replace('_', ' ')} {expected.get(key)} in the watched run, "
                                  f"{_num(getattr(hooks, 'loss' if key == 'loss' else 'norm'))} now")
        if expected.get("weights_nonfinite") and hooks.weights_finite:
            mismatches.append("the watched step's update made the weights non-finite, the rerun's did not")
        reproduced = not mismatches
        if mismatches:
            reasons = mismatches
    fidelity = Fidelity(reproduced=reproduced, tolerance=f"rtol {rtol:g}", replayed=dict(expected or {}),
                        reruns=({"rerun": "watch --at (the script's own step, instrumented)", **got,
                                 "match": reproduced},), reasons=tuple(reasons))
    if reproduced is False:
        rows = [f"not reproduced: at step {at} the rerun differs from the watched run: " + "; ".join(reasons),
                *([f"the watched run saw {reason} at step {at}"] if reason else []),
                "the script is not deterministic when re-executed: something it reads changed (files, the time, "
                "arguments) or a generator other than Python random/numpy/torch's default is unseeded (a "
                "DataLoader's workers' own seeds, torch.Generator() objects, os.urandom, hash order with "
                "PYTHONHASHSEED unset), or threads/nondeterministic kernels",
                "what to do: seed everything at the script's start, or write an ENTRY with your loss_fn and run "
                f"nanprobe run ENTRY --capsule <the watched run's capsule> (the capsule holds step {at}'s exact "
                "state)"]
        return _not_reproduced(at, entry, first_status, rows, notes, reached_by, device=device,
                               fidelity=fidelity), False
    trace = hooks.tracker.trace
    main = StepTrace(precision=prec, record=rec, trace=trace)
    status = _status_of(hooks.loss, hooks.norm, hooks.weights_finite, hooks.scaler_skipped)
    if first_status is not None and first_status is not Status.FINITE:
        status = first_status if status is Status.FINITE or first_status is Status.NONFINITE else status
    history = [StepRecord(step=h["step"], loss=_float(h.get("loss")), grad_norm=_float(h.get("grad_norm")),
                          lr=_float(h.get("lr")), update_ratio=_float(h.get("update_ratio")),
                          finite=bool(h.get("finite", True)), skipped=bool(h.get("skipped", False)))
               for h in first.get("history", []) if isinstance(h, dict) and isinstance(h.get("step"), int)
               and h["step"] < at]   # the watched run's last steps before N
    reached = Reached(step=at, recorded=Recorded(step=at, items=hooks.items, rng_after=[], position=None),
                      snapshot=hooks.snapshot, loop=hooks.loop, precision=prec, status=status,
                      reason=reason or (f"step {at} is {status.value}" if status is not Status.FINITE else None),
                      record=rec, history=history, reached_by=reached_by, **scheduler_info(hooks.loop.target))
    data = check_data(reached, hooks.loop.target, prec, cfg)
    mark_masked(main)
    ev = Evidence(reached=reached, main=main, reference=None, probe=None, others={}, data=data, cfg=cfg.run,
                  entry=entry)
    findings, _ = mechanism_findings(classify(ev), trend=None, status=status, step=at, breakaway=None,
                                     ranges=trace.ranges, prec=prec,
                                     origin_module=main.origin.module if main.origin else None)
    findings = attach(findings, ev, None)
    skip_note = scaler_skip_note(ev)   # GradScaler's normal skip: the scale overflowed, not the model
    if skip_note:
        notes.append(skip_note)
    elif status is Status.FINITE and (trace.events or any(p.level == "error" for p in data)):
        status = Status.NONFINITE   # as run: a non-finite value born in the step (masked or not), bad data
    findings = [_relabel_finding(f) for f in findings]
    if findings and any(fx.verified is None for f in findings[:1] for fx in f.fixes):
        notes.append(f"fixes not verified: verifying a fix trains forward with it over a horizon, which needs "
                     f"your loss_fn; write an ENTRY (see README, 'The entrypoint') and run nanprobe run ENTRY "
                     f"--at {at} to verify them")
    if script_error is None and hooks.scaler_skipped:
        notes.append(f"GradScaler skipped the update of step {at} (non-finite gradients): no update phase ran")
    origin = None if skip_note else origin_of(main.origin, prec.value)
    if origin is not None and origin.module == LOSS_FN:
        origin = dataclasses.replace(origin, module=OUTSIDE)
    report = Report(command="watch", entry=entry, step=at, status=status, device=describe_device(device),
                    precision=prec.value, origin=origin, findings=tuple(findings),
                    precisions={prec.value: PrecisionResult(precision=prec.value, loss=rec.loss,
                                                            finite=rec.finite and not trace.events,
                                                            origin=origin, grad_norm=rec.grad_norm)},
                    context=_context(main, cfg.run.context_modules), history=tuple(history) + (rec,),
                    notes=tuple(notes), autocast_policy=autocast_policy(device, prec),
                    reached_by=reached_by, fidelity=fidelity,
                    extra={"data_problems": [p.to_json() for p in data],
                           "events": [_event_json(e) for e in trace.events]})
    return report, reproduced


def _float(x: Any) -> float | None:
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _relabel_finding(f: Finding) -> Finding:
    if f.module != LOSS_FN:
        return f
    return dataclasses.replace(f, module=OUTSIDE)


def _not_reproduced(at: int, entry: str, first_status: Status | None, rows: list[str], notes: list[str],
                    reached_by: str, *, device: torch.device | None, fidelity: Fidelity | None = None) -> Report:
    finding = Finding(cause=Cause.NOT_REPRODUCED, confidence=0.9, phase=Phase.FORWARD, module=None, op=None,
                      evidence=tuple(rows))
    status = first_status if first_status is not None and first_status is not Status.FINITE else Status.NONFINITE
    return Report(command="watch", entry=entry, step=at, status=status,
                  device=describe_device(device) if device is not None else "cpu", precision="fp32",
                  findings=(finding,), notes=(rows[0], *notes), reached_by=reached_by, fidelity=fidelity)


def unlocated_step(events: Sequence[Any]) -> int | None:
    """The first bad step of a watched run whose report locates no origin (born in backward or update)."""
    for e in events:
        if not e.report:
            continue
        try:
            data = json.loads(Path(e.report).read_text())
        except (OSError, ValueError):
            continue
        top = (data.get("findings") or [{}])[0]
        if data.get("origin") is None and data.get("status") != Status.FINITE.value \
                and top.get("cause") != Cause.DATA.value:   # a data finding says where it came from
            return e.step
    return None


def explain(events: Sequence[Any], command: Sequence[str], *, dirpath: str | os.PathLike = DEFAULT_DIR,
            config: str | os.PathLike | None = None) -> tuple[str | None, Path | None]:
    """``watch --explain``: after the watched run, the first bad step it did not locate is explained by
    ``nanprobe watch --at N`` in a fresh interpreter (the script starts as it did: its start state is
    restored from --dir). Returns the line for the summary and the --at report (None when nothing to do)."""
    import subprocess
    import tempfile

    step = unlocated_step(events)
    if step is None:
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "at.json"
        argv = [sys.executable, "-m", "nanprobe.cli", "watch", "--at", str(step), "--dir", str(dirpath),
                "--json", str(out), *(["--config", str(config)] if config is not None else []), "--", *command]
        done = subprocess.run(argv, check=False)
        try:
            data = json.loads(out.read_text())
        except (OSError, ValueError):
            return (f"nanprobe watch --explain: step {step} was not located in-process; "
                    f"{at_command(step, command, dirpath)} failed (exit code {done.returncode})"), None
    path = max(Path(dirpath).glob(f"at-step{step:07d}-*.json"), key=lambda p: p.stat().st_mtime, default=None)
    o = data.get("origin")
    what = "not reproduced" if (data.get("fidelity") or {}).get("reproduced") is False or o is None and any(
        f.get("cause") == Cause.NOT_REPRODUCED.value for f in data.get("findings", [])) else \
        (f"origin in {o['phase']}, module {o['module'] or '(root)'}, {o.get('node') or o['op']}" if o else
         "no origin located")
    return (f"nanprobe watch --explain: step {step} was not located in-process, so the script was re-executed with "
            f"step {step} instrumented ({at_command(step, command, dirpath)}): {what}"
            + (f"; report: {path}" if path else "")), path


__all__ = ["watch_at", "explain", "unlocated_step", "AtResult", "StepHooks", "at_command", "start_state",
           "restore_start_state", "write_run_record", "find_run", "record_json", "RUN_SUFFIX"]
