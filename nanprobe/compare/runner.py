"""compare-precisions: run every precision from the same state, then results, layers and the recommendation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch

from ..base.batch import iter_tensors
from ..base.config import CompareConfig, Config, load_config
from ..pipeline.diagnose import origin_of
from ..reach.entry import Loaded, load_target
from ..base.errors import UsageError
from ..locate.instrument import Event, Probe
from ..base.precision import Precision, describe_device, device_of, emulate_fp16_matmuls
from ..reach.replay import NoBadStep, Reached, reach
from ..base.report import Phase, Status
from ..locate.rerun import run_step
from ..reach.state import borrows_globals
from .measure import (ROOT, _bits, _Capture, _dtype_max, _input_underflow, _Measured, _OpProbe, _OriginProbe, _pct,
                      _pow2, _Run, _Store)
from .records import (_PREFERENCE, _RUNS, CHOICES, Comparison, LayerRow, LayerStat, PrecisionRun, Ranked, ScalerResult,
                      parse_precisions)


class _Comparer:
    def __init__(self, loaded: Loaded, reached: Reached, cfg: CompareConfig, progress: Callable[[str], None],
                 storage=None):
        self.loaded, self.target, self.reached, self.cfg, self.progress = loaded, loaded.target, reached, cfg, progress
        self.device = device_of(self.target.model)
        self.store = _Store(budget=int(cfg.max_reference_mb * 2 ** 20), storage=storage)
        # reruns end before the optimizer update unless the update is in question (as in nanprobe run)
        rec = reached.record
        suspect = rec is not None and not rec.finite and (rec.loss is None or math.isfinite(rec.loss)) and \
            (rec.grad_norm is None or math.isfinite(rec.grad_norm))
        self.update = self.target.step_fn is not None or rec is None or suspect or reached.status is Status.SPIKE
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
            return _OriginProbe(would_reach=probe.out_absmax * run.scale, zeros=None, underflow=None) \
                if probe.found and probe.out_absmax is not None else None
        ref = self._op_inputs(ref_name, None, event)
        if ref.inputs is None:
            return None
        here = self._op_inputs(name, run.scale, event)
        if here.inputs is None:
            return _OriginProbe(would_reach=ref.out_absmax, zeros=None, underflow=None)
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
    ccfg = cfg.compare
    names = parse_precisions(precisions)
    k = ccfg.top if top is None else top
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
    from ..reach.replay import storage_policy
    ccfg = cfg.compare
    target = loaded.target
    cmp = _Comparer(loaded, reached, ccfg, progress, storage=storage_policy(cfg.replay))
    device = cmp.device
    notes = list(reached.notes) + notes

    # the reference: fp64 where it runs, else fp32
    runs: dict[str, _Run] = {}
    skipped: dict[str, str] = {}
    ref_name = "fp64"
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
    if "fp64" in skipped:
        ref_name = "fp32"
        cmp.store = _Store(budget=cmp.store.budget, storage=cmp.store.storage)
        notes.append(f"reference is fp32: {skipped['fp64']}")
        runs["fp32"] = cmp.run("fp32", reference=True, tolerate=False)
    for name in names:
        if name in runs or name in skipped:
            continue
        if name == "tf32" and device.type != "cuda":
            skipped[name] = f"tf32 is a CUDA tensor-core mode; skipped on {device.type}"
            continue
        if name == "fp16+scaler" and not target.optimizers:
            skipped[name] = "GradScaler needs an optimizer; the target has none"
            continue
        if name == "fp16+scaler" and target.pure:
            skipped[name] = (f"the weights themselves are {target.weights.value}: GradScaler needs float32 weights "
                             "(autocast) or float32 master copies to unscale into")
            continue
        if name == "fp16+scaler" and target.step_fn is not None:
            skipped[name] = "your step_fn drives its own GradScaler (or none): the fp16 run executes it as written"
            continue
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


def _disagreements(results: dict[str, PrecisionRun], ref_name: str, cfg: CompareConfig) -> tuple[dict, ...]:
    """Finite precisions whose gradient points elsewhere than the reference's (cosine far below 1)."""
    out = []
    for name, r in results.items():
        if name == ref_name or not r.ran or not r.finite or r.grad_cosine is None:
            continue
        if r.grad_cosine < cfg.disagree_cosine:
            out.append({"precision": name, "grad_cosine": round(r.grad_cosine, 4),
                        "evidence": f"{name} gradient cosine {r.grad_cosine:.3f} against {ref_name} (< "
                                    f"{cfg.disagree_cosine:g}): the {name} update does not point where the "
                                    f"{ref_name} one does, though every value is finite"})
    return tuple(out)


