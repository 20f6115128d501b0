"""A fix as changes nanprobe can make to every training step from outside the user's code.

A :class:`Remedy` is what the horizon (nanprobe/remedy/horizon.py) trains with: a precision change and
fp32 islands (autocast), clipping, the LR the scheduler sets scaled or warmed up, optimizer group
keys (eps, betas, weight decay), z-loss through a hook on the output module, and qk-layernorm by
normalising q and k where attention is called.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..base.precision import Precision, device_of
from ..locate.rerun import _scaler_for
from ..reach.step import RunOptions


@dataclass(frozen=True, slots=True)
class Remedy:
    """A fix as changes nanprobe can make to every step of a horizon without editing the user's code."""

    precision: Precision | None = None              # train in this precision instead
    fp32_modules: tuple[str, ...] = ()              # run these modules in float32 inside autocast
    max_grad_norm: float | None = None              # clip the global gradient norm at this
    lr_scale: float | tuple[float, ...] | None = None   # multiply the LR the scheduler sets (per param group: a tuple)
    warmup: int | None = None                       # ... and by min(1, (step + 1) / warmup)
    param_overrides: tuple[tuple[str, Any], ...] = ()   # optimizer group keys, e.g. (("eps", 1e-8),)
    z_loss: tuple[str, float] | None = None         # (output module, coefficient): + c * logsumexp(logits)^2
    qk_norm: tuple[str, ...] = ()                   # attention modules whose q and k are layer-normalised

    def describe(self) -> str:
        lr = self.lr_scale
        parts = [self.precision and self.precision.value,
                 self.fp32_modules and f"fp32 {', '.join(self.fp32_modules)}",
                 self.max_grad_norm is not None and f"clip {self.max_grad_norm:g}",
                 "LR x(" + ", ".join(f"{x:g}" for x in lr) + ") per param group" if isinstance(lr, tuple)
                 else lr is not None and f"LR x{lr:g}",
                 self.warmup is not None and f"warmup {self.warmup}",
                 *(f"{k}={v}" for k, v in self.param_overrides),
                 self.z_loss and f"z-loss {self.z_loss[1]:g} on {self.z_loss[0]}",
                 self.qk_norm and f"qk-norm in {', '.join(self.qk_norm)}"]
        return ", ".join(p for p in parts if p) or "no change"

    def combine(self, other: Remedy) -> Remedy | None:
        """Both changes at once; None where they set the same thing differently."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, tuple) and f.name not in ("z_loss", "lr_scale"):
                out[f.name] = tuple(dict.fromkeys(a + b))
            elif a is not None and b is not None and a != b:
                return None
            else:
                out[f.name] = a if a is not None else b
        if len({k for k, _ in out["param_overrides"]}) < len(out["param_overrides"]):
            return None
        return Remedy(**out)

    def lr_at(self, step: int) -> float | tuple[float, ...] | None:
        scale = self.lr_scale
        if self.warmup:
            w = min(1.0, (step + 1) / self.warmup)
            scale = tuple(x * w for x in scale) if isinstance(scale, tuple) else (scale or 1.0) * w
        return scale

    def options(self, precision: Precision, policy: str, loop, step: int) -> RunOptions:
        prec = self.precision or precision
        return RunOptions(precision=prec, policy=policy, max_grad_norm=self.max_grad_norm,
                          lr_scale=self.lr_at(step), param_overrides=dict(self.param_overrides) or None,
                          scaler=_scaler_for(loop, prec, None, None))

    @contextlib.contextmanager
    def applied(self, target) -> Iterator[list[torch.Tensor]]:
        """The changes that live in the model (fp32 island, qk-norm, z-loss) for the ``with`` body.

        Yields the list the z-loss hook appends each step's added term to (to report the loss
        without it)."""
        added: list[torch.Tensor] = []
        with contextlib.ExitStack() as stack:
            if self.fp32_modules:   # autocast off, float32 inputs
                device_type = device_of(target.model).type
                stack.enter_context(_around(
                    target.model, self.fp32_modules, lambda: torch.autocast(device_type, enabled=False),
                    cast=lambda t: t.float() if torch.is_tensor(t) and t.is_floating_point() else t))
            if self.qk_norm:
                stack.enter_context(_qk_norm(target.model, self.qk_norm))
            if self.z_loss is not None:
                stack.enter_context(_z_loss(target, *self.z_loss, added))
            yield added

    def why_not(self, target) -> str | None:
        """Why this remedy cannot be applied to ``target`` from outside (None: it can)."""
        if self.z_loss is not None and target.loss_fn is None:
            return "z-loss is added to the loss, and your step_fn computes its own"
        modules = dict(target.model.named_modules())
        missing = [m for m in (*self.fp32_modules, *self.qk_norm, *((self.z_loss[0],) if self.z_loss else ()))
                   if m not in modules]
        if missing:
            return f"no module {missing[0]!r} in the model"
        if any(isinstance(modules[m], torch.nn.MultiheadAttention) for m in self.qk_norm):
            return "nn.MultiheadAttention computes q @ k^T inside one function nanprobe cannot reach into"
        return None


def _unit(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """LayerNorm without affine parameters over ``dim`` (qk-layernorm's normalisation)."""
    return F.layer_norm(t.transpose(dim, -1), (t.shape[dim],)).transpose(dim, -1).to(t.dtype)


_SDPA = F.scaled_dot_product_attention
_MATMULS = {torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm}


class _QKNormMode(TorchFunctionMode):
    """Inside an attention module's forward: layer-normalise q and k where attention is computed.

    ``F.scaled_dot_product_attention(q, k, v)`` gets normalised q and k; elsewhere the first batched
    matmul of two >= 3-D operands (a hand-written attention, transformers' eager attention) is
    ``q @ k^T``: q over its last dim, k^T over the head dim (its second-to-last).
    ``nn.MultiheadAttention`` is out of reach: its attention is one torch function
    (``F.multi_head_attention_forward``) whose inner ops no mode sees."""

    def __init__(self):
        super().__init__()
        self.pending = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA and len(args) >= 2:
            args = (_unit(args[0]), _unit(args[1])) + tuple(args[2:])
        elif self.pending and func in _MATMULS and len(args) >= 2 and all(
                isinstance(a, torch.Tensor) and a.dim() >= 3 for a in args[:2]):
            self.pending = False
            args = (_unit(args[0]), _unit(args[1], -2)) + tuple(args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _around(model: torch.nn.Module, names: tuple[str, ...], make: Callable[[], Any],
            cast: Callable[[Any], Any] | None = None):
    """Each call of the named modules runs inside a fresh ``make()`` context (autocast off for an fp32
    island, the qk-norm mode), with ``cast`` applied to its arguments."""
    entered: list[Any] = []

    def pre(mod, args, kwargs):
        ctx = make()
        ctx.__enter__()
        entered.append(ctx)
        return (tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}) if cast is not None else None

    def post(mod, args, kwargs, out):
        entered.pop().__exit__(None, None, None)

    handles = []
    for name, module in model.named_modules():
        if name in names:
            handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                        module.register_forward_hook(post, with_kwargs=True, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _qk_norm(model: torch.nn.Module, names: tuple[str, ...]):
    return _around(model, names, _QKNormMode)


@contextlib.contextmanager
def _z_loss(target, name: str, coef: float, added: list[torch.Tensor]):
    """coef * mean(logsumexp(logits)^2) over the output module's logits, added to the user's loss."""
    module = target.model.get_submodule(name)
    terms: list[torch.Tensor] = []

    def hook(mod, args, out):
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            terms.append(coef * torch.logsumexp(out.float(), dim=-1).pow(2).mean())

    original = target.loss_fn

    def loss_fn(model, batch):
        terms.clear()
        loss = original(model, batch)
        if terms and isinstance(loss, torch.Tensor):
            z = torch.stack(terms).sum()
            added.append(z.detach())
            return loss + z.to(loss.dtype)
        return loss

    handle = module.register_forward_hook(hook)
    target.loss_fn = loss_fn
    try:
        yield
    finally:
        target.loss_fn = original
        handle.remove()


__all__ = ["Remedy"]
