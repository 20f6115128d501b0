"""The zoo's scoreboard: nanprobe (smoke, run, watch) and what a user would pick instead, on real programs.

    python scripts/zoo_scoreboard.py                      # every program, smoke + run + watch
    python scripts/zoo_scoreboard.py --alternatives       # ... and detect_anomaly, DebugUnderflowOverflow,
                                                          #     Lightning's detect_anomaly, neuraldbg
    python scripts/zoo_scoreboard.py --only vae_kl_anneal ppo_cartpole --commands smoke
    python scripts/zoo_scoreboard.py --table zoo/scoreboard.json   # print the tables of a saved run

Each program of ``zoo/programs`` has its truth in ``zoo/truth/NAME.json``, measured without nanprobe
(``zoo/measure_truth.py``). Every command runs as its own process (``OMP_NUM_THREADS=1``, ``--jobs`` at
a time) in a scratch folder, exactly as a user would type it:

- ``nanprobe smoke zoo/programs/NAME.py:target --steps STEPS --json OUT``
- ``nanprobe run zoo/programs/NAME.py:target --max-steps STEPS --json OUT``
- ``nanprobe watch --json OUT -- python zoo/programs/NAME.py``

and is scored against the truth:

- false alarm: a healthy program that got exit 1, a warning line, a bad step or a report;
- crash: exit 3, or a Python traceback from nanprobe itself;
- cause: the top finding's cause code is the truth's (broken and trajectory programs);
- mechanism: the top finding's mechanism is the truth's (trajectory programs whose truth names one);
- onset: the top finding's onset (or the trajectory's) inside the truth's range;
- verified fixes that hold: every fix nanprobe marked verified, matched by kind (clipping, LR, warm-up,
  qk-norm, z-loss, eps, precision) to the fix the program measured over its whole run.

Results go to ``--out`` (JSON, one row per program and command); the tables are printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "zoo"
COMMANDS = ("smoke", "run", "watch")
ONSET_SLACK = 2   # steps: the precursor monitor samples every 2nd step in replay and smoke
TOOLS = ("detect_anomaly", "debug_underflow_overflow", "lightning_detect_anomaly", "neuraldbg")


def programs(only: list[str] | None) -> list[dict]:
    out = []
    for f in sorted((ZOO / "truth").glob("*.json")):
        if f.name.startswith("scoreboard"):
            continue
        truth = json.loads(f.read_text())
        if only and truth["name"] not in only:
            continue
        if (ZOO / "programs" / f"{truth['name']}.py").exists():
            out.append(truth)
    return out


def _nanprobe() -> list[str]:
    return [sys.executable, "-m", "nanprobe.surface.cli"] if not _which("nanprobe") else [_which("nanprobe")]


def _which(name: str) -> str | None:
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else None


def command_line(cmd: str, truth: dict, out: Path) -> list[str]:
    prog = str(ZOO / "programs" / f"{truth['name']}.py")
    steps = str(truth["steps"])
    if cmd == "smoke":
        return _nanprobe() + ["smoke", f"{prog}:target", "--steps", steps, "--json", str(out)]
    if cmd == "run":
        return _nanprobe() + ["run", f"{prog}:target", "--max-steps", steps, "--json", str(out)]
    if cmd == "watch":
        return _nanprobe() + ["watch", "--json", str(out), "--", sys.executable, prog]
    return [sys.executable, str(ZOO / "alternatives.py"), cmd, truth["name"], "--json", str(out)]


def run_one(cmd: str, truth: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"zoo-{truth['name']}-{cmd}-") as tmp:
        out = Path(tmp) / "report.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "COLUMNS": "120"}
        t0 = time.perf_counter()
        try:
            p = subprocess.run(command_line(cmd, truth, out), cwd=tmp, env=env, capture_output=True, text=True,
                               timeout=timeout)
            rc, stdout, stderr = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stdout, stderr = None, (exc.stdout or b"").decode(errors="replace") if isinstance(
                exc.stdout, bytes) else (exc.stdout or ""), "timeout"
        seconds = time.perf_counter() - t0
        report = None
        if out.exists():
            try:
                report = json.loads(out.read_text())
            except json.JSONDecodeError:
                report = None
    return {"name": truth["name"], "command": cmd, "rc": rc, "seconds": round(seconds, 1), "report": report,
            "stderr": stderr[-4000:], "stdout_tail": stdout[-1500:]}


# -- scoring ----------------------------------------------------------------------------------------

# the first word found names the fix's kind: what it changes first ("Lower the learning rate ... and warm up to
# it" lowers the LR; "Warm up longer" warms up)
FIX_KINDS = (("qk", "qk_norm"), ("z-loss", "z_loss"), ("zloss", "z_loss"), ("clip", "clip"),
             ("learning rate", "lr"), ("warm", "warmup"), ("eps", "eps"), ("beta", "beta2"),
             ("weight decay", "weight_decay"), ("weight_decay", "weight_decay"), ("bf16", "precision"),
             ("fp32", "precision"), ("precision", "precision"), ("t_total", "schedule"), ("schedule", "schedule"),
             ("lr", "lr"))


def fix_kind(text: str) -> str | None:
    t = text.lower()
    for word, kind in FIX_KINDS:
        if word in t:
            return kind
    return None


def _top(report: dict | None) -> dict | None:
    if not report:
        return None
    f = report.get("findings") or []
    return f[0] if f else None


def _warned(row: dict) -> bool:
    """An early warning (the monitor's one line: a precursor heading for failure). A note that the loss rose
    with nothing behind it is information, not an alarm: it is counted apart (``rise_note``)."""
    err = row.get("stderr") or ""
    traj = (row.get("report") or {}).get("trajectory") or {}
    return "early warning" in err or bool(traj.get("warnings"))


def _rise_note(row: dict) -> bool:
    rep = row.get("report") or {}
    notes = " ".join((rep.get("smoke") or {}).get("notes", []) + list(rep.get("notes", [])))
    return "with nothing behind it" in notes


def _crashed(row: dict) -> bool:
    err = row.get("stderr") or ""
    return row["rc"] == 3 or row["rc"] is None or "internal error" in err or (
        "Traceback" in err and "nanprobe" in err.split("Traceback")[-1] and row["command"] in COMMANDS)


def _watch_bad(row: dict) -> bool:
    m = re.search(r"(\d+) bad step", row.get("stderr") or "")
    return bool(m and int(m.group(1)) > 0) or row.get("report") is not None


def score(row: dict, truth: dict) -> dict:
    cmd, rep = row["command"], row.get("report")
    top = _top(rep)
    s: dict = {"crash": _crashed(row)}
    if cmd in COMMANDS:
        alarm = (row["rc"] == 1 and cmd != "watch") or _warned(row) or (cmd == "watch" and _watch_bad(row))
        s["alarm"] = alarm
        s["rise_note"] = _rise_note(row)
        s["status"] = rep.get("status") if rep else None
        s["cause"] = top.get("cause") if top else None
        s["mechanism"] = top.get("mechanism") if top else None
        onset = (top or {}).get("onset")
        if onset is None and rep and rep.get("trajectory"):
            onset = rep["trajectory"].get("onset")
        s["onset"] = onset
        s["step"] = rep.get("step") if rep else None
        verified = []
        for f in (rep or {}).get("findings", []):
            for fx in f.get("fixes", []):
                if fx.get("verified") is True:
                    verified.append(fx.get("title", ""))
        s["verified"] = verified
    else:
        s["alarm"] = bool(rep and rep.get("alarm"))
        s["cause"] = rep.get("cause") if rep else None
        s["step"] = rep.get("step") if rep else None
        s["overhead"] = rep.get("overhead") if rep else None
        s["crash"] = row["rc"] not in (0, 1) or bool(rep and rep.get("crashed"))
    kind = truth["kind"]
    s["false_alarm"] = kind == "healthy" and s["alarm"]
    if kind != "healthy":
        s["cause_ok"] = s["cause"] == truth.get("cause")
        if truth.get("mechanism"):
            s["mechanism_ok"] = s.get("mechanism") == truth["mechanism"]
        if truth.get("onset"):   # the replay monitors every 2nd step: its onset is known to +-2 steps
            lo, hi = truth["onset"]
            s["onset_ok"] = s.get("onset") is not None and lo - ONSET_SLACK <= s["onset"] <= hi + ONSET_SLACK
        holds = []
        for title in s.get("verified", []):
            kind_ = fix_kind(title)
            match = [v for k, v in truth.get("fixes", {}).items()
                     if kind_ and (fix_kind(k + " " + v.get("what", "")) == kind_)]
            holds.append({"fix": title, "kind": kind_, "holds": match[0]["holds"] if match else None})
        s["verified_holds"] = holds
    return s


def _pct(xs: list[bool]) -> str:
    return f"{sum(xs)}/{len(xs)}" if xs else "-"


def tables(rows: list[dict], truths: dict[str, dict]) -> str:
    lines = []
    cmds = [c for c in COMMANDS + TOOLS if any(r["command"] == c for r in rows)]
    by = {(r["name"], r["command"]): r for r in rows}
    lines.append("| program | kind | truth | " + " | ".join(cmds) + " |")
    lines.append("|---|---|---|" + "---|" * len(cmds))
    for name, t in sorted(truths.items(), key=lambda kv: (kv[1]["kind"], kv[0])):
        truth = "healthy" if t["kind"] == "healthy" else "/".join(
            str(x) for x in (t.get("cause"), t.get("mechanism") or "-") ) + (
            f" onset {t['onset'][0]}-{t['onset'][1]}" if t.get("onset") else "") + (
            f" bad@{t['first_bad_step']}" if t.get("first_bad_step") is not None else "")
        cells = []
        for c in cmds:
            r = by.get((name, c))
            if r is None:
                cells.append("")
                continue
            s = r["score"]
            if s["crash"]:
                cells.append(f"CRASH rc={r['rc']}")
                continue
            if t["kind"] == "healthy":
                cells.append("FALSE ALARM" if s["false_alarm"] else "ok")
                continue
            if not s["alarm"] and not s.get("cause"):
                cells.append("missed")
                continue
            bits = [str(s.get("cause") or "?")]
            if s.get("mechanism"):
                bits.append(s["mechanism"])
            if s.get("onset") is not None:
                bits.append(f"onset {s['onset']}")
            mark = "✓" if s.get("cause_ok") and s.get("mechanism_ok", True) and s.get("onset_ok", True) else "✗"
            cells.append(f"{mark} " + " ".join(bits))
        lines.append(f"| {name} | {t['kind']} | {truth} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| command | failures detected | false alarms (healthy) | crashes | top-1 cause | mechanism | "
                 "onset in range | verified fixes that hold | overhead per step (median) |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for c in cmds:
        rs = [r for r in rows if r["command"] == c]
        detected = [r["score"]["alarm"] for r in rs if truths[r["name"]]["kind"] != "healthy"]
        healthy = [r["score"]["false_alarm"] for r in rs if truths[r["name"]]["kind"] == "healthy"]
        crash = [r["score"]["crash"] for r in rs]
        cause = [r["score"].get("cause_ok", False) for r in rs if truths[r["name"]]["kind"] != "healthy"]
        mech = [r["score"]["mechanism_ok"] for r in rs if "mechanism_ok" in r["score"]]
        onset = [r["score"]["onset_ok"] for r in rs if "onset_ok" in r["score"]]
        holds = [h["holds"] for r in rs for h in r["score"].get("verified_holds", []) if h["holds"] is not None]
        unknown = sum(1 for r in rs for h in r["score"].get("verified_holds", []) if h["holds"] is None)
        over = [r["score"]["overhead"] for r in rs if r["score"].get("overhead")]
        lines.append(f"| {c} | {_pct(detected)} | {_pct(healthy)} | {_pct(crash)} | {_pct(cause)} | {_pct(mech)} | {_pct(onset)} | "
                     f"{_pct(holds)}" + (f" (+{unknown} unmatched)" if unknown else "") + " | "
                     + (f"{statistics.median(over):.2f}x" if over else "-") + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*")
    p.add_argument("--commands", default=",".join(COMMANDS))
    p.add_argument("--alternatives", action="store_true", help="also run " + ", ".join(TOOLS))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(ZOO / "scoreboard.json"))
    p.add_argument("--table", default=None, help="score a saved --out file against the truth now on disk, print "
                                                   "its tables and exit")
    a = p.parse_args()
    if a.table:   # the saved runs, scored again against the truth on disk now
        saved = json.loads(Path(a.table).read_text())
        truths = {t["name"]: t for t in programs(None)}
        rows = [dict(r, score=score(r, truths[r["name"]])) for r in saved["rows"] if r["name"] in truths]
        print(tables(rows, {k: v for k, v in truths.items() if any(r["name"] == k for r in rows)}))
        return
    truths = {t["name"]: t for t in programs(a.only)}
    cmds = [c for c in a.commands.split(",") if c] + (list(TOOLS) if a.alternatives else [])
    jobs = [(c, t) for t in truths.values() for c in cmds]
    rows: list[dict] = []
    t0 = time.perf_counter()

    def one(job):
        c, t = job
        r = run_one(c, t, a.timeout)
        r["score"] = score(r, t)
        s = r["score"]
        print(f"[{time.perf_counter() - t0:6.0f}s] {t['name']:32s} {c:26s} rc={r['rc']} {r['seconds']:6.1f}s "
              f"alarm={s['alarm']} cause={s.get('cause')} mech={s.get('mechanism')} onset={s.get('onset')}"
              + (" CRASH" if s["crash"] else "") + (" FALSE-ALARM" if s["false_alarm"] else ""), flush=True)
        return r

    with ThreadPoolExecutor(max_workers=max(a.jobs, 1)) as pool:
        rows = list(pool.map(one, jobs))
    Path(a.out).write_text(json.dumps({"rows": rows, "truths": truths}, indent=1) + "\n")
    print()
    print(tables(rows, truths))


if __name__ == "__main__":
    main()