def _results(runs: dict[str, _Run], skipped: dict[str, str], names: tuple[str, ...], ref_name: str,
             probes: dict[str, _OriginProbe], scaler: ScalerResult | None,
             bf16_ok: bool | None) -> dict[str, PrecisionRun]:
    ref = runs[ref_name]
    out: dict[str, PrecisionRun] = {}
    for name in CHOICES:
        if name != ref_name and name not in names:
            continue
        prec, _ = _RUNS[name]
        dtype = str(prec.dtype).replace("torch.", "")
        if name in skipped:
            out[name] = PrecisionRun(name=name, ran=False, dtype=dtype, note=skipped[name])
            continue
        run = runs[name]
        t = run.trace
        if t.error:
            out[name] = PrecisionRun(name=name, ran=False, dtype=dtype, note=f"could not run: {t.error}")
            continue
        m = run.measured
        rec = t.record
        e = t.origin
        finite = bool(rec.finite and not (t.trace and t.trace.events) and not m.nonfinite)
        sc = scaler if name == "fp16+scaler" else None
        if sc is not None and sc.skipped and sc.settled_scale is None:
            finite = False  # GradScaler's own skips are its normal business, unless no scale lets the step pass
        probe = probes.get(name) if e is not None else None
        would, zeros, under_origin, explains = (probe.would_reach, probe.zeros, probe.underflow, probe.explains) \
            if probe else (None,) * 4
        acts = _extreme(m, "out")
        grads = _extreme(m, "grad")
        loss_err = cos = None
        if run.loss is not None and ref.loss is not None:
            loss_err = abs(run.loss - ref.loss) / abs(ref.loss) if ref.loss != 0 else abs(run.loss - ref.loss)
            if math.isnan(loss_err):
                loss_err = math.inf
        p = m.totals["param"]
        if p.compared:
            denom = math.sqrt(p.sq * p.ref2)
            cos = p.dot / denom if denom > 0 and math.isfinite(denom) else None
            if name == ref_name:
                cos = 1.0
        act_bits = _bits(_dtype_max(acts[2]), acts[0])
        grad_bits = _bits(_dtype_max(grads[2]), grads[0])
        bits = _bits(_dtype_max(e.out_dtype), would) if would is not None and e is not None else None
        if bits is not None and e.phase is Phase.FORWARD and (act_bits is None or bits < act_bits):
            act_bits = bits
        if bits is not None and e.phase is Phase.BACKWARD and (grad_bits is None or bits < grad_bits):
            grad_bits = bits
        out[name] = PrecisionRun(
            name=name, ran=True, reference=name == ref_name, dtype=dtype, loss=run.loss,
            loss_rel_err=0.0 if name == ref_name else loss_err, grad_norm=rec.grad_norm, grad_cosine=cos,
            finite=finite, origin=origin_of(e, name), would_reach=would, zeros_at_origin=zeros,
            act_absmax=acts[0], act_module=acts[1], act_headroom_bits=act_bits,
            grad_absmax=grads[0], grad_module=grads[1], grad_headroom_bits=grad_bits,
            underflow_grads=m.totals["param"].underflow, underflow_act_grads=m.totals["grad"].underflow,
            underflow_acts=m.totals["out"].underflow, underflow_origin=under_origin,
            underflow_explains=explains, scaler=sc,
            supported=bf16_ok if name == "bf16" else None)
    return out


