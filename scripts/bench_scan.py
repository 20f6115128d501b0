"""Benchmark: `scan_data` throughput vs just iterating the same batches (budget >= 0.9x).

The batches come from a torch DataLoader (batch 64, default collate, num_workers=0) over a
map-style dataset of pre-tokenized samples: input_ids, attention_mask and labels of length 128
(int64, with padding and ignore_index labels) and float features of length 128. Each repeat
times one pass of plain iteration and one `scan_data` pass over the same batches, back to
back in this process; the reported ratio is the median over repeats of
(scan batches/s) / (iteration batches/s), in wall-clock time and in process CPU time.

    python scripts/bench_scan.py [--batches 300] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset

from nanprobe.base.config import load_config
from nanprobe.pipeline.scan import infer_num_classes, scan_data
from nanprobe.reach.target import Target


class Tokens(Dataset):
    def __init__(self, n: int, seq: int = 128, vocab: int = 32000, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)
        self.lengths = torch.randint(seq // 4, seq + 1, (n,), generator=g).tolist()
        self.features = torch.randn(n, seq, generator=g)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = self.lengths[i]
        ids = self.ids[i].clone()
        ids[n:] = 0
        mask = torch.zeros_like(ids)
        mask[:n] = 1
        labels = ids.clone()
        labels[n:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "features": self.features[i]}


class Model(torch.nn.Module):
    def __init__(self, vocab: int = 32000, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.emb(ids))


def loss_fn(model, batch):
    logits = model(batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    data = DataLoader(Tokens(args.batches * args.batch_size), batch_size=args.batch_size)
    # num_classes is given, as a user who knows it would: the one no-grad forward that infers it from
    # the model's output width is a one-off cost per scan, timed separately below.
    target = Target(model=Model(), loss_fn=loss_fn, batches=data, num_classes=32000)
    cfg = load_config()

    def iterate() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        n = 0
        for _ in data:
            n += 1
        assert n == args.batches
        return time.perf_counter() - t0, time.process_time() - c0

    def scan() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        result = scan_data(target, config=cfg)
        elapsed = time.perf_counter() - t0, time.process_time() - c0
        assert result.batches_scanned == args.batches and result.exit_code == 0, result.problems[:3]
        return elapsed

    iterate(), scan()   # warm up allocator, caches and lazy imports
    it_times, scan_times, ratios, cpu_ratios = [], [], [], []
    for _ in range(args.repeats):
        (a, ca), (b, cb) = iterate(), scan()
        it_times.append(a)
        scan_times.append(b)
        ratios.append(a / b)
        cpu_ratios.append(ca / cb)
    n = args.batches
    it_med, scan_med = statistics.median(it_times), statistics.median(scan_times)
    print(f"batches: {n} x {args.batch_size} samples (input_ids/attention_mask/labels int64 (B,128), "
          f"features float32 (B,128)); torch threads {torch.get_num_threads()}")
    print(f"iterate only : {n / it_med:8.1f} batches/s  ({1e6 * it_med / n:7.1f} us/batch, median of {args.repeats})")
    print(f"scan_data    : {n / scan_med:8.1f} batches/s  ({1e6 * scan_med / n:7.1f} us/batch, median of {args.repeats})")
    print(f"scan overhead: {1e6 * (scan_med - it_med) / n:7.1f} us/batch")
    print(f"throughput ratio scan/iterate: median {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}; budget >= 0.9x)")
    print(f"same ratio in process CPU time (less sensitive to other load on the machine): median "
          f"{statistics.median(cpu_ratios):.3f}x (min {min(cpu_ratios):.3f}, max {max(cpu_ratios):.3f})")
    first = next(iter(data))
    infer = []
    for _ in range(3):
        t0 = time.perf_counter()
        width = infer_num_classes(target, first)
        infer.append(time.perf_counter() - t0)
    print(f"one-off num_classes inference (no --num-classes): {1e3 * statistics.median(infer):.1f} ms "
          f"(output width {width}) = {statistics.median(infer) / scan_med:.1%} of this scan")


if __name__ == "__main__":
    main()
