"""What a user would pick INSTEAD of nanprobe, each used as its own docs say, run on a zoo program.

    python zoo/alternatives.py TOOL NAME [--steps N] --json OUT
    run(tool, name, steps=None) -> dict

TOOL is one of:

- ``detect_anomaly``: the zoo's plain loop inside ``with torch.autograd.detect_anomaly():`` (check_nan on).
  Its alarm is the RuntimeError "Function 'XBackward0' returned nan values in its Nth output."; the node
  is mapped to a cause (:data:`NODE_CAUSES`).
- ``debug_underflow_overflow``: ``transformers.debug_utils.DebugUnderflowOverflow(model)`` made once before
  the plain loop (its docs' usage). Its alarm is the ValueError it raises from a forward hook when a module's
  weight, input or output holds inf/nan; the module is read from its frame dump (captured stdout). It names
  no cause.
- ``lightning_detect_anomaly``: the program trained by ``lightning.pytorch.Trainer(detect_anomaly=True, ...)``
  through a generic LightningModule adapter (loss_fn programs: automatic optimization with the target's
  optimizer, scheduler (interval "step"), gradient_clip_val = max_grad_norm, accumulate_grad_batches =
  accumulate; step_fn programs: manual optimization, the step_fn steps its own optimizers).
- ``neuraldbg``: ``with NeuralDbg(model) as dbg:`` around the plain loop, ``dbg.step = step`` each step,
  ``dbg.record_loss(loss.item())`` after backward (README usage); after the run ``dbg.explain_failure(t)``
  for each of the README's six failure types plus ``dbg.get_causal_hypotheses()``. Alarm = any hypothesis.
  (neuraldbg 1.3.2 without the proprietary neuraldbg-engine uses its Core fallback: explain_failure(t)
  returns the raw events whose event type equals t, so only "optimizer_instability" and "data_anomaly"
  can ever return anything, and get_causal_hypotheses() always returns [].)

Every tool run is preceded, in the same process, by the zoo's plain loop (``_loop.train``, no tool) over
the same steps, for ``overhead`` = median step time with the tool / median plain step time.

The tool runs use :func:`_train`, a copy of ``_loop.train`` (same order of zero_grad / autocast / backward /
unscale / clip / step / scaler.update / scheduler) with hooks for the tools. Like ``_loop.train`` it stops at
the loop's first non-finite step (loss, gradients or parameters), but only after ``GRACE`` (1) further step,
so a tool that only notices on the next forward (DebugUnderflowOverflow seeing NaN weights, NeuralDbg's data
checks) gets its chance. An exception the program raises during that grace step is post-NaN fallout, not a
crash.

Output (JSON): tool, name, kind, steps_run, alarm, step, cause, module, message, overhead, seconds, crashed,
plus: by ("tool" | "loop" | "tool+loop": who raised the alarm), tool_alarm, tool_step, loop_nonfinite_step
(the loop's first non-finite step, as zoo/truth's first_bad_step), node (autograd node, anomaly tools),
where (anomaly tools: innermost frame of the forward traceback the anomaly warning prints), plain_seconds,
median_step_s, plain_median_step_s, truth (kind / first_bad_step / cause / module of zoo/truth/NAME.json),
hypotheses (neuraldbg), detail.

``alarm``: detect_anomaly, lightning_detect_anomaly and debug_underflow_overflow: the tool raised OR the loop
saw a non-finite step; neuraldbg: any hypothesis returned (the brief's definition; loop_nonfinite_step still
reports what the loop saw). ``step`` = the earliest of tool_step and, where it counts for alarm,
loop_nonfinite_step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import _loop  # noqa: E402
from _loop import DTYPES, _finite, _items, _objects, _scalar  # noqa: E402

TOOLS = ("detect_anomaly", "debug_underflow_overflow", "lightning_detect_anomaly", "neuraldbg")
GRACE = 1

# autograd node (without its trailing number) -> cause
NODE_CAUSES = {
    "SqrtBackward": "sqrt", "RsqrtBackward": "sqrt",
    "LogBackward": "log", "Log1pBackward": "log", "Log2Backward": "log", "Log10Backward": "log",
    "DivBackward": "div", "ReciprocalBackward": "div",
    "PowBackward": "domain",           # tensor ** scalar: a negative base with a fractional exponent
    "AcosBackward": "domain", "AsinBackward": "domain",
    "ExpBackward": "overflow",
}
NEURALDBG_TYPES = ("exploding_gradients", "optimizer_instability", "data_anomaly", "vanishing_gradients",
                   "dead_neurons", "saturated_activations")
NEURALDBG_CAUSES = {"exploding_gradients": "lr_spike", "optimizer_instability": "lr_spike",
                    "data_anomaly": "data", "vanishing_gradients": "underflow",
                    "dead_neurons": None, "saturated_activations": None}
NONFINITE_STATES = ("nan_detected", "inf_detected", "diverging")
ANOMALY_RE = re.compile(r"Function '(\w+?)(\d*)' returned nan values in its (\d+)\w* output")


class ToolAlarm(Exception):
    """Internal: wraps the tool's own alarm exception with the step it came at."""