def _extreme(m: _Measured, kind: str) -> tuple[float | None, str | None, str | None]:
    """Largest finite |x| of a kind over modules: (absmax, module, dtype), judged by headroom in its dtype."""
    best = (None, None, None)
    best_bits = math.inf
    for module in m.order:
        agg = m.modules.get(module, {}).get(kind)
        if agg is None or agg.absmax <= 0:
            continue
        bits = _bits(_dtype_max(agg.dtype), agg.absmax)
        if bits is not None and bits < best_bits:
            best, best_bits = (agg.absmax, module, agg.dtype), bits
    return best


def _layers(runs: dict[str, _Run], ref_name: str, results: dict[str, PrecisionRun]) -> tuple[LayerRow, ...]:
    order = list(runs[ref_name].measured.order)
    for run in runs.values():
        if run.measured is not None:
            order += [n for n in run.measured.order if n not in order]
    ref_mods = runs[ref_name].measured.modules
    total_ref2 = runs[ref_name].measured.totals["param"].ref2
    rows = []
    for i, module in enumerate(order):
        stats = {}
        ref_aggs = ref_mods.get(module, {})
        for name, run in runs.items():
            aggs = run.measured.modules.get(module) if run.measured is not None else None
            if not aggs:
                continue
            r = results.get(name)
            origin = r.origin if r is not None and r.origin is not None and r.origin.module == module else None
            side: dict[str, tuple] = {}   # kind -> (aggregate, dtype judged in, what it would reach, headroom bits)
            for kind in ("out", "grad"):
                agg, ref = aggs.get(kind), ref_aggs.get(kind)
                dtype = agg.dtype if agg else None
                would = None
                if agg is not None and agg.nonfinite and ref is not None:   # what it reaches in the reference
                    would = ref.absmax * (run.scale if kind == "grad" else 1.0)
                if origin is not None and (origin.phase is Phase.BACKWARD) == (kind == "grad"):
                    if r.would_reach is not None:   # the origin op itself, probed in the reference
                        would = max(would or 0.0, r.would_reach)
                    if r.dtype in ("float16", "bfloat16") and (kind == "grad" or dtype not in ("float16", "bfloat16")):
                        dtype = r.dtype
                side[kind] = (agg, dtype, would,
                              _bits(_dtype_max(dtype), would if would is not None else agg.absmax if agg else None))
            (out, dtype, out_would, out_bits), (grad, _, grad_would, grad_bits) = side["out"], side["grad"]
            param = aggs.get("param")
            pg = None
            if param is not None and name != ref_name and param.ref2 >= 1e-12 * total_ref2:
                pg = param.rel_err  # modules with a negligible reference gradient carry no signal: left out
            stats[name] = LayerStat(
                dtype=dtype, out_absmax=out.absmax if out else None, out_finite=not (out and out.nonfinite),
                out_rel_err=None if name == ref_name or not out else out.rel_err,
                out_underflow=out.underflow if out and name != ref_name else None,
                grad_absmax=grad.absmax if grad else None, grad_finite=not (grad and grad.nonfinite),
                grad_underflow=grad.underflow if grad and name != ref_name else None,
                param_grad_rel_err=pg, out_headroom_bits=out_bits, grad_headroom_bits=grad_bits,
                out_would_reach=out_would, grad_would_reach=grad_would)
        rows.append(LayerRow(module=module, order=i, stats=stats))
    return tuple(rows)


