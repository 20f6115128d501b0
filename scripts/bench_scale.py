"""nanprobe at training scale, against the user's own plain training loop.

For each model size (a GPT-style transformer from examples/healthy_transformer.py, bf16 autocast,
AdamW, warmup-cosine LR, clipping) it runs, each in a fresh process:

* ``plain``   — the user's own loop (written out below, no nanprobe): steps 0..N, and the
                process's peak RSS;
* ``peak``    — ``nanprobe run --at N`` alone, for its process's peak RSS;
* ``run``     — ``nanprobe run --at N`` with the user's own loop on an identical model stepped
                right after each replayed step (interleaved: the same machine load), then the
                whole diagnosis of step N, then the user's step, nanprobe's plain rerun and its
                instrumented rerun of step N as the diagnosis runs them (forward and backward
                checked op by op, no optimizer update: the replayed update was finite), and the
                worst case (the update too, every phase checked), interleaved;
* ``compare`` — ``nanprobe compare-precisions --at N``, timed, with the user's fp32 step beside it;
* ``capsule_write`` / ``capsule_read`` — the capsule of step N, its bytes per parameter, and the
                peak RSS of ``nanprobe run --capsule`` on it, alone in its process.

Beside them, the user's step under ``torch.autograd.detect_anomaly()``, the usual first move.

and prints ratios: replay per step / plain step, diagnosis in plain steps, instrumented rerun /
plain step, compare-precisions in fp32 steps, and peak RSS of ``run`` / peak RSS of the plain loop
(whole processes, including Python and torch). Run:

    python scripts/bench_scale.py                       # sizes ~1M, ~10M, ~42M params, 1 thread
    python scripts/bench_scale.py --sizes 42M --at 10 --threads 1
    python scripts/bench_scale.py --device cuda --sizes 124M
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 64   # batches in the benchmark targets (--at must stay below)
ENTRY = str(ROOT / "examples" / "healthy_transformer.py") + ":target"
SIZES = {   # name -> transformer config (params counted at run time)
    "1M": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 64, "batch_size": 4},
    "10M": {"d_model": 256, "n_layers": 12, "n_heads": 4, "seq_len": 64, "batch_size": 4},
    "42M": {"d_model": 512, "n_layers": 13, "n_heads": 8, "seq_len": 64, "batch_size": 4},
    "124M": {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 512, "batch_size": 8, "vocab_size": 50304},
}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _build(size: str, device: str):
    sys.path.insert(0, str(ROOT / "examples"))
    from healthy_transformer import target

    t = target(dict(SIZES[size], steps=STEPS))
    if device != "cpu":
        t["model"].to(device)   # the same Parameter objects: the optimizer follows
    return t


def _target(size: str, device: str):
    from nanprobe.reach.target import to_device, validate

    t = validate(_build(size, "cpu"), "bench")
    return to_device(t, device) if device != "cpu" else t


def plain_steps(t: dict, steps: int, device: str, times: list[float] | None = None, first: int = 0) -> None:
    """The user's own loop: what their script does each step (no nanprobe anywhere)."""
    import torch

    model, opt, sched = t["model"], t["optimizer"], t["scheduler"]
    device_type = device.split(":")[0]
    batches = t["batches"]
    for step in range(first, first + steps):
        x, y = batches[step % len(batches)]
        if device != "cpu":
            x, y = x.to(device), y.to(device)
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = t["loss_fn"](model, (x, y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["max_grad_norm"])
        opt.step()
        sched.step()
        loss.item()   # the user's loop logs the loss: one sync per step
        _sync(device)
        if times is not None:
            times.append(time.perf_counter() - t0)


def child_plain(size: str, at: int, device: str) -> dict:
    t = _build(size, device)
    times: list[float] = []
    plain_steps(t, at + 1, device, times)
    params = sum(p.numel() for p in t["model"].parameters())
    return {"params": params, "plain_step": statistics.median(times[1:]), "peak_mb": _peak_mb(), "times": times}


def child_run(size: str, at: int, device: str) -> dict:
    """``nanprobe run --at N`` on target B, with the user's own loop on an identical target A stepped
    right after each replayed step (interleaved, so both see the same machine load); then the
    diagnosis, and the user's step / nanprobe's plain and instrumented reruns, interleaved too."""
    from nanprobe.base.config import load_config
    from nanprobe.pipeline.diagnose import diagnose_target
    from nanprobe.reach.entry import Loaded
    from nanprobe.reach.replay import reach
    from nanprobe.locate.rerun import run_step

    import torch
    cfg = load_config()
    user_t, twin_t = _build(size, device), _build(size, device)
    t = _target(size, device)
    loaded = Loaded(target=t, entry="bench", module="", function="", path=None, lineno=None)
    replay_times, user_times, twin_times = [], [], []
    last = [time.perf_counter()]

    def progress(k: int) -> None:      # nanprobe finished replaying step k: time it, then the user's step k
        _sync(device)
        replay_times.append(time.perf_counter() - last[0])
        plain_steps(user_t, 1, device, user_times, first=k)
        plain_steps(twin_t, 1, device, twin_times, first=k)   # the same loop again: the noise floor
        last[0] = time.perf_counter()

    reached = reach(t, at=at, precision=t.precision, cfg=cfg.replay, where="bench", on_progress=progress)
    del user_t, twin_t
    t0 = time.perf_counter()
    report = diagnose_target(loaded, reached=reached, config=cfg)
    _sync(device)
    t_diag = time.perf_counter() - t0
    user, plain, inst = [], [], []
    step_t = {"model": t.model, "optimizer": t.optimizer, "scheduler": t.scheduler, "loss_fn": t.loss_fn,
              "max_grad_norm": t.max_grad_norm, "batches": [reached.batch]}

    def timed(fn, out):
        _sync(device)
        a = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - a)

    # the reruns as the diagnosis makes them: restored at their start (only what a forward pass changes,
    # when the step before stopped before its update), no restore after
    from nanprobe.base.report import Phase
    fwd_bwd = frozenset({Phase.FORWARD, Phase.BACKWARD})
    anomaly, full = [], []
    for _ in range(4):
        reached.restore()
        plain_steps(step_t, 1, device, user)
        reached.restore()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly():      # what people reach for today, on the user's own step
                plain_steps(step_t, 1, device, anomaly)
        reached.restore()
        timed(lambda: run_step(t, reached, reached.precision, where="bench", instrument=False, restore_after=False,
                               update=False, ratios=False), plain)
        timed(lambda: run_step(t, reached, reached.precision, where="bench", instrument=True, restore_after=False,
                               update=False, phases=fwd_bwd), inst)
        # the worst case: the update rerun too, every phase checked op by op (an update-born failure)
        timed(lambda: run_step(t, reached, reached.precision, where="bench", instrument=True, restore_after=False,
                               update=True), full)
    reached.restore()
    ks = range(2, len(replay_times))   # steps 0-1 allocate the optimizer state and warm the allocator
    return {"replay_ratio": statistics.median(replay_times[k] / user_times[k] for k in ks),
            "noise_ratio": statistics.median(twin_times[k] / user_times[k] for k in ks),
            "diagnosis": t_diag, "user_step": statistics.median(user[1:]),
            "rerun_plain": statistics.median(plain[1:]), "rerun_instrumented": statistics.median(inst[1:]),
            "anomaly": statistics.median(anomaly[1:]), "rerun_full": statistics.median(full[1:]),
            "status": report.status.value}


