"""The Target an entrypoint returns, and dict -> Target validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .batch import map_tensors
from .errors import TargetError, UsageError, UserCodeError
from .precision import Precision, parse_precision


@dataclass(kw_only=True)
class Target:
    """What nanprobe needs to reproduce one training step of the user's loop.

    ``loss_fn(model, batch)`` runs the forward pass and returns a scalar loss, exactly as in
    the training loop. Step ``k`` uses the ``k``-th batch of a fresh iterator over ``batches``
    (or ``batches(k)`` when it is callable).
    """

    model: torch.nn.Module
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    batches: Iterable[Any] | Callable[[int], Any]
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    max_grad_norm: float | None = None
    precision: Precision | str = Precision.FP32
    grad_scaler: bool = False
    load_state: Callable[[int], int] | None = None
    num_classes: int | None = None
    ignore_index: int = -100

    def __post_init__(self):
        self.precision = parse_precision(self.precision) if not isinstance(self.precision, Precision) \
            else self.precision


KEYS = tuple(f.name for f in dataclasses.fields(Target))
REQUIRED = ("model", "loss_fn", "batches")
_HINTS = {
    "model": 'a torch.nn.Module, e.g. "model": model',
    "loss_fn": 'a (model, batch) -> scalar loss, e.g. "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1])',
    "batches": 'a list/iterable of batches or a callable step -> batch',
}


def validate(obj: Any, where: str) -> Target:
    """Turn what the entrypoint returned into a checked Target; one clear error otherwise."""
    if isinstance(obj, Target):
        values = {k: getattr(obj, k) for k in KEYS}
    elif isinstance(obj, dict):
        unknown = [k for k in obj if k not in KEYS]
        if unknown:
            raise TargetError(f"{where} returned unknown key(s) {', '.join(map(repr, unknown))}",
                              where, f"Use only: {', '.join(KEYS)}")
        missing = [k for k in REQUIRED if k not in obj]
        if missing:
            k = missing[0]
            raise TargetError(f"{where} returned no {k!r}", where, f'Add "{k}": {_HINTS[k]}')
        values = dict(obj)
    else:
        raise TargetError(f"{where} returned {type(obj).__name__}, not a nanprobe.Target or dict", where,
                          'Return nanprobe.Target(model=..., loss_fn=..., batches=...) or a dict with those keys')

    model = values["model"]
    if not isinstance(model, torch.nn.Module):
        raise TargetError(f"'model' is {type(model).__name__}, not a torch.nn.Module", where,
                          "Return the nn.Module being trained")
    if not callable(values["loss_fn"]):
        raise TargetError(f"'loss_fn' is {type(values['loss_fn']).__name__}, not callable", where,
                          "Pass a function (model, batch) -> scalar loss")
    batches = values["batches"]
    if not callable(batches) and not isinstance(batches, Iterable):
        raise TargetError(f"'batches' is {type(batches).__name__}, neither iterable nor callable", where,
                          "Pass a list, a DataLoader, a generator function, or a callable step -> batch")
    if isinstance(batches, Iterable) and not callable(batches) and iter(batches) is batches:
        raise TargetError("'batches' is a one-shot iterator", where,
                          "Pass something nanprobe can iterate afresh: a list, a DataLoader, or a callable step -> batch")
    opt = values.get("optimizer")
    if opt is not None:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TargetError(f"'optimizer' is {type(opt).__name__}, not a torch.optim.Optimizer", where,
                              "Pass the optimizer over the model's parameters, or leave it out")
        params = {id(p) for p in model.parameters()}
        foreign = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in params)
        if foreign:
            raise TargetError(f"'optimizer' holds {foreign} tensor(s) that are not parameters of 'model'", where,
                              "Build the optimizer from model.parameters() of the same model object")
    sched = values.get("scheduler")
    if sched is not None and not callable(getattr(sched, "step", None)):
        raise TargetError(f"'scheduler' is {type(sched).__name__} with no step()", where,
                          "Pass a torch.optim.lr_scheduler object, or leave it out")
    if sched is not None and opt is None:
        raise TargetError("'scheduler' given without 'optimizer'", where, "Add the optimizer the scheduler drives")
    mgn = values.get("max_grad_norm")
    if mgn is not None and (isinstance(mgn, bool) or not isinstance(mgn, (int, float)) or mgn <= 0):
        raise TargetError(f"'max_grad_norm' is {mgn!r}", where, "Use a positive number, or leave it out")
    try:
        precision = parse_precision(values.get("precision"))
    except ValueError:
        raise TargetError(f"'precision' is {values.get('precision')!r}", where,
                          'Use "fp32", "bf16" or "fp16"') from None
    if precision not in (Precision.FP32, Precision.BF16, Precision.FP16):
        raise TargetError(f"'precision' {precision.value!r} is not a training precision", where,
                          'Use "fp32", "bf16" or "fp16"')
    scaler = values.get("grad_scaler", False)
    if not isinstance(scaler, bool):
        raise TargetError(f"'grad_scaler' is {scaler!r}, not true/false", where, "Use True or False")
    if scaler and precision is not Precision.FP16:
        raise TargetError(f"'grad_scaler' is set but 'precision' is {precision.value}", where,
                          'GradScaler belongs to fp16 training: set "precision": "fp16" or drop grad_scaler')
    if scaler and opt is None:
        raise TargetError("'grad_scaler' needs an 'optimizer'", where, "Add the optimizer")
    ls = values.get("load_state")
    if ls is not None and not callable(ls):
        raise TargetError("'load_state' is not callable", where, "Pass a function step -> restored_step")
    nc = values.get("num_classes")
    if nc is not None and (isinstance(nc, bool) or not isinstance(nc, int) or nc <= 0):
        raise TargetError(f"'num_classes' is {nc!r}", where, "Use a positive integer, or leave it out")
    values["precision"] = precision
    values.setdefault("ignore_index", -100)
    return Target(**values)


def check_loss(loss: Any, where: str) -> torch.Tensor:
    """loss_fn must return a scalar floating tensor attached to the graph."""
    if not isinstance(loss, torch.Tensor):
        raise TargetError(f"loss_fn returned {type(loss).__name__}, not a tensor", where,
                          "Return the scalar loss tensor, e.g. F.cross_entropy(logits, labels)")
    if loss.numel() != 1:
        raise TargetError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar", where,
                          "Reduce it, e.g. return loss.mean()")
    if not loss.is_floating_point():
        raise TargetError(f"loss_fn returned a {loss.dtype} tensor", where, "Return a floating-point loss")
    if not loss.requires_grad:
        raise TargetError("loss_fn returned a loss that does not require grad", where,
                          "Compute the loss from the model's output without .detach()/.item()/torch.no_grad()")
    return loss.reshape(())


def call_user(during: str, fn: Callable, *args):
    """Call the user's code; their exceptions become one line pointing at their file:line."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except TargetError:
        raise
    except Exception as exc:  # noqa: BLE001 - any error in user code is reported, not ours
        raise UserCodeError(during, exc) from exc


class _MovedBatches:
    """Re-iterable view of the user's batches with every tensor moved to ``device``."""

    def __init__(self, batches: Iterable[Any], device: torch.device):
        self.batches, self.device = batches, device

    def __iter__(self):
        for batch in self.batches:
            yield map_tensors(batch, lambda t: t.to(self.device))


def to_device(target: Target, device: str | torch.device) -> Target:
    """Move the model, optimizer state and batches to ``device`` (e.g. diagnose a CPU script on CUDA)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"unknown device {device!r}", "--device", "Use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("CUDA is not available on this machine", "--device", "Use --device cpu, or run on a GPU host")
    target.model.to(dev)
    opt = target.optimizer
    if opt is not None and opt.state:
        opt.load_state_dict(opt.state_dict())  # casts the state onto the parameters' device
    batches = target.batches
    if callable(batches) and not isinstance(batches, Iterable):
        target.batches = lambda step: map_tensors(batches(step), lambda t: t.to(dev))
    else:
        target.batches = _MovedBatches(batches, dev)
    return target
