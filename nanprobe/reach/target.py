"""The Target an entrypoint returns, and dict -> Target validation.

Validation never touches the user's iterators or RNG: calling ``iter()`` on a DataLoader draws
its base seed from the global RNG, which would shift every later batch and dropout mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..base.batch import map_tensors
from ..base.errors import NanprobeError, TargetError, UsageError, UserCodeError, UserExit
from ..base.precision import Precision, parse_precision, weights_precision


@dataclass(kw_only=True)
class Target:
    """What nanprobe needs to reproduce the user's training steps.

    Either ``loss_fn(model, batch)`` (the forward pass and the loss; nanprobe runs the canonical
    loop around it: zero_grad, autocast, backward per micro-batch, unscale, clip, step, schedule)
    or ``step_fn(model, batch, step)`` (the user's whole step). Step ``k`` consumes the next
    ``accumulate`` items of ``batches`` (an epoch never shares a step with the next one), over
    ``epochs`` fresh passes; a callable ``batches(i)`` gives item ``i``.
    """

    model: torch.nn.Module
    batches: Iterable[Any] | Callable[[int], Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    step_fn: Callable[[torch.nn.Module, Any, int], Any] | None = None
    optimizer: Any = None                 # an Optimizer, or a list/dict of them
    scheduler: Any = None                 # an LR scheduler, or a list/dict of them
    max_grad_norm: float | None = None
    precision: Precision | str = Precision.FP32
    grad_scaler: Any = False              # bool (nanprobe makes one), or GradScaler(s) the step uses
    load_state: Callable[[int], int] | None = None
    epochs: int = 1
    accumulate: int = 1
    scheduler_on_skip: bool = True
    num_classes: int | None = None
    ignore_index: int = -100

    # the low precision the weights themselves are stored in (pure bf16/fp16 training), else None;
    # set from the model: a target whose weights are bf16 trains in bf16 without any autocast
    weights: Precision | None = field(default=None, init=False)
    # the run computes in its weights' own low dtype with no autocast (``model.to(torch.bfloat16)`` and no
    # autocast precision given): reruns in another precision cast the weights instead of rewriting autocast
    pure: bool = field(default=False, init=False)

    def __post_init__(self):
        self.precision = parse_precision(self.precision)
        self.weights = weights_precision(self.model) if isinstance(self.model, torch.nn.Module) else None
        if self.weights is not None and self.precision is Precision.FP32:
            self.precision = self.weights   # no autocast: the run computes in its weights' dtype
            self.pure = True

    @property
    def masters(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors the optimizers step that are not the model's parameters (float32 master copies of
        low-precision weights), named ``<optimizer>.param_groups[g][i]``: state like the weights."""
        own = {id(p) for p in self.model.parameters()}
        return [(f"{name}.param_groups[{gi}][{i}]", p) for name, opt in self.optimizers
                for gi, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])
                if id(p) not in own]

    # -- the user's objects as named lists (one object, a list or a dict) --------------------------
    @property
    def optimizers(self) -> list[tuple[str, torch.optim.Optimizer]]:
        return named(self.optimizer, "optimizer")

    @property
    def schedulers(self) -> list[tuple[str, Any]]:
        return named(self.scheduler, "scheduler")

    @property
    def user_scalers(self) -> list[tuple[str, torch.amp.GradScaler]]:
        """GradScaler objects the target hands over (``grad_scaler: True`` makes nanprobe's own)."""
        return [] if isinstance(self.grad_scaler, bool) else named(self.grad_scaler, "grad_scaler")

    @property
    def uses_scaler(self) -> bool:
        return bool(self.grad_scaler) if isinstance(self.grad_scaler, bool) else bool(self.user_scalers)

    @property
    def form(self) -> str:
        """How the capsule's micro-batches are fed: "loss_fn", "step_fn", or the step_fn's own ``form``
        ("watch_forward": the root module's inputs, see nanprobe.watch.ForwardStep)."""
        return "loss_fn" if self.step_fn is None else str(getattr(self.step_fn, "form", "step_fn"))


