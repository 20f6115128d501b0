"""The plain training loop of the nanprobe entrypoint contract, without nanprobe.

Every example's ``if __name__ == "__main__":`` block calls :func:`train` so that
``python examples/<name>.py`` shows what the user saw before reaching for
nanprobe: the step at which the loss, the gradients or the parameters first
stop being finite. The loop is exactly the one the contract describes::

    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype, enabled=precision != "fp32"):
        loss = loss_fn(model, batch)
    (scaler.scale(loss) if scaler else loss).backward()
    [scaler.unscale_(opt); clip_grad_norm_(...)]   # when max_grad_norm is set
    scaler.step(opt) / opt.step(); scaler.update(); scheduler.step()
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


def _batches(target: dict[str, Any]):
    batches = target["batches"]
    if callable(batches):
        step = 0
        while True:
            yield batches(step)
            step += 1
    else:
        yield from batches


def train(target: dict[str, Any], steps: int = 20, precision: str | None = None,
          verbose: bool = True) -> tuple[int | None, list[str]]:
    """Train ``steps`` steps; return ``(first_bad_step, what)`` or ``(None, [])`` if all finite.

    ``what`` lists which of "loss", "grads", "params" were non-finite at that step.
    With a GradScaler, non-finite gradients make it skip the update; that is
    reported too (it is how fp16 training hides an overflow).
    """
    model = target["model"]
    opt = target.get("optimizer")
    scheduler = target.get("scheduler")
    clip = target.get("max_grad_norm")
    precision = precision or target.get("precision", "fp32")
    dtype = DTYPES[precision]
    device_type = next(model.parameters()).device.type
    scaler = (torch.amp.GradScaler(device_type)
              if precision == "fp16" and target.get("grad_scaler") and opt is not None else None)

    model.train()
    for step, batch in zip(range(steps), _batches(target)):
        lr = opt.param_groups[0]["lr"] if opt is not None else None  # the LR this step uses
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = target["loss_fn"](model, batch)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        bad = []
        if not torch.isfinite(loss.detach()).all():
            bad.append("loss")
        if not _all_finite(p.grad for p in model.parameters()):
            bad.append("grads")
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if opt is not None:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        if scheduler is not None:
            scheduler.step()
        if not _all_finite(p.detach() for p in model.parameters()):
            bad.append("params")
        if verbose:
            lr_text = f"  lr {lr:.3g}" if lr is not None else ""
            print(f"step {step:2d}  loss {loss.item():.6g}{lr_text}")
        if bad:
            print(f"first non-finite at step {step}: {', '.join(bad)}"
                  + (" (after the optimizer update)" if bad == ["params"] else ""))
            return step, bad
    print(f"all {steps} steps finite")
    return None, []
