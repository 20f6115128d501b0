"""Cost of one `nanprobe run` diagnosis of one step, as a ratio of one plain training step.

Beside it, the ratio for the same step under torch.autograd.detect_anomaly(), measured in the
same process on the same state and batch. Run:

    python scripts/bench_run.py [--entry examples/healthy_transformer.py:target] [--at 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import median_time  # noqa: E402
from nanprobe.config import load_config  # noqa: E402
from nanprobe.diagnose import diagnose_target  # noqa: E402
from nanprobe.entry import load_target  # noqa: E402
from nanprobe.replay import reach  # noqa: E402
from nanprobe.rerun import run_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", default=str(ROOT / "examples" / "healthy_transformer.py") + ":target")
    parser.add_argument("--at", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default=None, help="move the target there first (e.g. cuda)")
    parser.add_argument("--size", default=None, help='JSON config for the entry, e.g. \'{"d_model": 512, '
                                                       '"n_layers": 6, "seq_len": 256, "batch_size": 16}\'')
    args = parser.parse_args()

    cfg = load_config()
    loaded = load_target(args.entry, config=json.loads(args.size) if args.size else None, device=args.device)
    target = loaded.target
    reached = reach(target, at=args.at, precision=target.precision, cfg=cfg.replay, where=loaded.where)
    prec = reached.precision

    def plain():
        run_step(target, reached, prec, where=loaded.where, instrument=False)

    def instrumented():
        run_step(target, reached, prec, where=loaded.where, instrument=True)

    def anomaly():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly():
                try:
                    run_step(target, reached, prec, where=loaded.where, instrument=False)
                except Exception:  # noqa: BLE001 - anomaly mode raises on NaN; we time it anyway
                    pass

    def diagnosis():
        diagnose_target(loaded, reached=reached, config=cfg)

    class _Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def empty_mode():  # the floor: Python dispatch alone, no checks
        with _Empty():
            run_step(target, reached, prec, where=loaded.where, instrument=False)

    base = median_time(plain, args.repeats * 3)
    t_inst = median_time(instrumented, args.repeats)
    t_anom = median_time(anomaly, args.repeats)
    t_diag = median_time(diagnosis, max(3, args.repeats // 2))
    t_empty = median_time(empty_mode, args.repeats)
    params = sum(p.numel() for p in target.model.parameters())
    print(f"entry: {args.entry}  step {reached.step}  precision {prec.value}  params {params:,}  "
          f"device {next(target.model.parameters()).device}  threads {torch.get_num_threads()}")
    print(f"plain step (restore + step):         {base * 1e3:8.2f} ms   1.00x")
    print(f"detect_anomaly step:                 {t_anom * 1e3:8.2f} ms   {t_anom / base:5.2f}x")
    print(f"empty TorchDispatchMode (floor):     {t_empty * 1e3:8.2f} ms   {t_empty / base:5.2f}x")
    print(f"instrumented rerun (one precision):  {t_inst * 1e3:8.2f} ms   {t_inst / base:5.2f}x")
    print(f"full `run` diagnosis of the step:    {t_diag * 1e3:8.2f} ms   {t_diag / base:5.2f}x  "
          "(instrumented rerun + reference + other precisions + fix verification)")


if __name__ == "__main__":
    main()
