"""compare-precisions summary: the measured runs -> per-precision results, per-layer rows, the top-k
tables and the recommendation."""

from __future__ import annotations

import math

from ..base.config import CompareConfig
from ..base.report import Phase
from ..pipeline.diagnose import origin_of
from .measure import ROOT, _bits, _dtype_max, _Measured, _OriginProbe, _pct, _pow2, _Run
from .records import _PREFERENCE, _RUNS, CHOICES, LayerRow, LayerStat, PrecisionRun, Ranked, ScalerResult

_NO_PROBE = _OriginProbe()


def _least(*values: float | None) -> float | None:
    return min((v for v in values if v is not None), default=None)


def _disagreements(results: dict[str, PrecisionRun], ref_name: str, cfg: CompareConfig) -> tuple[dict, ...]:
    """Finite precisions whose gradient points elsewhere than the reference's (cosine far below 1)."""
    return tuple({"precision": name, "grad_cosine": round(r.grad_cosine, 4),
                  "evidence": f"{name} gradient cosine {r.grad_cosine:.3f} against {ref_name} (< "
                              f"{cfg.disagree_cosine:g}): the {name} update does not point where the "
                              f"{ref_name} one does, though every value is finite"}
                 for name, r in results.items() if name != ref_name and r.ran and r.finite
                 and r.grad_cosine is not None and r.grad_cosine < cfg.disagree_cosine)


