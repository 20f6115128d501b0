"""Fix verification over a horizon: a fix is verified when it holds for the rest of the run.

A fix is applied from outside the user's code (a :class:`Remedy`) and trained forward from the
state before the onset (the top finding's ``onset``; else the state before the failing step N)
through N + ``horizon.margin`` steps, on the same batches as the unfixed run. The horizon fails
on a non-finite value or a spike (the replay's :class:`~nanprobe.divergence.Judge`) and on a slow
divergence (the loss leaves its best level and does not come back). A fix that fails with a
non-finite value gets its new origin from one instrumented rerun of the failing step.

The state before N is the replay's own; a state before an earlier onset is reached by building
the target again and replaying it to the onset (once per diagnosis). The unfixed run is trained
only where the replay does not already say how it went: up to its first non-finite step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .config import Config
from .divergence import Judge
from .errors import NanprobeError, UserCodeError
from .feed import DataEnd, Recorded, Stream
from .precision import Precision, device_of
from .replay import Reached, Replayer, measure
from .report import Fix, Status, StepRecord
from .rerun import _fp32_island, _scaler_for, run_step
from .state import RngTracker, Snapshot
from .step import RunOptions


# -- what a fix changes, applied from outside the user's code ---------------------------------------

@dataclass(frozen=True, slots=True)
class Remedy:
    """A fix as changes nanprobe can make to every step of a horizon without editing the user's code."""

    precision: Precision | None = None              # train in this precision instead
    fp32_modules: tuple[str, ...] = ()              # run these modules in float32 inside autocast
    max_grad_norm: float | None = None              # clip the global gradient norm at this
    lr_scale: float | None = None                   # multiply the LR the scheduler sets
    warmup: int | None = None                       # ... and by min(1, (step + 1) / warmup)
    param_overrides: tuple[tuple[str, Any], ...] = ()   # optimizer group keys, e.g. (("eps", 1e-8),)
    z_loss: tuple[str, float] | None = None         # (output module, coefficient): + c * logsumexp(logits)^2
    qk_norm: tuple[str, ...] = ()                   # attention modules whose q and k are layer-normalised

    def describe(self) -> str:
        parts = []
        if self.precision is not None:
            parts.append(self.precision.value)
        if self.fp32_modules:
            parts.append(f"fp32 {', '.join(self.fp32_modules)}")
        if self.max_grad_norm is not None:
            parts.append(f"clip {self.max_grad_norm:g}")
        if self.lr_scale is not None:
            parts.append(f"LR x{self.lr_scale:g}")
        if self.warmup is not None:
            parts.append(f"warmup {self.warmup}")
        parts += [f"{k}={v}" for k, v in self.param_overrides]
        if self.z_loss is not None:
            parts.append(f"z-loss {self.z_loss[1]:g} on {self.z_loss[0]}")
        if self.qk_norm:
            parts.append(f"qk-norm in {', '.join(self.qk_norm)}")
        return ", ".join(parts) or "no change"

    def combine(self, other: Remedy) -> Remedy | None:
        """Both changes at once; None where they set the same thing differently."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, tuple) and f.name != "z_loss":
                out[f.name] = tuple(dict.fromkeys(a + b))
            elif a is not None and b is not None and a != b:
                return None
            else:
                out[f.name] = a if a is not None else b
        if len({k for k, _ in out["param_overrides"]}) < len(out["param_overrides"]):
            return None
        return Remedy(**out)

    def lr_at(self, step: int) -> float | None:
        scale = self.lr_scale
        if self.warmup:
            scale = (scale or 1.0) * min(1.0, (step + 1) / self.warmup)
        return scale

    def options(self, precision: Precision, policy: str, loop, step: int) -> RunOptions:
        prec = self.precision or precision
        return RunOptions(precision=prec, policy=policy, max_grad_norm=self.max_grad_norm,
                          lr_scale=self.lr_at(step), param_overrides=dict(self.param_overrides) or None,
                          scaler=_scaler_for(loop, prec, None, None))

    @contextlib.contextmanager
    def applied(self, target) -> Iterator[list[torch.Tensor]]:
        """The changes that live in the model (fp32 island, qk-norm, z-loss) for the ``with`` body.

        Yields the list the z-loss hook appends each step's added term to (to report the loss
        without it)."""
        added: list[torch.Tensor] = []
        with contextlib.ExitStack() as stack:
            if self.fp32_modules:
                stack.enter_context(_fp32_island(target.model, self.fp32_modules))
            if self.qk_norm:
                stack.enter_context(_qk_norm(target.model, self.qk_norm))
            if self.z_loss is not None:
                stack.enter_context(_z_loss(target, *self.z_loss, added))
            yield added

    def why_not(self, target) -> str | None:
        """Why this remedy cannot be applied to ``target`` from outside (None: it can)."""
        if self.z_loss is not None and target.loss_fn is None:
            return "z-loss is added to the loss, and your step_fn computes its own"
        names = {n for n, _ in target.model.named_modules()}
        missing = [m for m in (*self.fp32_modules, *self.qk_norm, *((self.z_loss[0],) if self.z_loss else ()))
                   if m not in names]
        if missing:
            return f"no module {missing[0]!r} in the model"
        return None


def _unit(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """LayerNorm without affine parameters over ``dim`` (qk-layernorm's normalisation)."""
    if dim in (-1, t.dim() - 1):
        return F.layer_norm(t, t.shape[-1:]).to(t.dtype)
    return F.layer_norm(t.transpose(dim, -1), t.shape[dim:dim + 1]).transpose(dim, -1).to(t.dtype)


_SDPA = F.scaled_dot_product_attention
_MATMULS = {torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm}


class _QKNormMode(TorchFunctionMode):
    """Inside an attention module's forward: layer-normalise q and k where attention is computed.

    ``F.scaled_dot_product_attention(q, k, v)`` gets normalised q and k; a hand-written attention's
    first batched matmul of two >= 3-D operands is ``q @ k^T``: q over its last dim, k^T over the
    head dim (its second-to-last)."""

    def __init__(self):
        super().__init__()
        self.pending = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA and len(args) >= 2:
            args = (_unit(args[0]), _unit(args[1])) + tuple(args[2:])
        elif self.pending and func in _MATMULS and len(args) >= 2 and all(
                isinstance(a, torch.Tensor) and a.dim() >= 3 for a in args[:2]):
            self.pending = False
            args = (_unit(args[0]), _unit(args[1], -2)) + tuple(args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _qk_norm(model: torch.nn.Module, names: tuple[str, ...]):
    modes: list[_QKNormMode] = []

    def pre(mod, args):
        mode = _QKNormMode()
        mode.__enter__()
        modes.append(mode)

    def post(mod, args, out):
        modes.pop().__exit__(None, None, None)

    handles = []
    for name, module in model.named_modules():
        if name in names:
            handles += [module.register_forward_pre_hook(pre),
                        module.register_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _z_loss(target, name: str, coef: float, added: list[torch.Tensor]):
    """coef * mean(logsumexp(logits)^2) over the output module's logits, added to the user's loss."""
    module = target.model.get_submodule(name)
    terms: list[torch.Tensor] = []

    def hook(mod, args, out):
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            terms.append(coef * torch.logsumexp(out.float(), dim=-1).pow(2).mean())

    original = target.loss_fn

    def loss_fn(model, batch):
        terms.clear()
        loss = original(model, batch)
        if terms and isinstance(loss, torch.Tensor):
            z = torch.stack(terms).sum()
            added.append(z.detach())
            return loss + z.to(loss.dtype)
        return loss

    handle = module.register_forward_hook(hook)
    target.loss_fn = loss_fn
    try:
        yield
    finally:
        target.loss_fn = original
        handle.remove()


# -- slow divergence --------------------------------------------------------------------------------

def _breakaway(losses: list[tuple[int, float]]) -> int | None:
    """TEMPORARY, replaced by ``nanprobe.divergence.breakaway`` (issue 16, the other half) at merge.

    The step where the loss (a running median of 5) rose 10% above its best level so far and
    stayed above it through the last step, for at least 5 steps; None when it did not.
    """
    width, rise, last = 5, 0.10, 5
    if len(losses) < width + last:
        return None
    values = [v for _, v in losses]
    smooth = [statistics.median(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]
    best = math.inf
    bests = []
    for s in smooth:
        best = min(best, s)
        bests.append(best)
    start = None
    for i in range(width, len(smooth)):
        above = smooth[i] > bests[i] + rise * abs(bests[i])
        if above and start is None:
            start = i
        elif not above:
            start = None
    if start is not None and len(smooth) - start >= last:
        return losses[start][0]
    return None


# -- one horizon ------------------------------------------------------------------------------------

@dataclass(slots=True)
class Run:
    """One training run over the horizon (fixed or not)."""

    losses: list[tuple[int, float]] = field(default_factory=list)   # (step, loss) while finite
    failed_at: int | None = None
    reason: str | None = None
    error: str | None = None            # the run itself could not train (the user's code raised)
    new_origin: dict[str, Any] | None = None
    steps: int = 0                      # steps trained
    seconds: float = 0.0

    @property
    def last(self) -> int | None:
        return self.losses[-1][0] if self.losses else None


def _tail_mean(losses: list[tuple[int, float]], upto: int | None = None, n: int = 5) -> float | None:
    vals = [v for k, v in losses if upto is None or k <= upto][-n:]
    return sum(vals) / len(vals) if vals else None


class Horizon:
    """Steps ``start``..``end`` from one saved state, trained once per remedy on the same batches."""

    def __init__(self, loaded, reached: Reached, cfg: Config, start: int, *,
                 progress: Callable[[str], None] = lambda msg: None):
        self.cfg, self.reached, self.progress = cfg, reached, progress
        self.failing = reached.step
        self.start = start
        self.end = reached.step + cfg.horizon.margin
        self.where = loaded.where
        self.precision, self.policy = reached.precision, reached.policy
        self.recorded: dict[int, Recorded] = {}
        self.notes: list[str] = []
        self.data_end: int | None = None          # the last step the data reaches, once seen
        self.setup_seconds = 0.0
        t0 = time.perf_counter()
        if start == reached.step:
            self.target, self.loop, self.snapshot = reached.loop.target, reached.loop, reached.snapshot
            self.prefix = list(reached.history)
            self.recorded[start] = reached.recorded
            self.rng = RngTracker(self.loop.device_type)
            self.stream = Stream(self.target, self.rng, record=False)
            try:
                self.stream.skip(start + 1)
            except DataEnd:
                self.data_end = start
            self.stream.record = True
            self._own_snapshot = False
        else:
            self._replay_to(loaded, start)
            self._own_snapshot = True
        self.setup_seconds = time.perf_counter() - t0

    def _replay_to(self, loaded, start: int) -> None:
        """Build the target again and replay it to ``start`` (the state before the onset)."""
        from .entry import load_target
        device = device_of(self.reached.loop.target.model)
        fresh = load_target(loaded.entry, device=None if device.type == "cpu" else str(device))
        self.progress(f"replaying to step {start} (the onset) for the horizon")
        r = Replayer(fresh.target, precision=self.precision, cfg=self.cfg.replay, where=self.where,
                     policy=self.policy)
        history: list[StepRecord] = []
        for k in range(start):
            _, record, _, _ = r.run(r.stream.open(k))
            history.append(record)
        self.target, self.loop, self.stream, self.rng = fresh.target, r.loop, r.stream, r.rng
        self.loop.precision = self.precision
        self.snapshot = self.loop.objects.take()
        self.prefix = history[-self.cfg.replay.spike_window:]
        self.check_same([(h.step, h.loss) for h in history])

    def check_same(self, losses: list[tuple[int, float | None]]) -> None:
        """The steps the replay also ran must give the same losses (else the horizon is another run)."""
        known = {h.step: h.loss for h in self.reached.history}
        for step, loss in losses:
            want = known.get(step)
            if want is not None and loss is not None and not math.isclose(want, loss, rel_tol=1e-4):
                self.notes.append(f"the horizon's unfixed run does not reproduce the replay (loss {loss:.4g} "
                                  f"vs {want:.4g} at step {step}): building the target again gave another run")
                return

    def known_unfixed(self) -> Run | None:
        """The unfixed run where the replay already says how it went: every step from the start to a
        non-finite failing step is in its history (nothing past a non-finite step is worth training)."""
        r = self.reached
        steps = {h.step: h for h in r.history}
        if r.status is not Status.NONFINITE or r.record is None or any(k not in steps
                                                                      for k in range(self.start, r.step)):
            return None
        return Run(losses=[(k, steps[k].loss) for k in range(self.start, r.step)], failed_at=r.step,
                   reason=r.reason, steps=0)

    def close(self) -> None:
        self.stream.close()
        if self._own_snapshot:
            self.snapshot.release()

    # -- training ---------------------------------------------------------------------------------
    def _feed(self, k: int):
        rec = self.recorded.get(k)
        if rec is not None:
            return rec.feed(), False
        if self.data_end is not None and k > self.data_end:
            return None, False
        try:
            return self.stream.open(k), True
        except DataEnd:
            self.data_end = k - 1
            return None, False

    def _step(self, k: int, options: RunOptions):
        feed, live = self._feed(k)
        if feed is None:
            return None
        self.rng.begin_step()
        try:
            outcome = self.loop.run(feed, options)
        finally:
            self.rng.end_step()
        if live:
            self.recorded[k] = Recorded.of(feed)
        return outcome

    def run(self, remedy: Remedy | None) -> Run:
        """Train the horizon with ``remedy`` (None: unfixed) from the saved state."""
        remedy = remedy or Remedy()
        out = Run()
        t0 = time.perf_counter()
        self.snapshot.restore(self.loop.objects)
        judge = Judge(self.cfg.replay)
        for rec in self.prefix:
            judge.add(rec)
        every = max(self.cfg.horizon.snapshot_every, 1)
        rolling: Snapshot | None = None
        rolling_at = self.start
        name_origin = False
        try:
            with remedy.applied(self.target) as added:
                for k in range(self.start, self.end + 1):
                    if (k - self.start) % every == 0:
                        rolling, rolling_at = self.loop.objects.take(reuse=rolling), k
                    outcome = self._step(k, remedy.options(self.precision, self.policy, self.loop, k))
                    if outcome is None:
                        break
                    if not outcome.precision_applied:
                        out.error = (f"{remedy.precision.value if remedy.precision else 'the precision'} could not be "
                                     "applied: your step_fn enters no torch.autocast for nanprobe to rewrite")
                        break
                    out.steps += 1
                    record, _, params_finite = measure(self.loop, outcome, k)
                    if added:
                        z = float(torch.stack(added).sum())
                        added.clear()
                        if record.loss is not None:
                            record = dataclasses.replace(record, loss=record.loss - z)
                    status, reason = judge.judge(record, params_finite)
                    if status is not Status.FINITE:
                        out.failed_at, out.reason = k, reason
                        name_origin = status is Status.NONFINITE and remedy != Remedy()
                        break
                    judge.add(record)
                    out.losses.append((k, record.loss))
            if name_origin and rolling is not None:
                out.new_origin = self._origin(remedy, out.failed_at, rolling, rolling_at)
        except UserCodeError as exc:
            out.error = exc.message
        finally:
            if rolling is not None:
                rolling.release()
        out.seconds = time.perf_counter() - t0
        if out.failed_at is None and out.error is None:
            slow = _breakaway(out.losses)
            if slow is not None:
                out.failed_at, out.reason = slow, "the loss left its best level and did not come back"
        return out

    def _origin(self, remedy: Remedy, k: int, rolling: Snapshot, at: int) -> dict[str, Any] | None:
        """The op that went non-finite at step ``k`` with the remedy: one instrumented rerun of that step."""
        self.progress(f"rerunning step {k} instrumented (where the fix failed)")
        rolling.restore(self.loop.objects)
        with remedy.applied(self.target):
            for j in range(at, k):
                self._step(j, remedy.options(self.precision, self.policy, self.loop, j))
        before = self.loop.objects.take()
        try:
            at_k = Reached(step=k, recorded=self.recorded[k], snapshot=before, loop=self.loop,
                           precision=remedy.precision or self.precision, status=Status.NONFINITE, reason=None,
                           record=None, policy=self.policy)
            with remedy.applied(self.target):
                t = run_step(self.target, at_k, at_k.precision, where=self.where, tolerate_errors=True,
                             restore_after=False, max_grad_norm=remedy.max_grad_norm, lr_scale=remedy.lr_at(k),
                             param_overrides=dict(remedy.param_overrides) or None, ratios=False)
        finally:
            before.release()
        e = t.origin
        if e is None:
            return None
        return {"module": e.module, "op": e.op, "phase": e.phase.value, "kind": e.kind}


# -- verdicts ---------------------------------------------------------------------------------------

def _fmt(x: float | None) -> str:
    return "nan" if x is None else f"{x:.3g}"


def verdict(h: Horizon, fixed: Run, unfixed: Run) -> tuple[bool | None, str, dict[str, Any]]:
    """(verified, note, verification) of one fix's run against the unfixed one."""
    stop = h.end if h.data_end is None else min(h.end, h.data_end)   # the data may end first
    info: dict[str, Any] = {"horizon": stop - h.start + 1, "from_step": h.start, "to_step": stop,
                            "steps": fixed.steps, "held": False, "failed_at": fixed.failed_at,
                            "loss_fixed": None, "loss_unfixed": None, "unfixed_failed_at": unfixed.failed_at,
                            "new_origin": fixed.new_origin}
    if fixed.error is not None:
        info["error"] = fixed.error
        return None, f"could not train the horizon with it: {fixed.error}", info
    if fixed.failed_at is not None:
        info["reason"] = fixed.reason
        info["loss_fixed"] = _tail_mean(fixed.losses, fixed.failed_at)
        where = ""
        o = fixed.new_origin
        if o:
            where = f": new origin {o['phase']} {o['module'] or 'model'} {o['op']}" + (f" ({o['kind']})" if o["kind"]
                                                                                     else "")
        else:
            where = f": {fixed.reason}"
        return False, f"failed at step {fixed.failed_at}{where}", info
    last = fixed.last
    if last is None or last <= h.failing:
        return None, (f"trained only to step {last} (the data ends there): a rerun of step {h.failing} alone "
                      "does not show that a fix holds"), info
    info["held"] = True
    info["loss_fixed"] = _tail_mean(fixed.losses)
    covered = unfixed.last is not None and unfixed.last >= last   # the unfixed run trained the same steps
    info["loss_unfixed"] = _tail_mean(unfixed.losses, last) if covered else None
    if not covered:
        versus = f"unfixed: {unfixed.reason or 'failed'} at step {unfixed.failed_at}"
    elif unfixed.failed_at is not None:
        versus = f"{_fmt(info['loss_unfixed'])} unfixed, which diverged from step {unfixed.failed_at}"
    else:
        versus = f"{_fmt(info['loss_unfixed'])} unfixed"
    return True, f"held for {fixed.steps} steps, to step {last} (loss {_fmt(info['loss_fixed'])} vs {versus})", info


def horizon_start(reached: Reached, onset: int | None, cfg: Config) -> int:
    """The first step of the horizon: the onset where the replay reached it, else the failing step."""
    n = reached.step
    if onset is None or onset >= n or not reached.reached_by.startswith("replay from step 0"):
        return n
    return max(onset, n - max(cfg.horizon.max_lookback, 0))


def verify_over_horizon(loaded, reached: Reached, onset: int | None, candidates: list[tuple[Fix, Remedy | None]],
                        cfg: Config, progress: Callable[[str], None] = lambda msg: None,
                        timings: dict[str, Any] | None = None) -> list[Fix]:
    """Each candidate fix with its verdict: up to ``horizon.max_fixes`` automated fixes are trained over
    the horizon in rank order; when none held, the top two together. The rest say why not."""
    if reached.error is not None:
        return [dataclasses.replace(f, verify_note="not verified: the step raised (train past it first)")
                if r is not None else f for f, r in candidates]
    start = horizon_start(reached, onset, cfg)
    try:
        h = Horizon(loaded, reached, cfg, start, progress=progress)
    except NanprobeError as exc:
        if start == reached.step:
            return [dataclasses.replace(f, verify_note=f"not verified: the horizon could not start ({exc})")
                    if r is not None else f for f, r in candidates]
        h = Horizon(loaded, reached, cfg, reached.step, progress=progress)   # the state the replay holds
        h.notes.append(f"the horizon starts at the failing step: reaching the onset {start} failed ({exc})")
    out: list[Fix] = []
    try:
        unfixed = h.known_unfixed()
        if unfixed is None:
            progress(f"training the horizon, steps {h.start}-{h.end}, unfixed")
            unfixed = h.run(None)
            h.check_same(unfixed.losses)
        tried: list[tuple[Fix, Remedy]] = []
        budget = max(cfg.horizon.max_fixes, 0)
        runs: dict[Remedy, Run] = {}
        for fix, remedy in candidates:
            if remedy is None:
                out.append(dataclasses.replace(fix, verify_note=fix.verify_note or
                                               "not verified: it changes your code in a way nanprobe cannot apply "
                                               "from outside"))
                continue
            why = remedy.why_not(h.target)
            if why is not None:
                out.append(dataclasses.replace(fix, verify_note=f"not verified: {why}"))
                continue
            if remedy not in runs and len(runs) >= budget:
                out.append(dataclasses.replace(fix, verify_note=f"not verified: {budget} fixes were trained over the "
                                               "horizon (horizon.max_fixes)"))
                continue
            if remedy not in runs:
                progress(f"training the horizon with {remedy.describe()}")
                runs[remedy] = h.run(remedy)
            verified, note, info = verdict(h, runs[remedy], unfixed)
            out.append(dataclasses.replace(fix, verified=verified, verify_note=note, verification=info))
            tried.append((fix, remedy))
        held = any(f.verified for f in out)
        if not held and len(tried) >= 2 and len(runs) < budget + 1:
            (fa, ra), (fb, rb) = tried[0], tried[1]
            both = ra.combine(rb)
            if both is not None and both not in runs:
                progress(f"training the horizon with {both.describe()}")
                runs[both] = h.run(both)
                verified, note, info = verdict(h, runs[both], unfixed)
                code = f"# 1. {fa.title}\n{fa.code}\n\n# 2. {fb.title}\n{fb.code}"
                out.append(Fix(title=f"Both: {fa.title[0].lower()}{fa.title[1:]}; and {fb.title[0].lower()}"
                                     f"{fb.title[1:]}", code=code, why="neither held alone over the horizon",
                               verified=verified, verify_note=note, verification=info))
        if timings is not None:
            timings.update(setup=h.setup_seconds, unfixed=unfixed.seconds, unfixed_steps=unfixed.steps,
                           fixes=[(r.describe(), run.seconds, run.steps) for r, run in runs.items()])
        if h.notes:
            out = [dataclasses.replace(f, verify_note=f"{f.verify_note}; {h.notes[0]}")
                   if f.verification is not None else f for f in out]
    finally:
        h.close()
    return out


__all__ = ["Remedy", "Horizon", "Run", "verify_over_horizon", "horizon_start", "verdict"]
