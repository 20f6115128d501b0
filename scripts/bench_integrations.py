"""Per-step overhead of the zero-edit ways in (budget <= 1.01x): the Lightning callback, the transformers
callback and `nanprobe watch`, each against the same training without it, in the same process.

Each repeat is ONE training run whose steps alternate in blocks (``--block`` steps nanprobe on, the
same number off): a switch forwards the framework's hooks to nanprobe's callback only in "on"
blocks (the transformers callback's training_step wrapper is installed and removed with it), and
the loop of a script enters `nanprobe watch`'s Watcher only for "on" blocks. Interleaving this fine
cancels the drift of a shared machine. A step's time is the interval between the starts of
consecutive steps (the callbacks) or the step itself (the script), so everything nanprobe adds per
step is inside it; the first step of each block is left out (the switch). Each repeat gives the
ratio of the median "on" step to the median "off" step; reported: the median ratio over repeats
and its spread (min-max).

The clock is the training thread's CPU time (``--clock thread``, the default): with one thread every
op runs on it, and other processes on a shared machine (which preempt this one and make wall-clock
steps 50% noisier than the effect measured) do not count. ``--clock wall`` measures wall-clock time
(on a GPU, where the guard's one device sync per step matters, use that on an idle machine).
Run on CPU with one thread:

    OMP_NUM_THREADS=1 python scripts/bench_integrations.py [--only lightning,transformers,watch] [--repeats 5]

Reported per integration: (A/B) the median ratio of "on" to "off" step time over pairs of adjacent
blocks (pooled over the runs), the time nanprobe adds per step, the pairs' interquartile range and
the range of the runs' own median ratios; (inside nanprobe) the CPU time spent inside nanprobe's
entry points per step (the callback's hooks, the watcher's hooks; outermost calls only), measured
in extra runs with nanprobe on at every step, and the ratio it implies. The A/B figure includes
everything (allocations, caches) but carries the machine's noise; the in-hook figure is precise
and excludes only such indirect costs.

The models (``--size small``): examples/tiny_transformer.py (110k parameters, AdamW, clipping at 1.0)
in a LightningModule and in a plain loop with the loss inside forward; a 2-layer GPT-2 (n_embd 64)
for transformers.Trainer (clipping at 1.0, its default). ``--size large``: d_model 256, 4 layers.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tiny_transformer import TinyTransformer, TransformerConfig  # noqa: E402


SIZES = {"small": {}, "large": {"d_model": 256, "n_layers": 4, "max_len": 64, "vocab_size": 256}}
GPT2 = {"small": {"n_layer": 2, "n_embd": 64, "n_head": 4}, "large": {"n_layer": 4, "n_embd": 256, "n_head": 4}}


def _data(n: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return x, x.roll(1, dims=1)


CLOCK = time.thread_time


class Blocks:
    """Which steps run with nanprobe (odd blocks) and the step times, by block."""

    def __init__(self, block: int, warmup: int):
        self.block, self.warmup = block, warmup
        self.samples: dict[int, list[float]] = {}   # block index -> step times (the block's first step left out)
        self._last: tuple[float, int] | None = None

    def on(self, step: int) -> bool:
        return (step // self.block) % 2 == 1

    def add(self, step: int, seconds: float) -> None:
        if step >= self.warmup and step % self.block:   # not the first step of a block: the switch
            self.samples.setdefault(step // self.block, []).append(seconds)

    def tick(self, step: int) -> None:
        """A step starts: the interval since the previous start is the previous step's time."""
        now = CLOCK()
        if self._last is not None:
            self.add(self._last[1], now - self._last[0])
        self._last = (now, step)

    def pairs(self) -> list[tuple[float, float]]:
        """(off, on) median step times of adjacent blocks: the same conditions, tens of ms apart."""
        med = {k: statistics.median(v) for k, v in self.samples.items() if v}
        return [(med[k], med[k + 1]) for k in med if k % 2 == 0 and k + 1 in med]


# -- Lightning ---------------------------------------------------------------------------------------------