def _results(runs: dict[str, _Run], skipped: dict[str, str], names: tuple[str, ...], ref_name: str,
             probes: dict[str, _OriginProbe], scaler: ScalerResult | None,
             bf16_ok: bool | None) -> dict[str, PrecisionRun]:
    ref = runs[ref_name]
    out: dict[str, PrecisionRun] = {}
    for name in CHOICES:
        if name != ref_name and name not in names:
            continue
        dtype = str(_RUNS[name][0].dtype).replace("torch.", "")
        if name in skipped or runs[name].trace.error:
            note = skipped.get(name) or f"could not run: {runs[name].trace.error}"
            out[name] = PrecisionRun(name=name, ran=False, dtype=dtype, note=note)
            continue
        run = runs[name]
        t, m = run.trace, run.measured
        rec, e = t.record, t.origin
        finite = bool(rec.finite and not (t.trace and t.trace.events) and not m.nonfinite)
        sc = scaler if name == "fp16+scaler" else None
        if sc is not None and sc.skipped and sc.settled_scale is None:
            finite = False  # GradScaler's own skips are its normal business, unless no scale lets the step pass
        probe = (probes.get(name) if e is not None else None) or _NO_PROBE
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
            cos = 1.0 if name == ref_name else p.dot / denom if denom > 0 and math.isfinite(denom) else None
        # the origin op's magnitude in the reference, where probed, counts in its phase's headroom
        bits = _bits(e.out_dtype, probe.would_reach) if probe.would_reach is not None else None
        phase = e.phase if bits is not None else None
        act_bits = _least(_bits(acts[2], acts[0]), bits if phase is Phase.FORWARD else None)
        grad_bits = _least(_bits(grads[2], grads[0]), bits if phase is Phase.BACKWARD else None)
        out[name] = PrecisionRun(
            name=name, ran=True, reference=name == ref_name, dtype=dtype, loss=run.loss,
            loss_rel_err=0.0 if name == ref_name else loss_err, grad_norm=rec.grad_norm, grad_cosine=cos,
            finite=finite, origin=origin_of(e, name), would_reach=probe.would_reach, zeros_at_origin=probe.zeros,
            act_absmax=acts[0], act_module=acts[1], act_headroom_bits=act_bits,
            grad_absmax=grads[0], grad_module=grads[1], grad_headroom_bits=grad_bits,
            underflow_grads=m.totals["param"].underflow, underflow_act_grads=m.totals["grad"].underflow,
            underflow_acts=m.totals["out"].underflow, underflow_origin=probe.underflow,
            underflow_explains=probe.explains, scaler=sc,
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
        bits = _bits(agg.dtype, agg.absmax)
        if bits is not None and bits < best_bits:
            best, best_bits = (agg.absmax, module, agg.dtype), bits
    return best


def _layers(runs: dict[str, _Run], ref_name: str, results: dict[str, PrecisionRun]) -> tuple[LayerRow, ...]:
    order = list(dict.fromkeys(n for run in (runs[ref_name], *runs.values()) if run.measured is not None
                               for n in run.measured.order))   # the reference's forward order, then the rest
    total_ref2 = runs[ref_name].measured.totals["param"].ref2
    rows = []
    for i, module in enumerate(order):
        stats = {}
        ref_aggs = runs[ref_name].measured.modules.get(module, {})
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
                              _bits(dtype, would if would is not None else agg.absmax if agg else None))
            (out, dtype, out_would, out_bits), (grad, _, grad_would, grad_bits) = side["out"], side["grad"]
            param = aggs.get("param")   # modules with a negligible reference gradient carry no signal: left out
            pg = param.rel_err if param is not None and name != ref_name and param.ref2 >= 1e-12 * total_ref2 else None
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

    def add(table: list, key: float, order: int, name: str, module: str, value: float, detail: str) -> None:
        table.append((key, order, Ranked(precision=name, module=module, value=value, detail=detail)))
    orders = {row.module: row.order for row in layers}
    for name, r in results.items():  # a forward origin names its module; the modules after it inherit
        o = r.origin if r.ran and not r.finite else None
        if o is not None and o.phase is Phase.FORWARD and o.module in orders:
            origin_listed.add(name)
            add(least, -math.inf, orders[o.module], name, o.module, math.inf, f"output non-finite (origin: {o.op})")
    for row in layers:
        for name, s in row.stats.items():
            if name == ref_name:
                continue
            if not s.out_finite:
                if name not in origin_listed:  # the first module whose output went non-finite; the rest inherit it
                    origin_listed.add(name)
                    add(least, -math.inf, row.order, name, row.module, math.inf, "output non-finite")
            else:
                errs = [v for v in (s.out_rel_err, s.param_grad_rel_err) if v is not None and math.isfinite(v)]
                if errs:
                    detail = f"outputs {_e(s.out_rel_err)}, param grads {_e(s.param_grad_rel_err)}"
                    add(least, -max(errs), row.order, name, row.module, max(errs), detail)
            bits = s.headroom_bits
            if bits is not None:
                grad_side = s.grad_headroom_bits is not None and (s.out_headroom_bits is None
                                                                 or s.grad_headroom_bits < s.out_headroom_bits)
                would = s.grad_would_reach if grad_side else s.out_would_reach
                mag = would if would is not None else (s.grad_absmax if grad_side else s.out_absmax)
                detail = (f"{'gradient' if grad_side else 'activation'} |x| {_e(mag)}"
                          + (" (would reach)" if would is not None else "") + f", {_e(bits)} bits below its max")
                add(over, bits, row.order, name, row.module, bits, detail)
            share = s.underflow
            if share:
                detail = f"activations {_share(s.out_underflow)}, gradients {_share(s.grad_underflow)}"
                add(under, -share, row.order, name, row.module, share, detail)
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
    if r.underflow_origin:
        share = f"{_pct(r.underflow_origin)} of its inputs are zero or subnormal in {r.name}"
        if r.underflow_explains:
            share += f"; they feed {_pct(r.underflow_explains)} of its non-finite outputs"
        return (f"underflows before {op} in {where} ({share})",
                "compute that in fp32 or add an eps" + alt.replace(" or", ", or"))
    if r.zeros_at_origin and r.zeros_at_origin[0] > r.zeros_at_origin[1]:
        here, ref = r.zeros_at_origin
        return (f"rounds inputs of {op} in {where} to 0 ({here} of its inputs are 0 in {r.name}, {ref} in the "
                "reference, whose values are within the dtype's range: digits lost, e.g. a difference of nearly "
                "equal terms)", "compute that in fp32" + alt.replace(" or", ", or"))
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
    recommended = next((n for n in _PREFERENCE if n != ref_name and safe(results.get(n))),
                       "fp32" if fp32 is not None and fp32.ran and fp32.finite else None)
    head = f"use {recommended}" if recommended else "no compared precision is safe for this step"
    own = results.get(run) if run is not None else None
    if recommended and own is not None and own.ran and not own.finite and run != recommended:
        head = (f"precision is the problem: the run's own {run} is non-finite at this step, {recommended} and "
                f"{ref_name} are finite from the same state and batch; {head}")
    return recommended, head + (" — " + "; ".join(parts) if parts else "")