def child_peak(size: str, at: int, device: str) -> dict:
    """The whole-process peak RSS of ``nanprobe run --at N`` (nothing else in the process)."""
    from nanprobe.base.config import load_config
    from nanprobe.pipeline.diagnose import diagnose_target
    from nanprobe.reach.entry import Loaded

    cfg = load_config()
    t = _target(size, device)
    loaded = Loaded(target=t, entry="bench", module="", function="", path=None, lineno=None)
    diagnose_target(loaded, at=at, config=cfg)
    return {"peak_mb": _peak_mb()}


def child_capsule_write(size: str, at: int, device: str) -> dict:
    """The capsule of step N (as smoke writes it), into $NANPROBE_BENCH_DIR: its size and this process's peak."""
    from nanprobe import capsule
    from nanprobe.base.config import load_config
    from nanprobe.reach.replay import reach

    t = _target(size, device)
    reached = reach(t, at=at, precision=t.precision, cfg=load_config().replay, where="bench")
    path = capsule.write(capsule.build_from_reached(reached, entry="bench"), os.environ["NANPROBE_BENCH_DIR"])
    params = sum(p.numel() for p in t.model.parameters())
    return {"path": str(path), "bytes": os.path.getsize(path), "bytes_per_param": os.path.getsize(path) / params,
            "peak_mb": _peak_mb()}


def child_capsule_read(size: str, at: int, device: str) -> dict:
    """``nanprobe run --capsule`` on that capsule, alone in its process: the peak RSS."""
    from nanprobe.capsule import list_capsules, reach_from_capsule
    from nanprobe.base.config import load_config
    from nanprobe.pipeline.diagnose import diagnose_target
    from nanprobe.reach.entry import Loaded

    t = _target(size, device)
    loaded = Loaded(target=t, entry="bench", module="", function="", path=None, lineno=None)
    (path,) = list_capsules(os.environ["NANPROBE_BENCH_DIR"])
    reached = reach_from_capsule(path, loaded, load_config())
    report = diagnose_target(loaded, reached=reached, config=load_config())
    return {"peak_mb": _peak_mb(), "status": report.status.value, "fidelity": report.fidelity.reproduced}


