"""compare-precisions: run every precision from the same state, then results, layers and the recommendation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch

from ..base.batch import iter_tensors
from ..base.config import CompareConfig, Config, load_config
from ..pipeline.diagnose import origin_of, update_in_question
from ..reach.entry import Loaded, load_target
from ..base.errors import UsageError
from ..locate.instrument import Event, Probe
from ..base.precision import Precision, describe_device, device_of, emulate_fp16_matmuls
from ..reach.replay import NoBadStep, Reached, reach, storage_policy
from ..base.report import Phase
from ..locate.rerun import run_step
from ..reach.state import StoragePolicy, borrows_globals
from .measure import _Capture, _input_underflow, _OpProbe, _OriginProbe, _Run, _Store
from .records import _RUNS, Comparison, ScalerResult, parse_precisions
from .summarize import _disagreements, _layers, _rank, _recommend, _results


class _Comparer:
    def __init__(self, loaded: Loaded, reached: Reached, cfg: CompareConfig, progress: Callable[[str], None],
                 storage: StoragePolicy):
        self.loaded, self.target, self.reached, self.cfg, self.progress = loaded, loaded.target, reached, cfg, progress
        self.device = device_of(self.target.model)
        self.store = _Store(int(cfg.max_reference_mb * 2 ** 20), storage)
        # reruns end before the optimizer update unless the update is in question (as in nanprobe run)
        self.update = update_in_question(self.target, reached)[1]
        # fp16 what-ifs on CPU run fp16 matmuls emulated (float32 arithmetic, fp16 rounding): CPU fp16
        # kernels are 5-10x slower; the run's own precision keeps its native kernels
        self.emulate = self.device.type == "cpu" and reached.precision is not Precision.FP16
        scaler = reached.loop.scaler
        reached.restore()
        self.base_scale = float(scaler.get_scale()) if scaler is not None and scaler._scale is not None else 65536.0
        self.backoff = float(scaler._backoff_factor) if scaler is not None else 0.5

    def _step(self, name: str, *, scale: float | None = None, **kwargs):
        prec, scaler = _RUNS[name]
        kwargs = {"update": self.update, "emulate_fp16": self.emulate, **kwargs}
        return run_step(self.target, self.reached, prec, where=self.loaded.where, grad_scaler=scaler,
                        scale=scale if scaler else None, restore_after=False, **kwargs)

    def run(self, name: str, *, reference: bool, tolerate: bool, scale: float | None = None) -> _Run:
        prec, scaler = _RUNS[name]
        scale = (self.base_scale if scale is None else scale) if scaler else 1.0
        cap = _Capture(self.target.model, self.store, reference=reference, low=prec.dtype, scale=scale,
                       device_type=self.device.type)
        self.progress(f"rerunning step {self.reached.step} in {name}" + (" (reference)" if reference else ""))
        with cap:
            trace = self._step(name, scale=scale, instrument=False, tolerate_errors=tolerate, observe=cap.observe)
        if trace.error:
            return _Run(name=name, trace=trace, measured=None, loss=None, scale=scale)
        measured = cap.finish()
        out = trace.outcome
        loss = float(out.loss.double().item()) if out is not None and out.loss is not None else None
        if not trace.finite or measured.nonfinite:  # only then is the origin tracker's cost worth paying
            self.progress(f"step {self.reached.step} is non-finite in {name}: rerunning it instrumented")
            traced = self._step(name, scale=scale, instrument=True, tolerate_errors=True)
            if not traced.error:
                trace = traced
        return _Run(name=name, trace=trace, measured=measured, loss=loss, scale=scale)

    def settle(self, run: _Run) -> tuple[ScalerResult, _Run | None]:
        """Would GradScaler skip this step, and at which scale (halving as it does) would it pass?
        Where it passes only at a lower scale, the step is rerun there, measured: that is what training sees."""
        rec = run.trace.record
        start = run.scale
        if rec is None or not rec.skipped:
            return ScalerResult(scale=start, skipped=False, scale_after=rec.scale if rec else None,
                                settled_scale=start, halvings=0), None
        result = dict(scale=start, skipped=True, scale_after=start * self.backoff,
                      overflow=origin_of(run.trace.origin, "fp16+scaler"))
        if run.loss is None or not math.isfinite(run.loss):  # the forward overflows: no scale helps
            return ScalerResult(**result, settled_scale=None, halvings=0), None
        scale = start
        for halving in range(1, self.cfg.max_scale_halvings + 1):
            scale *= self.backoff
            self.progress(f"GradScaler skips step {self.reached.step}: trying loss scale {scale:g}")
            t = self._step("fp16+scaler", scale=scale, instrument=False, tolerate_errors=True)  # the skip flag is enough
            if t.record is not None and not t.record.skipped:
                settled = self.run("fp16+scaler", reference=False, tolerate=True, scale=scale)
                return ScalerResult(**result, settled_scale=scale, halvings=halving), settled
        return ScalerResult(**result, settled_scale=None, halvings=self.cfg.max_scale_halvings), None

    def probe(self, ref_name: str, name: str, run: _Run, event: Event) -> _OriginProbe | None:
        """Rerun the reference (and, for a forward origin, this precision) with a probe on the op that went
        non-finite: the magnitude the reference reaches there, and how its inputs underflowed here."""
        self.progress(f"rerunning step {self.reached.step} in {ref_name} with a probe on {event.op}")
        if event.phase is Phase.BACKWARD:  # the OriginTracker's probe names backward ops by autograd node
            probe = Probe(phase=event.phase, module=event.module, op=event.op, occurrence=event.occurrence,
                          node=event.node)
            self._step(ref_name, instrument=True, probe=probe, tolerate_errors=True, update=False, ratios=False,
                       phases=frozenset({Phase.FORWARD, Phase.BACKWARD}))
            found = probe.found and probe.out_absmax is not None
            return _OriginProbe(would_reach=probe.out_absmax * run.scale) if found else None
        ref = self._op_inputs(ref_name, None, event)
        if ref.inputs is None:
            return None
        here = self._op_inputs(name, run.scale, event)
        if here.inputs is None:
            return _OriginProbe(would_reach=ref.out_absmax)
        return _input_underflow(here, ref)

    def _op_inputs(self, name: str, scale: float | None, event: Event) -> _OpProbe:
        probe = _OpProbe(self.target.model, event.module, event.op, event.occurrence)
        emulate = self.emulate and _RUNS[name][0] is Precision.FP16
        with (emulate_fp16_matmuls() if emulate else contextlib.nullcontext()), probe:   # emulation outermost
            self._step(name, scale=scale, emulate_fp16=False, instrument=False, tolerate_errors=True,
                       observe=probe.observe)
        return probe


def _reach(loaded: Loaded, at: int | None, cfg: Config, progress: Callable[[str], None],
           policy: str) -> tuple[Reached, list[str]]:
    target = loaded.target
    kwargs = dict(precision=target.precision, cfg=cfg.replay, where=loaded.where, policy=policy,
                  on_progress=lambda s: progress(f"replayed step {s}"))
    progress("replaying")
    if at is not None:
        return reach(target, at=at, **kwargs), []
    try:
        reached = reach(target, at=None, keep_last=True, **kwargs)
        return reached, [f"no --at: comparing step {reached.step}, the first bad step in {target.precision.value} "
                         f"({reached.reason})"]
    except NoBadStep as done:
        if done.steps == 0 or done.last is None:
            raise UsageError("batches yielded no batch", loaded.where, "Give the target at least one batch") from None
        return done.last, [f"no --at and no bad step in {done.steps} replayed steps: comparing the last one "
                           f"({done.last.step}); pick another with --at"]


# -- the library call ------------------------------------------------------------------------------------

@borrows_globals
def compare_precisions(entry_or_loaded: str | Loaded, *, at: int | None = None,
                       precisions: str | Iterable[str] | None = None, top: int | None = None,
                       config: Config | None = None, on_progress: Callable[[str], None] | None = None,
                       policy: str = "native") -> Comparison:
    """Rerun one step under each precision from the same state and batch; compare with the reference.

    ``at`` None compares the first bad step of a replay in the target's precision (else the last
    replayed step). ``precisions`` picks a subset of ``CHOICES``; the reference (fp64, else fp32)
    always runs. The user's objects end in the pre-step state with their original dtypes.
    """
    cfg = config or load_config()
    names = parse_precisions(precisions)
    k = cfg.compare.top if top is None else top
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UsageError(f"--top {top} is not a positive count", "--top", "Give a number of modules >= 1")
    progress = on_progress or (lambda msg: None)
    loaded = entry_or_loaded if isinstance(entry_or_loaded, Loaded) else load_target(entry_or_loaded)
    reached, notes = _reach(loaded, at, cfg, progress, policy)
    try:
        return _compare(loaded, reached, notes, cfg, names, k, progress)
    finally:
        reached.restore()   # the reruns do not restore after themselves: once, here


def _compare(loaded: Loaded, reached: Reached, notes: list[str], cfg: Config, names: tuple[str, ...], k: int,
             progress: Callable[[str], None]) -> Comparison:
    ccfg = cfg.compare
    target = loaded.target
    cmp = _Comparer(loaded, reached, ccfg, progress, storage=storage_policy(cfg.replay))
    device = cmp.device
    notes = list(reached.notes) + notes

    # the reference: fp64 where it runs, else fp32
    runs: dict[str, _Run] = {}
    skipped: dict[str, str] = {}
    if device.type == "mps":
        skipped["fp64"] = "MPS has no float64"
    else:
        try:
            run = cmp.run("fp64", reference=True, tolerate=True)
            if run.trace.error:
                skipped["fp64"] = f"fp64 rerun failed: {run.trace.error}"
            else:
                runs["fp64"] = run
        except torch.OutOfMemoryError:
            skipped["fp64"] = "float64 copy of the model does not fit in memory"
    ref_name = "fp32" if "fp64" in skipped else "fp64"
    if "fp64" in skipped:
        cmp.store = _Store(cmp.store.budget, cmp.store.storage)
        notes.append(f"reference is fp32: {skipped['fp64']}")
        runs["fp32"] = cmp.run("fp32", reference=True, tolerate=False)
    cannot = {"tf32": device.type != "cuda" and f"tf32 is a CUDA tensor-core mode; skipped on {device.type}",
              "fp16+scaler": not target.optimizers and "GradScaler needs an optimizer; the target has none"
              or target.pure and (f"the weights themselves are {target.weights.value}: GradScaler needs float32 "
                                  "weights (autocast) or float32 master copies to unscale into")
              or target.step_fn is not None and ("your step_fn drives its own GradScaler (or none): the fp16 run "
                                                 "executes it as written")}
    for name in names:
        if name in runs or name in skipped:
            continue
        if cannot.get(name):
            skipped[name] = cannot[name]
        else:
            runs[name] = cmp.run(name, reference=False, tolerate=True)

    scaler = None
    if "fp16+scaler" in runs and not runs["fp16+scaler"].trace.error:
        scaler, settled = cmp.settle(runs["fp16+scaler"])
        if settled is not None and not settled.trace.error:
            runs["fp16+scaler"] = settled  # the numbers at the scale GradScaler settles on
    bf16_ok = None
    if device.type == "cuda" and "bf16" in names:
        bf16_ok = bool(torch.cuda.is_bf16_supported())
        if not bf16_ok:
            notes.append("this GPU does not support bf16 natively (torch.cuda.is_bf16_supported() is False)")

    # probe the reference at the first non-finite low-precision origin: the magnitude it would reach
    probes: dict[str, _OriginProbe] = {}
    seen: dict[tuple, _OriginProbe | None] = {}
    for name in ("fp16", "fp16+scaler", "bf16", "tf32", "fp32"):
        run = runs.get(name)
        e = run.trace.origin if run is not None and not run.trace.error else None
        if e is None or e.phase not in (Phase.FORWARD, Phase.BACKWARD) or name == ref_name:
            continue
        key = (e.phase, e.module, e.op, e.occurrence, e.node, _RUNS[name][0], run.scale if e.phase is
               Phase.BACKWARD else 1.0)  # fp16 and fp16+scaler share a forward
        if key not in seen:
            seen[key] = cmp.probe(ref_name, name, run, e)
        if seen[key] is not None:
            probes[name] = seen[key]

    results = _results(runs, skipped, names, ref_name, probes, scaler, bf16_ok)
    layers = _layers(runs, ref_name, results)
    least, over, under = _rank(layers, ref_name, k, results)
    bad_input = [path for path, t in iter_tensors(reached.batch) if t.is_floating_point()
                 and not bool(torch.isfinite(t).all())] if not results[ref_name].finite else []
    recommended, line = _recommend(results, ref_name, ccfg, loaded.entry, reached.step, bad_input,
                                   run=reached.precision.value)
    policy_text = None
    if target.pure:
        policy_text = (f"no autocast: the weights themselves are {target.weights.value}; each other precision "
                       "reruns with the weights, optimizer state and batch cast to it")
    elif any(_RUNS[n][0].autocast for n in runs):
        policy_text = (f"CUDA autocast op list emulated on {device.type}" if reached.policy == "cuda"
                       and device.type == "cpu" else f"native {device.type} autocast")
    return Comparison(entry=loaded.entry, step=reached.step, device=describe_device(device),
                      precision=reached.precision.value, reference=ref_name, precisions=results, layers=layers,
                      least_accurate=least, closest_to_overflow=over, deepest_underflow=under,
                      recommendation=line, recommended=recommended, notes=tuple(notes),
                      reached_by=reached.reached_by, autocast_policy=policy_text,
                      disagreements=_disagreements(results, ref_name, ccfg))