def _rank(layers: tuple[LayerRow, ...], ref_name: str, k: int, results: dict[str, PrecisionRun]):
    """Top-k (precision, module) by error, by headroom (ascending) and by underflow share."""
    least, over, under = [], [], []
    origin_listed: set[str] = set()
    known = {row.module for row in layers}
    for name, r in results.items():  # a forward origin names its module; the modules after it inherit
        o = r.origin if r.ran and not r.finite else None
        if o is not None and o.phase is Phase.FORWARD and o.module in known:
            origin_listed.add(name)
            order = next(row.order for row in layers if row.module == o.module)
            least.append((-math.inf, order, Ranked(precision=name, module=o.module, value=math.inf,
                                                   detail=f"output non-finite (origin: {o.op})")))
    for row in layers:
        for name, s in row.stats.items():
            if name == ref_name:
                continue
            if not s.out_finite:
                if name not in origin_listed:  # the first module whose output went non-finite; the rest inherit it
                    origin_listed.add(name)
                    least.append((-math.inf, row.order, Ranked(precision=name, module=row.module, value=math.inf,
                                                               detail="output non-finite")))
            else:
                errs = [v for v in (s.out_rel_err, s.param_grad_rel_err) if v is not None and math.isfinite(v)]
                if errs:
                    detail = f"outputs {_e(s.out_rel_err)}, param grads {_e(s.param_grad_rel_err)}"
                    least.append((-max(errs), row.order, Ranked(precision=name, module=row.module, value=max(errs),
                                                                detail=detail)))
            bits = s.headroom_bits
            if bits is not None:
                grad_side = s.grad_headroom_bits is not None and (s.out_headroom_bits is None
                                                                 or s.grad_headroom_bits < s.out_headroom_bits)
                would = s.grad_would_reach if grad_side else s.out_would_reach
                mag = would if would is not None else (s.grad_absmax if grad_side else s.out_absmax)
                detail = (f"{'gradient' if grad_side else 'activation'} |x| {_e(mag)}"
                          + (" (would reach)" if would is not None else "") + f", {_e(bits)} bits below its max")
                over.append((bits, row.order, Ranked(precision=name, module=row.module, value=bits, detail=detail)))
            share = s.underflow
            if share:
                detail = f"activations {_share(s.out_underflow)}, gradients {_share(s.grad_underflow)}"
                under.append((-share, row.order, Ranked(precision=name, module=row.module, value=share, detail=detail)))
    pick = lambda items: tuple(r for *_, r in sorted(items, key=lambda x: (x[0], x[1]))[:k])  # noqa: E731
    return pick(least), pick(over), pick(under)


def _e(x: float | None) -> str:
    return "-" if x is None else (str(x) if not math.isfinite(x) else f"{x:.3g}")


def _share(x: float | None) -> str:
    return "-" if x is None else _pct(x) if x else "0"


# -- recommendation ---------------------------------------------------------------------------------------

def _problem(r: PrecisionRun, bf16_ok: bool) -> tuple[str, str]:
    """(what went wrong, what to do) for a non-finite precision; bf16 is offered only where it is safe."""
    o = r.origin
    if o is None:
        return "non-finite loss or gradients", "keep fp32"
    where = o.module or ROOT
    op = o.node or o.op
    alt = " or use bf16" if bf16_ok and r.name != "bf16" else ""
    limit = _dtype_max(r.dtype) if r.dtype in ("float16", "bfloat16") else None
    if r.would_reach is not None and limit is not None and r.would_reach > limit:
        return (f"overflows in {where} at {op} (|x| would reach {_pow2(r.would_reach)} > {limit:g})",
                "keep that block in fp32" + alt)
    if not r.underflow_origin and r.zeros_at_origin and r.zeros_at_origin[0] > r.zeros_at_origin[1]:
        here, ref = r.zeros_at_origin
        return (f"rounds inputs of {op} in {where} to 0 ({here} of its inputs are 0 in {r.name}, {ref} in the "
                "reference, whose values are within the dtype's range: digits lost, e.g. a difference of nearly "
                "equal terms)", "compute that in fp32" + alt.replace(" or", ", or"))
    if r.underflow_origin or (r.zeros_at_origin and r.zeros_at_origin[0] > r.zeros_at_origin[1]):
        here, ref = r.zeros_at_origin
        share = f"{_pct(r.underflow_origin)} of its inputs are zero or subnormal in {r.name}" \
            if r.underflow_origin else f"{here} of its inputs are 0 in {r.name}, {ref} in the reference"
        if r.underflow_explains:
            share += f"; they feed {_pct(r.underflow_explains)} of its non-finite outputs"
        return (f"underflows before {op} in {where} ({share})",
                "compute that in fp32 or add an eps" + alt.replace(" or", ", or"))
    return f"non-finite ({o.kind}) at {op} in {where}", "keep that block in fp32" + alt


