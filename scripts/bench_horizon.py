"""Benchmark: horizon verification of a fix vs the user's own plain training steps (budget <= 1.10x per fix).

The run is the attention-logit-growth proxy (examples/attention_logit_growth.py) in fp32, reached
at step --at; the horizon starts --lookback steps earlier (the onset) and ends --margin steps
after it. Measured in this process, back to back: the plain loop of the entrypoint contract
(written out in this script, nothing checked) over the same number of steps, then one horizon run per fix. The
reported ratio per fix is (seconds per horizon step) / (seconds per plain step); the one-time
setup (building the target again and replaying it to the onset) and the unfixed run are printed
beside it.

    python scripts/bench_horizon.py [--at 80] [--lookback 30] [--margin 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import attention_logit_growth  # noqa: E402

from nanprobe.base.config import load_config  # noqa: E402
from nanprobe.reach.entry import load_target  # noqa: E402
from nanprobe.remedy.horizon import Horizon  # noqa: E402
from nanprobe.remedy.change import Remedy  # noqa: E402
from nanprobe.reach.replay import reach  # noqa: E402


def proxy_fp32():
    return attention_logit_growth.build("fp32")


def plain(t: dict, steps: int) -> None:
    """The user's loop as they write it, nothing checked: zero_grad, forward, backward, clip, step, schedule."""
    model, opt, sched, clip = t["model"], t["optimizer"], t["scheduler"], t["max_grad_norm"]
    for batch in t["batches"][:steps]:
        opt.zero_grad(set_to_none=True)
        t["loss_fn"](model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--at", type=int, default=80)
    ap.add_argument("--lookback", type=int, default=30)
    ap.add_argument("--margin", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(None)
    cfg = dataclasses.replace(cfg, horizon=dataclasses.replace(cfg.horizon, margin=args.margin))
    entry = f"{Path(__file__).resolve()}:proxy_fp32"
    loaded = load_target(entry)
    t = loaded.target
    reached = reach(t, at=args.at, precision=t.precision, cfg=cfg.replay, where=loaded.where)
    t0 = time.perf_counter()
    h = Horizon(loaded, reached, cfg, args.at - args.lookback)
    setup = time.perf_counter() - t0
    steps = h.end - h.start + 1
    remedies = {"qk-norm": Remedy(qk_norm=("blocks.0.attn", "blocks.1.attn")), "LR x0.3": Remedy(lr_scale=0.3),
                "z-loss": Remedy(z_loss=("lm_head", 1e-4)), "fp32 island": Remedy(fp32_modules=("blocks.1.attn",)),
                "AdamW eps": Remedy(param_overrides=(("eps", 1e-6),))}
    plain_step, unfixed, per_fix = [], [], {name: [] for name in remedies}
    try:
        for _ in range(args.repeats):
            fresh = proxy_fp32()
            t0 = time.perf_counter()
            plain(fresh, steps)
            plain_step.append((time.perf_counter() - t0) / steps)
            t0 = time.perf_counter()
            run = h.run(None)
            unfixed.append((time.perf_counter() - t0) / max(run.steps, 1))
            verdicts = {"unfixed": run}
            for name, remedy in remedies.items():
                t0 = time.perf_counter()
                run = verdicts[name] = h.run(remedy)
                per_fix[name].append((time.perf_counter() - t0) / max(run.steps, 1))
    finally:
        h.close()
        reached.restore()
    base = statistics.median(plain_step)
    print(f"horizon: steps {h.start}-{h.end} ({steps} steps); plain step {1e3 * base:.2f} ms (median of "
          f"{args.repeats})")
    print(f"one-time setup (build the target again, replay {h.start} steps): {setup:.2f} s = "
          f"{setup / (base * steps):.2f}x the horizon's plain training")
    def said(run) -> str:
        return f"failed at step {run.failed_at} ({run.reason})" if run.failed_at is not None else \
            f"held, loss {sum(v for _, v in run.losses[-5:]) / 5:.3f} over the last 5 steps"

    print(f"unfixed run: {statistics.median(unfixed) / base:.3f}x per step; {said(verdicts['unfixed'])}")
    for name, times in per_fix.items():
        print(f"fix {name:12s}: {statistics.median(times) / base:.3f}x per step (budget 1.10x); "
              f"{said(verdicts[name])}")


if __name__ == "__main__":
    main()
