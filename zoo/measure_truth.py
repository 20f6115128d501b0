"""Measure a zoo program's truth without nanprobe: the plain run, and each fix over the whole run.

    python zoo/measure_truth.py NAME [NAME ...]      # or --all

For each program it trains ``target()`` with the zoo's plain loop (zoo/_loop.py; nanprobe is never
imported), with the program's ``measure(model, step)`` precursor numbers where it defines one, then
trains once per entry of ``FIXES`` over the same number of steps. It writes
``zoo/truth/NAME.log`` (every step of every run, JSON lines) and ``zoo/truth/NAME.json``:

- ``kind``, ``cause``, ``mechanism``, ``module``, ``onset``: the program's ``TRUTH`` (what its author
  established from the measurement, with ``how``), copied as stated;
- ``first_bad_step``: the first non-finite step of the plain run (measured);
- ``loss``: first, best level (running median of 10) and final level (median of the last 10 steps);
- ``fixes``: per fix, whether it holds over the whole run: finite at every step and still learning at
  the end (final level at or below the unfixed run's best level before the onset, within noise).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _loop  # noqa: E402

WINDOW = 10


def load(name: str):
    path = HERE / "programs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"zoo_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses under `from __future__ import annotations` look it up
    spec.loader.exec_module(mod)
    return mod


def levels(losses: list[float]) -> list[float]:
    """The running median of ``WINDOW`` losses (the loss level; one step's noise mostly averages out)."""
    return [statistics.median(losses[max(0, i - WINDOW + 1):i + 1]) for i in range(len(losses))]


def noise(losses: list[float]) -> float:
    """Robust sigma of one step's loss, from the step-to-step changes."""
    d = [abs(b - a) for a, b in zip(losses, losses[1:])]
    return 1.4826 * statistics.median(d) / math.sqrt(2) if d else 0.0


def summary(records: list[dict], upto: int | None = None) -> dict:
    losses = [r["loss"] for r in records if r["finite"] and math.isfinite(r["loss"])]
    if not losses:
        return {"first": None, "best": None, "best_before": None, "final": None, "noise": None}
    lv = levels(losses)
    before = [v for r, v in zip([r for r in records if r["finite"]], lv)
              if upto is None or r["step"] < upto]
    return {"first": losses[0], "best": min(lv), "best_before": min(before) if before else None,
            "final": statistics.median(losses[-WINDOW:]), "noise": noise(losses)}


def holds(fixed: list[dict], steps: int, unfixed_best: float | None) -> tuple[bool, str]:
    if len(fixed) < steps or not all(r["finite"] for r in fixed):
        bad = next((r["step"] for r in fixed if not r["finite"]), len(fixed))
        return False, f"non-finite at step {bad}"
    s = summary(fixed)
    tol = max(0.05 * abs(unfixed_best or 0.0), 3 * (s["noise"] or 0.0) / math.sqrt(WINDOW))
    if unfixed_best is not None and s["final"] > unfixed_best + tol:
        return False, (f"stopped learning: final level {s['final']:.4g} above the unfixed run's best level "
                       f"before the onset {unfixed_best:.4g} (+{tol:.3g})")
    own = s["best"] + max(0.1 * abs(s["best"]), 4 * (s["noise"] or 0.0))
    if s["final"] > own:
        return False, f"broke away: final level {s['final']:.4g} above its own best {s['best']:.4g}"
    return True, f"held: final level {s['final']:.4g}"


def measure(name: str) -> dict:
    mod = load(name)
    steps = mod.STEPS
    truth = dict(getattr(mod, "TRUTH", {}))
    log = open(HERE / "truth" / f"{name}.log", "w")
    runs: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    for fix in [None, *getattr(mod, "FIXES", {})]:
        target = mod.target({"fix": fix} if fix else None)
        ev = getattr(mod, "evaluate", None)
        before = ev(target["model"]) if ev else None
        recs = _loop.train(target, steps, measure=getattr(mod, "measure", None))
        after = ev(target["model"]) if ev and all(r["finite"] for r in recs) else None
        runs[fix or "unfixed"] = recs
        for r in recs:
            log.write(json.dumps({"run": fix or "unfixed", **r}) + "\n")
        if before is not None:
            log.write(json.dumps({"run": fix or "unfixed", "evaluate_before": before, "evaluate_after": after}) + "\n")
            if fix is None:
                truth["evaluate"] = {"before": before, "after": after}
    log.close()
    base = runs["unfixed"]
    bad = next((r["step"] for r in base if not r["finite"]), None)
    onset = truth.get("onset")
    upto = onset[0] if onset else bad
    s = summary(base, upto)
    out = {"name": name, "kind": mod.KIND, "steps": steps, "first_bad_step": bad, "ran": len(base),
           **{k: truth.get(k) for k in ("cause", "mechanism", "module", "onset")},
           "how": truth.get("how"), "loss": {k: (round(v, 6) if v is not None else None) for k, v in s.items()},
           "evaluate": truth.get("evaluate"), "fixes": {}, "seconds": round(time.perf_counter() - t0, 1)}
    for fix, recs in runs.items():
        if fix == "unfixed":
            continue
        ok, why = holds(recs, steps, s["best_before"])
        out["fixes"][fix] = {"holds": ok, "why": why, "what": mod.FIXES[fix]}
    (HERE / "truth" / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("names", nargs="*")
    p.add_argument("--all", action="store_true")
    a = p.parse_args()
    names = sorted(f.stem for f in (HERE / "programs").glob("*.py")) if a.all else a.names
    for n in names:
        res = measure(n)
        print(json.dumps({k: res[k] for k in ("name", "kind", "first_bad_step", "loss", "seconds")}))
        for fx, v in res["fixes"].items():
            print(f"   fix {fx}: {v['why']}")