def load(name: str):
    path = HERE / "programs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"zoo_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def node_cause(node: str | None, number: str = "") -> str | None:
    if not node:
        return None
    if node == "PowBackward" and number == "1":
        return "overflow"          # tensor ** tensor (a ** x): the exp-like form
    return NODE_CAUSES.get(node)


# --------------------------------------------------------------------------------------------------
# the plain loop, copied from _loop.train, with hooks
# --------------------------------------------------------------------------------------------------

def _train(target: dict[str, Any], steps: int, *, state: dict[str, Any], on_step=None, before_step=None,
           after_backward=None, grace: int = GRACE) -> list[dict[str, Any]]:
    """``_loop.train`` (stop_at_nonfinite, no measure) with ``before_step(step)``, ``after_backward(step,
    loss)`` (after the step's backward(s), before clip / optimizer step; a step_fn's after it returns) and
    ``grace`` steps run on past the first non-finite one. ``state['step']`` is the step in progress,
    ``state['first_bad']`` the first non-finite step."""
    model = target["model"]
    opts = _objects(target.get("optimizer"))
    scheds = _objects(target.get("scheduler"))
    precision = target.get("precision", "fp32")
    dtype = DTYPES[precision]
    device_type = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device_type) if precision == "fp16" and target.get("grad_scaler") is True \
        and opts else None
    clip = target.get("max_grad_norm")
    accumulate = int(target.get("accumulate", 1))
    step_fn, loss_fn = target.get("step_fn"), target.get("loss_fn")
    items = _items(target)
    out: list[dict[str, Any]] = []
    state.setdefault("first_bad", None)
    for step in range(steps):
        state["step"] = step
        if before_step is not None:
            before_step(step)
        rec: dict[str, Any] = {"step": step}
        if opts:
            rec["lr"] = opts[0].param_groups[0]["lr"]
        if step_fn is None:
            for opt in opts:
                opt.zero_grad(set_to_none=True)
        if step_fn is not None:
            try:
                batch = next(items)
            except StopIteration:
                break
            with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                res = step_fn(model, batch, step)
            if isinstance(res, dict):
                for k, v in res.items():
                    rec[k] = _scalar(v)
                rec["loss"] = rec.get("loss", sum(v for k, v in rec.items() if k not in ("step", "lr")))
            else:
                rec["loss"] = _scalar(res)
            if after_backward is not None:
                after_backward(step, rec["loss"])
            bad = not math.isfinite(rec["loss"]) or not _finite(model.parameters())
        else:
            total = 0.0
            bad = False
            for _ in range(accumulate):
                try:
                    batch = next(items)
                except StopIteration:
                    break
                with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    loss = loss_fn(model, batch)
                part = loss / accumulate
                (scaler.scale(part) if scaler else part).backward()
                total += _scalar(loss) / accumulate
            else:
                if after_backward is not None:
                    after_backward(step, total)
                if scaler is not None:
                    for opt in opts:
                        scaler.unscale_(opt)
                bad = not math.isfinite(total) or (scaler is None and not _finite(p.grad for p in model.parameters()))
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                for opt in opts:
                    if scaler is not None:
                        scaler.step(opt)
                    else:
                        opt.step()
                if scaler is not None:
                    scaler.update()
                for s in scheds:
                    s.step()
                rec["loss"] = total
                bad = bad or not _finite(model.parameters())
            if "loss" not in rec:
                break
        rec["finite"] = not bad
        out.append(rec)
        if on_step is not None:
            on_step(rec)
        if bad and state["first_bad"] is None:
            state["first_bad"] = step
        if state["first_bad"] is not None and step >= state["first_bad"] + grace:
            break
    return out