def lightning_run(blocks: Blocks, steps: int, tmp: str, size: str) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from nanprobe.integrations.lightning import NanprobeCallback

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyTransformer(TransformerConfig(**SIZES[size]))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    class Switch(L.Callback):
        def __init__(self, inner: L.Callback):
            self.inner, self.active = inner, False

        def on_train_epoch_start(self, trainer, pl_module):
            self.inner.on_train_epoch_start(trainer, pl_module)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            blocks.tick(trainer.global_step)
            self.active = blocks.on(trainer.global_step)
            if self.active:
                self.inner.on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_before_backward(self, trainer, pl_module, loss):
            if self.active:
                self.inner.on_before_backward(trainer, pl_module, loss)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if self.active:
                self.inner.on_before_optimizer_step(trainer, pl_module, optimizer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.active:
                self.inner.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    cfg = TransformerConfig(**SIZES[size])
    x, y = _data(16 * (steps + 1), cfg.max_len, cfg.vocab_size)
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                        callbacks=[Switch(NanprobeCallback(dirpath=tmp))], gradient_clip_val=1.0)
    trainer.fit(LM(), DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))


# -- transformers ------------------------------------------------------------------------------------------

def transformers_run(blocks: Blocks, steps: int, tmp: str, size: str) -> None:
    import transformers

    from nanprobe.integrations.transformers import NanprobeCallback

    class Switch(transformers.TrainerCallback):
        def __init__(self, inner):
            self.inner, self.active = inner, False

        def on_init_end(self, args, state, control, **kwargs):
            self.inner.on_init_end(args, state, control, **kwargs)

        def on_train_begin(self, args, state, control, **kwargs):
            self.inner.on_train_begin(args, state, control, **kwargs)
            self.inner._uninstall()

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.inner.on_epoch_begin(args, state, control, **kwargs)

        def on_step_begin(self, args, state, control, **kwargs):
            blocks.tick(state.global_step)
            active = blocks.on(state.global_step)
            if active and not self.active:
                self.inner._install()   # training_step and the norm the Trainer computes
            elif self.active and not active:
                self.inner._uninstall()
            self.active = active

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if self.active:
                self.inner.on_pre_optimizer_step(args, state, control, **kwargs)

        def on_step_end(self, args, state, control, **kwargs):
            if self.active:
                self.inner.on_step_end(args, state, control, **kwargs)

        def on_train_end(self, args, state, control, **kwargs):
            self.inner.on_train_end(args, state, control, **kwargs)

    class Data(torch.utils.data.Dataset):
        def __init__(self, n: int):
            self.x, _ = _data(n, 32, 128)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=32, **GPT2[size]))
    args = transformers.TrainingArguments(output_dir=tmp, per_device_train_batch_size=8, max_steps=steps,
                                          use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=Data(8 * (steps + 1)),
                         callbacks=[Switch(NanprobeCallback(dirpath=tmp))]).train()


# -- nanprobe watch ----------------------------------------------------------------------------------------

