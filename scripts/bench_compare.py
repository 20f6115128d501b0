"""Cost of one full `nanprobe compare-precisions` as a multiple of one plain fp32 training step.

Both are measured in this process on the same target, state and batch: the plain step is
`run_step(..., fp32, instrument=False)` (restore the pre-step state + one step, as every rerun does);
the comparison is `compare_precisions(loaded, at=N)` with every precision, including its replay to
step N (reported separately). Beside it, one plain step in each precision that ran: on CPU fp16/bf16
kernels are much slower than fp32, so that sum is the floor for any comparison; the last line is the
comparison's own overhead over it. Run:

    python scripts/bench_compare.py [--entry examples/healthy_transformer.py:target] [--at 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanprobe.compare import _RUNS, compare_precisions  # noqa: E402
from nanprobe.batch import map_tensors  # noqa: E402
from benchlib import median_time  # noqa: E402
from nanprobe.config import load_config  # noqa: E402
from nanprobe.entry import load_target  # noqa: E402
from nanprobe.loop import Snapshot  # noqa: E402
from nanprobe.precision import Precision  # noqa: E402
from nanprobe.replay import reach  # noqa: E402
from nanprobe.rerun import run_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", default=str(ROOT / "examples" / "healthy_transformer.py") + ":target")
    parser.add_argument("--at", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--device", default=None, help="move the target's model and (listed) batches there, e.g. cuda")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = load_config()
    loaded = load_target(args.entry)
    target = loaded.target
    if args.device:
        target.model.to(args.device)  # same Parameter objects: the optimizer stays tied
        target.batches = [map_tensors(b, lambda t: t.to(args.device)) for b in target.batches]
    start = Snapshot.take(target, None)
    reached = reach(target, at=args.at, precision=target.precision, cfg=cfg.replay, where=loaded.where)

    def plain():
        run_step(target, reached, Precision.FP32, where=loaded.where, instrument=False)

    def replay():
        start.restore(target, None)
        reach(target, at=args.at, precision=target.precision, cfg=cfg.replay, where=loaded.where)

    result = None

    def compare():
        nonlocal result
        start.restore(target, None)  # compare_precisions replays from step 0 itself
        result = compare_precisions(loaded, at=args.at, config=cfg)

    base = median_time(plain, args.repeats * 5)
    t_replay = median_time(replay, args.repeats)
    t_cmp = median_time(compare, args.repeats)
    ran = [name for name, r in result.precisions.items() if r.ran]
    per = {}  # one plain step in each precision that ran: what the reruns cost at least (fp16 on CPU is slow)
    for name in ran:
        prec, scaler = _RUNS[name]
        per[name] = median_time(lambda: run_step(target, reached, prec, where=loaded.where, instrument=False,
                                                  grad_scaler=scaler, tolerate_errors=True), args.repeats * 3)
    floor = sum(per.values())
    params = sum(p.numel() for p in target.model.parameters())
    print(f"entry: {args.entry}  step {reached.step}  trains in {target.precision.value}  params {params:,}  "
          f"threads {torch.get_num_threads()}  device {result.device}")
    print(f"plain fp32 step (restore + step):        {base * 1e3:9.2f} ms   1.00x")
    print(f"replay to step {args.at} (part of the comparison): {t_replay * 1e3:9.2f} ms   {t_replay / base:6.2f}x")
    print(f"full compare-precisions:                 {t_cmp * 1e3:9.2f} ms   {t_cmp / base:6.2f}x  "
          f"({len(ran)} precisions ran: {', '.join(ran)}; reference {result.reference})")
    print(f"  of which the reruns (minus replay):    {(t_cmp - t_replay) * 1e3:9.2f} ms   "
          f"{(t_cmp - t_replay) / base:6.2f}x  = {(t_cmp - t_replay) / base / max(len(ran), 1):.2f}x per precision")
    print(f"one plain step in each of those:         {floor * 1e3:9.2f} ms   {floor / base:6.2f}x  ("
          + ", ".join(f"{n} {t / base:.2f}x" for n, t in per.items()) + ")")
    print(f"reruns / plain steps in their precisions: {(t_cmp - t_replay) / floor:5.2f}x  (nanprobe's own overhead)")
    print(f"recommendation: {result.recommendation}")


if __name__ == "__main__":
    main()