class _Clock:
    """Per-step wall times from on_step timestamps."""

    def __init__(self):
        self.t = [time.perf_counter()]

    def __call__(self, rec=None):
        self.t.append(time.perf_counter())

    def median(self) -> float | None:
        d = [b - a for a, b in zip(self.t, self.t[1:])]
        return statistics.median(d) if d else None


def _plain(mod, steps: int) -> dict[str, Any]:
    target = mod.target()
    clock = _Clock()
    t0 = time.perf_counter()
    err = None
    try:
        recs = _loop.train(target, steps, on_step=clock)
    except Exception as e:  # noqa: BLE001
        recs, err = [], f"{type(e).__name__}: {e}"
    return {"seconds": time.perf_counter() - t0, "median": clock.median(), "steps": len(recs),
            "first_bad": next((r["step"] for r in recs if not r["finite"]), None), "error": err}


def _where(text: str) -> str | None:
    """Innermost 'File ..., line N, in f' frame (plus its code line) of a forward traceback."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', text)
    if not frames:
        return None
    f, line, fn, code = frames[-1]
    return f"{Path(f).name}:{line} in {fn}: {code.strip()}"[:200]


# --------------------------------------------------------------------------------------------------
# the tools
# --------------------------------------------------------------------------------------------------

def _anomaly_result(exc: BaseException, warns: list[str]) -> dict[str, Any]:
    msg = str(exc)
    m = ANOMALY_RE.search(msg)
    node = (m.group(1) + m.group(2)) if m else None
    where = None
    for w in warns:
        if "Traceback of forward call" in w or "Error detected in" in w:
            where = _where(w)
    return {"node": node, "cause": node_cause(m.group(1), m.group(2)) if m else None, "where": where,
            "message": msg}


def _run_detect_anomaly(target, steps, state, res) -> dict[str, Any]:
    clock = _Clock()
    res["clock"] = clock
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly():   # check_nan=True (the default)
                res["recs"] = _train(target, steps, state=state, on_step=clock)
        except RuntimeError as e:
            if ANOMALY_RE.search(str(e)) is None:
                raise
            res["tool"] = {"step": state["step"], **_anomaly_result(e, [str(w.message) for w in caught])}
    return res


DUO_HEADER = re.compile(r"^\s{17} (\S*) (\S+)\s*$")


def _run_duo(target, steps, state, res) -> dict[str, Any]:
    from transformers.debug_utils import DebugUnderflowOverflow
    clock = _Clock()
    res["clock"] = clock
    buf = io.StringIO()
    model = target["model"]
    with contextlib.redirect_stdout(buf):
        debug_overflow = DebugUnderflowOverflow(model)   # noqa: F841  (its docs' usage: made once, hooks stay)
        try:
            res["recs"] = _train(target, steps, state=state, on_step=clock)
        except ValueError as e:
            if not str(e).startswith("DebugUnderflowOverflow"):
                raise
            out = buf.getvalue()
            tail = out[out.rfind("Detected inf/nan during batch_number"):]
            # the detecting module's frame is the last one saved before the raise
            module = None
            cls = None
            for line in tail.splitlines():
                h = DUO_HEADER.match(line)
                if h and not line.strip().startswith("***"):
                    module, cls = h.group(1), h.group(2)
            pre = out[:out.rfind("Detected inf/nan during batch_number")]
            what = [ln.strip() for ln in pre.splitlines()[-4:] if ln.strip().endswith(("has nans", "has infs"))]
            res["tool"] = {"step": state["step"], "module": module if module else (f"<root {cls}>" if cls else None),
                           "cause": None,
                           "message": f"{e} [{'; '.join(what)} in {module or '<root>'} {cls}; "
                                      f"batch_number={debug_overflow.batch_number}]"}
    return res


def _run_neuraldbg(target, steps, state, res) -> dict[str, Any]:
    from neuraldbg import NeuralDbg
    clock = _Clock()
    res["clock"] = clock
    model = target["model"]
    cache = tempfile.mkdtemp(prefix="neuraldbg_cache_")
    cwd = os.getcwd()
    os.chdir(cache)            # its TensorDiskCache makes ./artifacts/tensor_cache in the cwd at construction
    try:
        dbg = NeuralDbg(model)
    finally:
        os.chdir(cwd)
    dbg.disk_cache.cache_dir = Path(cache) / "artifacts" / "tensor_cache"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with dbg:
            def before(step):
                dbg.step = step

            def after(step, loss):
                dbg.record_loss(loss)
            res["dbg"] = dbg
            try:
                res["recs"] = _train(target, steps, state=state, on_step=clock, before_step=before,
                                     after_backward=after)
            finally:   # the post-mortem query, also after the program raised (README: "after training failure")
                hyps = []
                for ft in NEURALDBG_TYPES:
                    for h in dbg.explain_failure(ft):
                        hyps.append((ft, h))
                for h in dbg.get_causal_hypotheses():
                    hyps.append(("causal_hypotheses", h))
                res["hyps"] = hyps
    import shutil
    shutil.rmtree(cache, ignore_errors=True)
    return res


def _hyp_step(h) -> int | None:
    steps = [e.step for e in h.evidence if isinstance(getattr(e, "step", None), int)]
    return min(steps) if steps else None


# ---------------------------------------------------------------- Lightning

def _run_lightning(target, steps, state, res) -> dict[str, Any]:
    import lightning.pytorch as pl
    for lg in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(lg).setLevel(logging.ERROR)

    model = target["model"]
    opts = _objects(target.get("optimizer"))
    scheds = _objects(target.get("scheduler"))
    precision = target.get("precision", "fp32")
    dtype = DTYPES[precision]
    device_type = next(model.parameters()).device.type
    accumulate = int(target.get("accumulate", 1))
    step_fn, loss_fn = target.get("step_fn"), target.get("loss_fn")
    manual = step_fn is not None
    if target.get("grad_scaler") is True and precision == "fp16":
        warnings.warn("grad_scaler is not reproduced by the Lightning adapter")

    class Adapter(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.automatic_optimization = not manual
            self._acc = 0.0

        def training_step(self, batch, batch_idx):
            step = batch_idx if manual else batch_idx // accumulate
            # autocast as the zoo loop does it (Lightning's precision="16-mixed" is refused on CPU)
            with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                if manual:
                    res = step_fn(self.model, batch, step)
                else:
                    loss = loss_fn(self.model, batch)
            if manual:
                if isinstance(res, dict):
                    vals = {k: _scalar(v) for k, v in res.items()}
                    lv = vals.get("loss", sum(vals.values()))
                else:
                    lv = _scalar(res)
                self._acc = lv
                return None
            if batch_idx % accumulate == 0:
                self._acc = 0.0
            self._acc += _scalar(loss) / accumulate
            return loss

        def configure_optimizers(self):
            if manual:
                return opts or None
            if not scheds:
                return opts
            return opts, [{"scheduler": s, "interval": "step"} for s in scheds]

        def lr_scheduler_step(self, scheduler, metric):
            scheduler.step()

    clock = _Clock()

    class Watch(pl.Callback):
        """The adapter's own view: a non-finite loss / gradient / parameter ends the run after GRACE steps."""

        def __init__(self):
            self.grad_bad = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            state["step"] = batch_idx if manual else batch_idx // accumulate

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if not _finite(p.grad for p in pl_module.model.parameters()):
                self.grad_bad = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not manual and (batch_idx + 1) % accumulate:
                return
            step = state["step"]
            clock()
            bad = self.grad_bad or not math.isfinite(pl_module._acc) or not _finite(pl_module.model.parameters())
            self.grad_bad = False
            recs.append({"step": step, "loss": pl_module._acc, "finite": not bad})
            if bad and state["first_bad"] is None:
                state["first_bad"] = step
            if state["first_bad"] is not None and step >= state["first_bad"] + GRACE:
                trainer.should_stop = True
            if step + 1 >= steps:
                trainer.should_stop = True

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return _items(target)

    loader = torch.utils.data.DataLoader(Stream(), batch_size=None, collate_fn=lambda b: b)
    recs: list[dict[str, Any]] = []
    state["first_bad"] = None
    res.update(clock=clock, recs=recs)
    kw: dict[str, Any] = {}
    if not manual:
        kw["accumulate_grad_batches"] = accumulate
        if target.get("max_grad_norm"):
            kw["gradient_clip_val"] = target["max_grad_norm"]
    trainer = pl.Trainer(detect_anomaly=True, max_steps=steps, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         max_epochs=1, limit_train_batches=steps * (1 if manual else accumulate),
                         num_sanity_val_steps=0, devices=1, callbacks=[Watch()], **kw)
    adapter = Adapter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(adapter, train_dataloaders=loader)
        except RuntimeError as e:
            if ANOMALY_RE.search(str(e)) is None:
                raise
            res["tool"] = {"step": state["step"], **_anomaly_result(e, [str(w.message) for w in caught])}
    return res