def watch_run(blocks: Blocks, steps: int, tmp: str, size: str) -> None:
    """The loop a script writes (loss inside the model's forward, clipping, a scheduler), inside the
    Watcher `nanprobe watch` puts around the script in "on" blocks."""
    from nanprobe.live import resolve_config
    from nanprobe.watch import Watcher

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = TinyTransformer(TransformerConfig(**SIZES[size]))

        def forward(self, x, y):
            return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    cfg = TransformerConfig(**SIZES[size])
    x, y = _data(16 * (steps + 1), cfg.max_len, cfg.vocab_size)
    torch.manual_seed(0)
    model = WithLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    watcher = Watcher(config=resolve_config(None, "bench"), policy="skip", dirpath=tmp, entry=None)

    def step(i: int) -> None:
        t0 = CLOCK()
        loss = model(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        blocks.add(i, CLOCK() - t0)

    for start in range(0, steps, blocks.block):
        if blocks.on(start):
            with watcher:
                for i in range(start, min(start + blocks.block, steps)):
                    step(i)
        else:
            for i in range(start, min(start + blocks.block, steps)):
                step(i)


RUNS = {"lightning": lightning_run, "transformers": transformers_run, "watch": watch_run}


# -- time inside nanprobe's hooks ---------------------------------------------------------------------------

def _entry_points(name: str) -> list[tuple[object, str]]:
    """The methods through which the framework (or the script) enters nanprobe during a step."""
    from nanprobe.live import HookedGuard
    if name == "lightning":
        from nanprobe.integrations.lightning import NanprobeCallback
        return [(NanprobeCallback, m) for m in ("on_train_epoch_start", "on_train_batch_start", "on_before_backward",
                                                 "on_before_optimizer_step", "_check", "on_train_batch_end")]
    if name == "transformers":
        from nanprobe.integrations.transformers import NanprobeCallback
        return [(HookedGuard, "micro"), (HookedGuard, "note_loss")] + \
            [(NanprobeCallback, m) for m in ("on_epoch_begin", "on_pre_optimizer_step", "on_step_end")]
    from nanprobe.watch import Watcher
    return [(Watcher, m) for m in ("_root_pre", "_root_post", "on_loss", "_opt_pre", "_opt_post", "_check")]


class InHook:
    """CPU time spent inside nanprobe's entry points (outermost calls only), while installed."""

    def __init__(self, name: str):
        self.points = _entry_points(name)
        self.seconds = 0.0
        self._depth = 0
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> InHook:
        for owner, method in self.points:
            original = getattr(owner, method)
            self._saved.append((owner, method, original))
            setattr(owner, method, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, method, original in reversed(self._saved):
            setattr(owner, method, original)

    def _timed(self, original):
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = CLOCK()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += CLOCK() - t0
        return timed


class AlwaysOn(Blocks):
    def on(self, step: int) -> bool:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="lightning,transformers,watch")
    parser.add_argument("--repeats", type=int, default=5, help="training runs per integration (one ratio each)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per run")
    parser.add_argument("--block", type=int, default=4, help="steps per on/off block")
    parser.add_argument("--warmup", type=int, default=16, help="first steps of each run left out")
    parser.add_argument("--size", choices=tuple(SIZES), default="small",
                        help="small: 110k parameters (examples/tiny_transformer.py defaults); large: ~3M")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread",
                        help="thread: the training thread's CPU time; wall: wall-clock time")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '(unset)')}; {args.repeats} runs x {args.steps} steps, "
          f"nanprobe on/off in blocks of {args.block} steps; clock: {args.clock}; size: {args.size}")
    for name in args.only.split(","):
        pooled: list[tuple[float, float]] = []
        per_run: list[float] = []
        with tempfile.TemporaryDirectory() as tmp:
            RUNS[name](Blocks(args.block, 0), 2 * args.block + 2, tmp, args.size)   # imports, first calls
            for _ in range(args.repeats):
                blocks = Blocks(args.block, args.warmup)
                RUNS[name](blocks, args.steps, tmp, args.size)
                pairs = blocks.pairs()
                pooled += pairs
                per_run.append(statistics.median(on / off for off, on in pairs))
            inside = []
            for _ in range(max(args.repeats // 2, 1)):   # nanprobe on in every step, its entry points timed
                with InHook(name) as hook:
                    RUNS[name](AlwaysOn(args.block, args.warmup), args.steps, tmp, args.size)
                inside.append(hook.seconds / args.steps)
        ratio = statistics.median(on / off for off, on in pooled)
        off = statistics.median(off for off, _ in pooled)
        added = statistics.median(on - off for off, on in pooled)
        q = statistics.quantiles([on / off for off, on in pooled], n=4)
        hook_us = 1e6 * statistics.median(inside)
        print(f"{name:13s} off {1e3 * off:7.3f} ms/step | A/B: +{1e6 * added:6.1f} us/step, ratio {ratio:.4f} "
              f"(pairs' IQR {q[0]:.4f}-{q[2]:.4f}; runs {min(per_run):.4f}-{max(per_run):.4f}) | inside nanprobe: "
              f"{hook_us:6.1f} us/step ({min(inside) * 1e6:.1f}-{max(inside) * 1e6:.1f}), ratio "
              f"{1 + hook_us / (1e6 * off):.4f} | budget <= 1.01", flush=True)


if __name__ == "__main__":
    main()