def named(obj: Any, base: str) -> list[tuple[str, Any]]:
    """One object, a list/tuple or a dict -> ``[(display name, object)]``."""
    if obj is None or obj is False:
        return []
    if isinstance(obj, Mapping):
        return [(f"{base}[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"{base}[{i}]", v) for i, v in enumerate(obj)]
    return [(base, obj)]


KEYS = tuple(f.name for f in fields(Target) if f.init)
REQUIRED = ("model", "batches")
_HINTS = {
    "model": 'a torch.nn.Module, e.g. "model": model',
    "loss_fn": 'a (model, batch) -> scalar loss, e.g. "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1]); '
               'or "step_fn": your whole step (model, batch, step) -> loss',
    "batches": 'a list/iterable of batches (a DataLoader) or a callable i -> batch',
}


def validate(obj: Any, where: str) -> Target:
    """Turn what the entrypoint returned into a checked Target; one clear error otherwise. Nothing here
    iterates ``batches`` or draws from an RNG."""
    def fail(what: str, fix: str) -> TargetError:
        return TargetError(what, where, fix)

    def positive_int(key: str, default: int | None = 1) -> None:   # None allowed only where it is the default
        v = values.get(key, default)
        if (v is not None or default is not None) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise fail(f"'{key}' is {v!r}", "Use a positive integer, or leave it out")

    if isinstance(obj, Target):
        values = {k: getattr(obj, k) for k in KEYS}
        if obj.pure:   # the precision it took from its weights: validated again as the fp32 (no autocast) asked
            values["precision"] = Precision.FP32
    elif isinstance(obj, dict):
        unknown = [k for k in obj if k not in KEYS]
        if unknown:
            raise fail(f"{where} returned unknown key(s) {', '.join(map(repr, unknown))}",
                       f"Use only: {', '.join(KEYS)}")
        missing = [k for k in REQUIRED if k not in obj]
        if missing:
            raise fail(f"{where} returned no {missing[0]!r}", f'Add "{missing[0]}": {_HINTS[missing[0]]}')
        values = dict(obj)
    else:
        raise fail(f"{where} returned {type(obj).__name__}, not a nanprobe.Target or dict",
                   'Return nanprobe.Target(model=..., loss_fn=..., batches=...) or a dict with those keys')

    model = values["model"]
    if not isinstance(model, torch.nn.Module):
        raise fail(f"'model' is {type(model).__name__}, not a torch.nn.Module",
                   "Return the nn.Module being trained (several networks: one nn.ModuleDict)")
    loss_fn, step_fn = values.get("loss_fn"), values.get("step_fn")
    if loss_fn is None and step_fn is None:
        raise fail(f"{where} returned no 'loss_fn'", f'Add "loss_fn": {_HINTS["loss_fn"]}')
    if loss_fn is not None and step_fn is not None:
        raise fail(f"{where} returned both 'loss_fn' and 'step_fn'",
                   "Keep one: loss_fn for the standard loop, step_fn for your own whole step")
    for key, fn, shape in (("loss_fn", loss_fn, "(model, batch) -> scalar loss"),
                           ("step_fn", step_fn, "(model, batch, step) -> loss or dict of losses")):
        if fn is not None and not callable(fn):
            raise fail(f"'{key}' is {type(fn).__name__}, not callable", f"Pass a function {shape}")
    batches = values["batches"]
    if not callable(batches) and not isinstance(batches, Iterable):
        raise fail(f"'batches' is {type(batches).__name__}, neither iterable nor callable",
                   "Pass a list, a DataLoader, or a callable i -> batch")
    if isinstance(batches, Iterator) and not callable(batches):
        raise fail(f"'batches' is a one-shot iterator ({type(batches).__name__})",
                   "Pass something nanprobe can iterate afresh: a list, a DataLoader, or a callable i -> batch")

    opts = named(values.get("optimizer"), "optimizer")
    params = {id(p) for p in model.parameters()}
    for name, opt in opts:
        if not isinstance(opt, torch.optim.Optimizer):
            raise fail(f"'{name}' is {type(opt).__name__}, not a torch.optim.Optimizer",
                       "Pass the optimizer(s) over the model's parameters, or leave it out")
        foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in params]
        if foreign and not mirrors(model, foreign):
            raise fail(f"'{name}' holds {len(foreign)} tensor(s) that are not parameters of 'model' (nor master "
                       "copies of them: same shape, equal values)",
                       "Build the optimizer from parameters of the returned model (several networks: put them in "
                       "one nn.ModuleDict and return that)")
    scheds = named(values.get("scheduler"), "scheduler")
    for name, sched in scheds:
        if not callable(getattr(sched, "step", None)):
            raise fail(f"'{name}' is {type(sched).__name__} with no step()",
                       "Pass a torch.optim.lr_scheduler object, or leave it out")
    if scheds and not opts:
        raise fail("'scheduler' given without 'optimizer'", "Add the optimizer the scheduler drives")
    mgn = values.get("max_grad_norm")
    if mgn is not None and (isinstance(mgn, bool) or not isinstance(mgn, (int, float)) or mgn <= 0):
        raise fail(f"'max_grad_norm' is {mgn!r}", "Use a positive number, or leave it out")
    if mgn is not None and step_fn is not None:
        raise fail("'max_grad_norm' is set with 'step_fn'", "Your step_fn does its own clipping; drop max_grad_norm")
    try:
        precision = parse_precision(values.get("precision"))
    except ValueError:
        raise fail(f"'precision' is {values.get('precision')!r}", 'Use "fp32", "bf16" or "fp16"') from None
    if precision not in (Precision.FP32, Precision.BF16, Precision.FP16):
        raise fail(f"'precision' {precision.value!r} is not a training precision", 'Use "fp32", "bf16" or "fp16"')
    # fp32 (no autocast) over bf16/fp16 weights computes in their dtype (Target sets it; the checks use it)
    computes = (weights_precision(model) or precision) if precision is Precision.FP32 else precision
    scaler = False if values.get("grad_scaler") is None else values["grad_scaler"]
    if isinstance(scaler, bool):
        if scaler and computes is not Precision.FP16:
            raise fail(f"'grad_scaler' is set but 'precision' is {computes.value}",
                       'GradScaler belongs to fp16 training: set "precision": "fp16" or drop grad_scaler')
        if scaler and not opts:
            raise fail("'grad_scaler' needs an 'optimizer'", "Add the optimizer")
        if scaler and step_fn is not None:
            raise fail("'grad_scaler' is True with 'step_fn'",
                       'Your step_fn uses its own GradScaler: pass it, "grad_scaler": scaler')
    else:
        for name, s in named(scaler, "grad_scaler"):
            if not isinstance(s, torch.amp.GradScaler):
                raise fail(f"'{name}' is {type(s).__name__}, not a torch.amp.GradScaler or bool",
                           "Pass True/False, or the GradScaler object(s) your step uses")
    if values.get("load_state") is not None and not callable(values["load_state"]):
        raise fail("'load_state' is not callable", "Pass a function step -> restored_step")
    positive_int("epochs")   # (absent: the Target's default)
    positive_int("accumulate")
    if not isinstance(values.get("scheduler_on_skip", True), bool):
        raise fail(f"'scheduler_on_skip' is {values['scheduler_on_skip']!r}", "Use True or False")
    positive_int("num_classes", None)
    ii = values.get("ignore_index", -100)
    if isinstance(ii, bool) or not isinstance(ii, int):
        raise fail(f"'ignore_index' is {ii!r}", "Use an integer label value, e.g. -100")
    return Target(**{**values, "precision": precision, "grad_scaler": scaler})


def check_precision(target: Target, precision: Precision) -> None:
    """A precision asked for the run itself (replay, smoke): a pure low-precision target computes in its
    weights' dtype, with no autocast to rewrite, so no other precision can be replayed."""
    if target.pure and precision is not target.precision:
        raise UsageError(f"--precision {precision.value}: the weights themselves are {target.weights.value} (no "
                         "autocast to switch)", "--precision", f"Leave --precision out, or compare one step in "
                         f"{precision.value} with nanprobe compare-precisions")


def mirrors(model: torch.nn.Module, tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are master copies of the model's parameters (fp16/bf16 weights with float32
    copies the optimizer steps: the classic mixed-precision recipe): each has the shape of a distinct
    parameter and equals it once cast to the parameter's dtype."""
    free = list(model.parameters())
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return False
        with torch.no_grad():
            match = next((i for i, p in enumerate(free) if p.shape == t.shape and p.device == t.device
                          and torch.equal(t.to(p.dtype), p)), None)
        if match is None:
            return False
        free.pop(match)
    return True


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
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:
        raise UserExit(during, exc) from None
    except NanprobeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any error in user code is reported, not ours
        raise UserCodeError(during, exc) from exc


class _MovedBatches:
    """Re-iterable view of the user's batches with every tensor moved to ``device``; everything else
    (``len``, ``sampler``, ``batch_sampler`` for ``set_epoch``) is the wrapped loader's."""

    def __init__(self, batches: Iterable[Any], device: torch.device):
        self.batches, self.device = batches, device

    def __iter__(self):
        for batch in self.batches:
            yield map_tensors(batch, lambda t: t.to(self.device))

    def __len__(self) -> int:
        return len(self.batches)  # TypeError for unsized iterables, as for the loader itself

    def __getattr__(self, name: str) -> Any:
        if name in ("batches", "device"):
            raise AttributeError(name)
        return getattr(self.batches, name)


def to_device(target: Target, device: str | torch.device) -> Target:
    """Move the model, optimizer state and batches to ``device`` (e.g. diagnose a CPU script on CUDA)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"unknown device {device!r}", "--device", "Use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("CUDA is not available on this machine", "--device", "Use --device cpu, or run on a GPU host")
    target.model.to(dev)
    for _, opt in target.optimizers:
        if opt.state:
            opt.load_state_dict(opt.state_dict())  # casts the state onto the parameters' device
    batches = target.batches
    target.batches = (lambda step: map_tensors(batches(step), lambda t: t.to(dev))) \
        if callable(batches) and not isinstance(batches, Iterable) else _MovedBatches(batches, dev)
    return target