RUNNERS = {"detect_anomaly": _run_detect_anomaly, "debug_underflow_overflow": _run_duo,
           "lightning_detect_anomaly": _run_lightning, "neuraldbg": _run_neuraldbg}


# --------------------------------------------------------------------------------------------------

def _truth(name: str) -> dict[str, Any] | None:
    p = HERE / "truth" / f"{name}.json"
    if not p.exists():
        return None
    d = json.loads(p.read_text())
    return {k: d.get(k) for k in ("kind", "first_bad_step", "cause", "module")}


def run(tool: str, name: str, steps: int | None = None) -> dict[str, Any]:
    if tool not in RUNNERS:
        raise ValueError(f"unknown tool {tool!r}; one of {TOOLS}")
    mod = load(name)
    steps = int(steps or mod.STEPS)
    plain = _plain(mod, steps)
    out: dict[str, Any] = {"tool": tool, "name": name, "kind": mod.KIND, "steps_run": 0, "alarm": False,
                           "step": None, "cause": None, "module": None, "message": "", "overhead": None,
                           "seconds": None, "crashed": None, "by": None, "tool_alarm": False, "tool_step": None,
                           "loop_nonfinite_step": None, "node": None, "where": None,
                           "plain_seconds": round(plain["seconds"], 3), "plain_steps": plain["steps"],
                           "plain_first_bad": plain["first_bad"], "median_step_s": None,
                           "plain_median_step_s": plain["median"], "truth": _truth(name), "detail": None}
    if tool == "neuraldbg":
        out["nonfinite_hypothesis"] = None
    state: dict[str, Any] = {"step": 0, "first_bad": None}
    res: dict[str, Any] = {}
    with warnings.catch_warnings():   # import the tool's package outside the timed run
        warnings.simplefilter("ignore")
        importlib.import_module({"debug_underflow_overflow": "transformers.debug_utils",
                                 "lightning_detect_anomaly": "lightning.pytorch",
                                 "neuraldbg": "neuraldbg"}.get(tool, "torch"))
    t0 = time.perf_counter()
    err = None
    target = mod.target()
    try:
        RUNNERS[tool](target, steps, state, res)
    except Exception as e:  # noqa: BLE001  the program's own exception, or the tool's unrelated one
        err = e
    out["seconds"] = round(time.perf_counter() - t0, 3)
    clock = res.get("clock")
    recs = res.get("recs") or []
    loop_bad = state.get("first_bad")
    out["loop_nonfinite_step"] = loop_bad
    tool_info = res.get("tool")
    if err is not None:
        if loop_bad is not None and state.get("step", 0) > loop_bad:
            out["detail"] = f"after the non-finite step {loop_bad}: {type(err).__name__}: {err}"[:300]
        else:
            out["crashed"] = f"{type(err).__name__}: {err}"[:300]
            out["detail"] = "".join(traceback.format_exception(type(err), err, err.__traceback__))[-1500:]
    # steps started: the step in progress when the tool (or the program) raised, else the steps completed
    out["steps_run"] = state.get("step", 0) + 1 if (tool_info is not None or err is not None) else len(recs)
    if clock is not None:
        out["median_step_s"] = clock.median()
        if out["median_step_s"] and plain["median"]:
            out["overhead"] = round(out["median_step_s"] / plain["median"], 3)

    if tool == "neuraldbg":
        hyps = res.get("hyps") or []
        dbg = res.get("dbg")
        pos = {id(e): i for i, e in enumerate(dbg.events)} if dbg is not None else {}

        def chrono(th):
            h = th[1]
            st = _hyp_step(h)
            return (st if st is not None else 10 ** 9, pos.get(id(h.evidence[0]), 10 ** 9) if h.evidence else 10 ** 9)
        out["tool_alarm"] = bool(hyps)
        out["hypotheses"] = {"count": {ft: sum(1 for t, _ in hyps if t == ft) for ft in {t for t, _ in hyps}},
                             "first": [{"type": t, "description": h.description, "confidence": round(h.confidence, 3),
                                        "step": _hyp_step(h), "chain": h.causal_chain[:3],
                                        "to": str(h.evidence[0].to_state) if h.evidence else None}
                                       for t, h in sorted(hyps, key=chrono)[:20]]}
        if hyps:
            ft, h = min(hyps, key=chrono)
            out["tool_step"] = _hyp_step(h)
            out["step"] = out["tool_step"]
            out["cause"] = NEURALDBG_CAUSES.get(ft)
            ev = h.evidence[0] if h.evidence else None
            out["module"] = ev.layer_name if ev is not None else None
            out["message"] = f"{ft}: {h.description} ({ev.from_state} -> {ev.to_state})"[:300] if ev else h.description
            out["alarm"] = True
            out["by"] = "tool"
            # its first hypothesis about a non-finite value (NaN/Inf data, diverging loss), if any
            nf = [(t, h2) for t, h2 in hyps if h2.evidence and str(h2.evidence[0].to_state) in NONFINITE_STATES]
            if nf:
                t2, h2 = min(nf, key=chrono)
                out["nonfinite_hypothesis"] = {"step": _hyp_step(h2), "cause": NEURALDBG_CAUSES.get(t2),
                                               "module": h2.evidence[0].layer_name,
                                               "to": str(h2.evidence[0].to_state), "type": t2}
        elif loop_bad is not None:
            out["message"] = f"no hypothesis; the loop saw a non-finite step {loop_bad}"
        if not hyps and loop_bad is None:
            out["message"] = "no hypothesis"
    else:
        if tool_info is not None:
            out["tool_alarm"] = True
            out["tool_step"] = tool_info["step"]
            out["cause"] = tool_info.get("cause")
            out["module"] = tool_info.get("module")
            out["node"] = tool_info.get("node")
            out["where"] = tool_info.get("where")
            out["message"] = tool_info.get("message", "")[:300]
        cands = [s for s in (out["tool_step"], loop_bad) if s is not None]
        if cands:
            out["alarm"] = True
            out["step"] = min(cands)
            if out["tool_step"] is not None and loop_bad is not None:
                out["by"] = "tool" if out["tool_step"] < loop_bad else ("loop" if loop_bad < out["tool_step"]
                                                                          else "tool+loop")
            else:
                out["by"] = "tool" if out["tool_step"] is not None else "loop"
            if tool_info is None:
                out["message"] = f"the loop saw a non-finite loss/gradient/parameter at step {loop_bad}; the tool raised nothing"
    if out["crashed"]:
        out["message"] = out["message"] or out["crashed"]
    out["message"] = (out["message"] or "")[:300]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tool", choices=TOOLS)
    p.add_argument("name")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--json", required=True, help="write the result here")
    a = p.parse_args()
    res = run(a.tool, a.name, a.steps)
    Path(a.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    short = {k: res[k] for k in ("tool", "name", "kind", "steps_run", "alarm", "step", "cause", "module",
                                 "overhead", "seconds", "crashed")}
    print(json.dumps(short))


if __name__ == "__main__":
    main()
