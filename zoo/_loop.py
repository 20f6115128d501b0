"""The zoo's plain training loop: the nanprobe entrypoint contract, run without nanprobe.

``python zoo/programs/<name>.py`` calls :func:`main`, which trains the program's ``target()`` the
way the contract describes (and as the program's own loop did), prints one line per step, and ends
with the first non-finite step, if any. ``zoo/measure_truth.py`` calls :func:`train` to measure the
program's truth (never importing nanprobe). The loop per optimizer step::

    for each of `accumulate` micro-batches:
        with torch.autocast(..., enabled=precision != "fp32"):
            loss = loss_fn(model, batch)          # or step_fn(model, batch, step): the user's whole step
        (scaler.scale(loss / accumulate) if scaler else loss / accumulate).backward()
    [scaler.unscale_(opt)]; [clip_grad_norm_(model.parameters(), max_grad_norm)]
    scaler.step(opt) / opt.step(); scaler.update(); scheduler.step()
    (opt.zero_grad(set_to_none=True) comes first in each step; a step_fn does all of it itself)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _objects(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def _items(target: dict[str, Any]) -> Iterator[Any]:
    batches = target["batches"]
    if callable(batches):
        i = 0
        while True:
            yield batches(i)
            i += 1
    for epoch in range(int(target.get("epochs", 1))):
        sampler = getattr(batches, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from batches


def _scalar(x: Any) -> float:
    return float(x.detach().float()) if isinstance(x, torch.Tensor) else float(x)


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


def train(target: dict[str, Any], steps: int, *, on_step: Callable[[dict[str, Any]], None] | None = None,
          measure: Callable[[torch.nn.Module, int], dict[str, float]] | None = None,
          stop_at_nonfinite: bool = True) -> list[dict[str, Any]]:
    """Train ``steps`` optimizer steps; one record per step: ``{"step", "loss", "finite", "lr", ...}``
    (a step_fn's dict of losses adds its keys; ``measure(model, step)`` adds its numbers)."""
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
    for step in range(steps):
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
        if measure is not None and not bad:
            with torch.no_grad():
                rec.update(measure(model, step))
        out.append(rec)
        if on_step is not None:
            on_step(rec)
        if bad and stop_at_nonfinite:
            break
    return out


def main(make: Callable[..., dict[str, Any]], steps: int, fixes: dict[str, str] | None = None) -> None:
    """``python <program>.py [--steps N] [--fix NAME] [--log FILE]``: the program's plain run."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--fix", choices=sorted(fixes or {}), default=None)
    p.add_argument("--log", default=None, help="write one JSON line per step here")
    a = p.parse_args()
    target = make({"fix": a.fix} if a.fix else None)
    log = open(a.log, "w") if a.log else None

    def show(rec: dict[str, Any]) -> None:
        extra = " ".join(f"{k}={v:.4g}" for k, v in rec.items() if k not in ("step", "loss", "finite", "lr")
                         and isinstance(v, float))
        print(f"step {rec['step']:4d}  loss {rec['loss']:.5g}  {extra}", flush=True)
        if log:
            log.write(json.dumps(rec) + "\n")

    records = train(target, a.steps, on_step=show)
    bad = next((r["step"] for r in records if not r["finite"]), None)
    print(f"first non-finite step: {bad}" if bad is not None else f"{len(records)} steps, all finite")
    if log:
        log.close()
    sys.exit(0)
