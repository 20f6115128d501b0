"""Overhead of nanprobe.Guard: median ratio of guarded to plain training-step time (budget <= 1.01).

Plain and guarded steps train the same model in the same process, interleaved in blocks
(plain block, guarded block, then guarded, plain: ABBA order cancels drift), many repeats.
The plain loop is what a user writes: zero_grad, autocast forward, (scaled) backward, clip,
step, scheduler. The guarded loop is the same with guard.step / guard.backward /
guard.optimizer_step. Timing covers whole blocks (one device synchronize per block), so the
guard's one sync per step is paid inside the measurement. Run:

    python scripts/bench_guard.py [--entry examples/healthy_transformer.py:target] [--pairs 200] [--block 5]

The Guard runs with the precursor monitor on (every ``monitor.live_every`` steps, as shipped);
``--no-monitor`` measures the Guard without it. A >= 30 ms step on CPU (the budget's regime):

    OMP_NUM_THREADS=1 python scripts/bench_guard.py --config '{"d_model": 256, "n_layers": 4, "seq_len": 64}'
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanprobe.reach.entry import load_target  # noqa: E402
from nanprobe.live.guard import Guard  # noqa: E402
from nanprobe.reach.step import make_scaler  # noqa: E402
from nanprobe.base.precision import autocast_context, device_of, parse_precision  # noqa: E402

DEFAULT_ENTRY = ROOT / "examples" / "healthy_transformer.py"


def _fallback_target(device: str):
    """A small transformer (examples/tiny_transformer.py) until examples/healthy_transformer.py exists."""
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_transformer import TinyTransformer, TransformerConfig, copy_task_batches, lm_loss
    torch.manual_seed(0)
    cfg = TransformerConfig()
    model = TinyTransformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batches = [(x.to(device), y.to(device)) for x, y in copy_task_batches(64, 16, cfg.max_len, cfg.vocab_size, 0)]
    return {"model": model, "loss_fn": lm_loss, "batches": batches, "optimizer": opt, "max_grad_norm": 1.0,
            "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", default=None, help="ENTRY (default: examples/healthy_transformer.py:target, "
                                                      "else a small transformer)")
    parser.add_argument("--pairs", type=int, default=200, help="ABBA repeats (each = 2 plain + 2 guarded blocks)")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--device", default=None, help="move the target to this device (e.g. cuda)")
    parser.add_argument("--clip", type=float, default=None, help="override max_grad_norm (0 = no clipping)")
    parser.add_argument("--config", default=None, help="JSON config dict passed to the entry function (model size)")
    parser.add_argument("--no-monitor", action="store_true", help="the Guard without the precursor monitor")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="wall: wall-clock time (default); thread: the training thread's CPU time (CPU, one "
                             "intra-op thread: robust to other load on the machine)")
    parser.add_argument("--monitor-cost", action="store_true",
                        help="also time a monitored step against a plain one (thread CPU time, interleaved): the "
                             "monitor's cost per monitored step and its share at monitor.every / live_every")
    args = parser.parse_args()

    if args.entry is None and DEFAULT_ENTRY.exists():
        args.entry = f"{DEFAULT_ENTRY}:target"
    if args.entry:
        target = load_target(args.entry, config=json.loads(args.config) if args.config else None).target
        model, opt, loss_fn, sched = target.model, target.optimizer, target.loss_fn, target.scheduler
        if args.device:
            model.to(args.device)
        batches = target.batches
        clip = target.max_grad_norm
        precision = target.precision
        label = args.entry
        scaler_on = target.grad_scaler
    else:
        t = _fallback_target(args.device or "cpu")
        model, opt, loss_fn, sched, batches, clip = (t["model"], t["optimizer"], t["loss_fn"], t["scheduler"],
                                                     t["batches"], t["max_grad_norm"])
        precision, label, scaler_on = parse_precision("fp32"), "examples/tiny_transformer.py (fallback)", False
    if args.precision:
        precision = parse_precision(args.precision)
    if args.clip is not None:
        clip = args.clip or None
    device = device_of(model)
    dev = device.type
    if callable(batches) and not isinstance(batches, (list, tuple)):
        data = [batches(i) for i in range(64)]
    else:
        data = list(itertools.islice(iter(batches), 64))
    if args.device:
        data = [tuple(x.to(args.device) if isinstance(x, torch.Tensor) else x for x in b)
                if isinstance(b, (tuple, list)) else b for b in data]

    class _T:  # make_scaler reads these two
        optimizer = opt
        grad_scaler = scaler_on
    scaler = make_scaler(_T, precision, dev)
    logging.getLogger("nanprobe.guard").disabled = True
    tmp = tempfile.TemporaryDirectory(prefix="nanprobe-bench-")
    # The bench cycles a few batches for thousands of steps: the model memorizes them and a batch's loss can
    # sit 10x above a near-zero running median. Spike thresholds are raised so that no step trips (the
    # per-step work is the same); the bad path is not what this measures.
    guard = Guard(model, opt, scaler=scaler, scheduler=sched, precision=precision, capsule_dir=tmp.name,
                  config={"loss_spike_factor": 1e9, "grad_spike_factor": 1e9})
    if args.no_monitor:
        guard.core.monitor = None   # what Guard(enabled=False) does: no precursor monitor
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    ctx = (lambda: autocast_context(precision, dev)) if precision.autocast else contextlib.nullcontext
    model.train()

    def plain(batch) -> None:
        opt.zero_grad(set_to_none=True)
        with ctx():
            loss = loss_fn(model, batch)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        else:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        if sched is not None:
            sched.step()

    def guarded(batch) -> None:
        with guard.step(batch):
            opt.zero_grad(set_to_none=True)
            with ctx():
                loss = loss_fn(model, batch)
            guard.backward(loss)
        if guard.optimizer_step(clip) and sched is not None:
            sched.step()

    cursor = itertools.cycle(range(len(data)))

    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.clock == "thread" and (dev != "cpu" or torch.get_num_threads() != 1):
        parser.error("--clock thread measures the training thread alone: CPU with one intra-op thread "
                     "(OMP_NUM_THREADS=1)")

    def block(fn) -> float:
        sync()
        t0 = clock()
        for _ in range(args.block):
            fn(data[next(cursor)])
        sync()
        return (clock() - t0) / args.block

    if args.monitor_cost:
        _monitor_cost(model, opt, plain, data, cursor, args.pairs, precision)
    for _ in range(args.warmup):
        block(plain)
        block(guarded)
    ratios, p_times, g_times = [], [], []
    for _ in range(args.pairs):
        a1 = block(plain)
        b1 = block(guarded)
        b2 = block(guarded)
        a2 = block(plain)
        ratios.append((b1 + b2) / (a1 + a2))
        p_times += [a1, a2]
        g_times += [b1, b2]
    med_ratio = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4)
    print(f"nanprobe.Guard overhead on {label}")
    print(f"  device {device} · precision {precision.value} · clip {clip} · GradScaler {scaler is not None} · "
          f"threads {torch.get_num_threads()}")
    print(f"  plain step   median {statistics.median(p_times) * 1e3:.3f} ms")
    print(f"  guarded step median {statistics.median(g_times) * 1e3:.3f} ms")
    print(f"  guarded/plain: median ratio {med_ratio:.4f} (IQR {q[0]:.4f}..{q[2]:.4f}; "
          f"ratio of medians {statistics.median(g_times) / statistics.median(p_times):.4f}) over {args.pairs} "
          f"ABBA pairs of {args.block}-step blocks ({args.clock} clock)")
    print(f"  budget <= 1.01: {'OK' if med_ratio <= 1.01 else 'OVER'}")
    print(f"  guard events {len(guard.events)} (a healthy run has none); precursor monitor "
          f"{'off' if guard.monitor is None else f'every {guard.monitor.every} steps'}; "
          f"early warnings {len(guard.warnings)} (a healthy run has none)")
    tmp.cleanup()


def _monitor_cost(model, opt, plain, data, cursor, pairs: int, precision) -> None:
    """A monitored step (hooks, attention mode, one read-back) against a plain one, interleaved."""
    from nanprobe.base.config import load_config
    from nanprobe.judge.monitor import Monitor
    cfg = load_config().monitor
    mon = Monitor(model, cfg, dtype=precision.dtype if precision.low else None, every=1)
    clock = time.thread_time

    def monitored(batch) -> None:
        mon.begin(0)
        plain(batch)
        mon.end(0, loss=0.0, optimizers=[opt])

    for fn in (plain, monitored, plain, monitored):
        fn(data[next(cursor)])
    p, m = [], []
    for _ in range(max(pairs, 10)):
        for fn, out in ((plain, p), (monitored, m), (monitored, m), (plain, p)):
            t0 = clock()
            fn(data[next(cursor)])
            out.append(clock() - t0)
    tp, tm = statistics.median(p), statistics.median(m)
    extra = max(tm - tp, 0.0) / tp
    print(f"precursor monitor: plain step {tp * 1e3:.2f} ms, monitored step {tm * 1e3:.2f} ms (+{extra:.1%}); "
          f"amortised: {extra / max(cfg.live_every, 1):.2%} at live_every {cfg.live_every} (Guard, watch, callbacks), "
          f"{extra / max(cfg.every, 1):.2%} at every {cfg.every} (replay, smoke)")


if __name__ == "__main__":
    main()