def child_compare(size: str, at: int, device: str) -> dict:
    from nanprobe.compare import compare_precisions
    from nanprobe.base.config import load_config
    from nanprobe.reach.entry import Loaded
    from nanprobe.reach.replay import reach
    cfg = load_config()
    t = _target(size, device)
    loaded = Loaded(target=t, entry="bench", module="", function="", path=None, lineno=None)
    reached = reach(t, at=at, precision=t.precision, cfg=cfg.replay, where="bench")
    # the user's fp32 step on the same state and batch
    import torch
    fp32 = []
    for _ in range(3):
        reached.restore()
        opt = t.optimizer
        _sync(device)
        a = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = t.loss_fn(t.model, reached.batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), t.max_grad_norm)
        opt.step()
        loss.item()
        _sync(device)
        fp32.append(time.perf_counter() - a)
    reached.restore()
    from nanprobe import compare as cmp_mod
    real_reach = cmp_mod.runner.reach
    cmp_mod.runner.reach = lambda *a, **k: reached   # time the comparison, not a second replay
    try:
        _sync(device)
        a = time.perf_counter()
        compare_precisions(loaded, at=at, config=cfg)
        _sync(device)
        t_cmp = time.perf_counter() - a
    finally:
        cmp_mod.runner.reach = real_reach
    return {"compare": t_cmp, "fp32_step": statistics.median(fp32)}


def _child(mode: str, size: str, at: int, device: str, threads: int, extra_env: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **(extra_env or {}))
    cmd = [sys.executable, __file__, "--child", mode, "--sizes", size, "--at", str(at), "--device", device,
           "--threads", str(threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{mode} {size} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,10M,42M")
    parser.add_argument("--at", type=int, default=10, help=f"the step to diagnose (< {STEPS})")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-compare", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch
        torch.set_num_threads(args.threads)
        sys.path.insert(0, str(ROOT))
        fn = {"plain": child_plain, "run": child_run, "peak": child_peak, "compare": child_compare,
              "capsule_write": child_capsule_write, "capsule_read": child_capsule_read}[args.child]
        print(json.dumps(fn(args.sizes, args.at, args.device)))
        return
    print(f"device {args.device}, {args.threads} thread(s), --at {args.at}; ratios against the user's own plain step")
    rows = []
    for size in args.sizes.split(","):
        p = _child("plain", size, args.at, args.device, args.threads)
        peak = _child("peak", size, args.at, args.device, args.threads)
        r = _child("run", size, args.at, args.device, args.threads)
        c = None if args.no_compare else _child("compare", size, args.at, args.device, args.threads)
        with tempfile.TemporaryDirectory() as folder:
            w = _child("capsule_write", size, args.at, args.device, args.threads, {"NANPROBE_BENCH_DIR": folder})
            rd = _child("capsule_read", size, args.at, args.device, args.threads, {"NANPROBE_BENCH_DIR": folder})
        user = r["user_step"]
        row = {"size": size, "params": p["params"], "user_step_s": round(user, 4),
               "replay_per_step": round(r["replay_ratio"], 3), "user_vs_user": round(r["noise_ratio"], 3),
               "diagnosis_in_steps": round(r["diagnosis"] / user, 2),
               "instrumented_rerun": round(r["rerun_instrumented"] / user, 3),
               "plain_rerun": round(r["rerun_plain"] / user, 3),
               "instrumented_rerun_all_phases": round(r["rerun_full"] / user, 3),
               "detect_anomaly": round(r["anomaly"] / user, 3),
               "peak_rss_ratio": round(peak["peak_mb"] / p["peak_mb"], 3),
               "peak_mb": (round(p["peak_mb"]), round(peak["peak_mb"])),
               "capsule_bytes_per_param": round(w["bytes_per_param"], 2),
               "capsule_read_peak_ratio": round(rd["peak_mb"] / p["peak_mb"], 3),
               "capsule_fidelity": rd["fidelity"],
               "compare_in_fp32_steps": round(c["compare"] / c["fp32_step"], 1) if c else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\nsize     params   replay/step (user/user)  diagnosis(steps)  instr.rerun  peak RSS (plain -> run)"
          "  compare(fp32 steps)  capsule B/param, read peak")
    for r in rows:
        print(f"{r['size']:>5} {r['params'] / 1e6:8.1f}M {r['replay_per_step'] or 0:10.3f}x ({r['user_vs_user']:.3f}x)"
              f" {r['diagnosis_in_steps']:14.2f}"
              f" {r['instrumented_rerun']:11.3f}x   {r['peak_mb'][0]:6d} -> {r['peak_mb'][1]:6d} MB ({r['peak_rss_ratio']:.3f}x)"
              f" {r['compare_in_fp32_steps'] if r['compare_in_fp32_steps'] is not None else '-':>12}"
              f"   {r['capsule_bytes_per_param']:.1f}, {r['capsule_read_peak_ratio']:.3f}x")


if __name__ == "__main__":
    main()