def _recommend(results: dict[str, PrecisionRun], ref_name: str, cfg: CompareConfig, entry: str,
               step: int, bad_input: list[str], run: str | None = None) -> tuple[str | None, str]:
    ref = results[ref_name]
    if not ref.finite:
        what, _ = _problem(ref, False)
        if bad_input:
            what = f"the batch holds non-finite values at {', '.join(bad_input[:3])}"
        return None, (f"no precision fixes this step: it is non-finite even in {ref_name} ({what}); "
                      f"run `nanprobe run {entry} --at {step}` to find the cause")
    fp32 = results.get("fp32")
    # gradient underflow beyond what fp32 itself shows against fp64 (a saturated softmax zeroes some in fp32 too)
    base = (fp32.underflow_grads or 0.0) if fp32 is not None and fp32.ran and not fp32.reference else 0.0

    def excess(r: PrecisionRun) -> float:
        return (r.underflow_grads or 0.0) - base

    def accurate(r: PrecisionRun) -> bool:
        return (r.loss_rel_err is not None and r.loss_rel_err <= cfg.loss_tolerance
                and (r.grad_cosine is None or r.grad_cosine >= cfg.min_cosine))

    def safe(r: PrecisionRun | None) -> bool:
        return bool(r is not None and r.ran and r.finite and accurate(r) and r.supported is not False
                    and excess(r) < cfg.underflow_share)

    bf16_ok = safe(results.get("bf16"))
    parts: list[str] = []
    for name in ("bf16", "fp16", "fp16+scaler", "tf32", "fp32"):
        r = results.get(name)
        if r is None or not r.ran or name == ref_name:
            continue
        if r.supported is False:
            parts.append(f"{name}: not supported natively on this GPU")
        elif not r.finite:
            what, fix = _problem(r, bf16_ok)
            f16 = results.get("fp16")
            if name == "fp16+scaler" and f16 is not None and f16.ran and not f16.finite and f16.origin and r.origin \
                    and (f16.origin.phase, f16.origin.module, f16.origin.op) == (r.origin.phase, r.origin.module,
                                                                                r.origin.op):
                parts[-1] = parts[-1].replace("fp16: ", "fp16 (with or without GradScaler): ", 1)
                continue
            if r.scaler is not None and r.scaler.skipped and r.scaler.settled_scale is None and r.loss is not None \
                    and math.isfinite(r.loss):
                what = f"GradScaler skips this step at every scale down to {_pow2(r.scaler.scale * 0.5 ** r.scaler.halvings)}"
            parts.append(f"{name}: {what}: {fix}")
        else:
            text = f"{name}: finite, loss within {_pct(r.loss_rel_err or 0.0)} of {ref_name}"
            if r.grad_cosine is not None and r.grad_cosine < cfg.min_cosine:
                text += f", gradient cosine only {r.grad_cosine:.4f}"
            elif name in ("bf16", "fp16", "fp16+scaler") and r.grad_cosine is not None:
                text += f", gradient cosine {r.grad_cosine:.4f}"
            if excess(r) >= cfg.underflow_share:
                text += f", {_pct(r.underflow_grads)} of gradient values underflow" + (
                    f" ({_pct(base)} in fp32)" if base else "")
            if r.scaler is not None and r.scaler.skipped:
                o = r.scaler.overflow
                why = f" ({o.node or o.op} in {o.module or ROOT} overflows)" if o is not None else ""
                text += (f"; GradScaler skips this step at {_pow2(r.scaler.scale)}{why} and settles at "
                         f"{_pow2(r.scaler.settled_scale)}")
            if name in ("fp32", "tf32") and accurate(r):
                continue  # only worth a word when something is off
            parts.append(text)
    recommended = next((n for n in _PREFERENCE if n != ref_name and safe(results.get(n))), None)
    if recommended is None:
        recommended = "fp32" if (fp32 is not None and fp32.ran and fp32.finite) else None
    head = f"use {recommended}" if recommended else "no compared precision is safe for this step"
    own = results.get(run) if run is not None else None
    if recommended and own is not None and own.ran and not own.finite and run != recommended:
        head = (f"precision is the problem: the run's own {run} is non-finite at this step, {recommended} and "
                f"{ref_name} are finite from the same state and batch; {head}")
    return recommended, head + (" — " + "; ".join(parts) if parts else "")
