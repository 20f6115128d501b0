"""Update-born non-finite weights, caught at the step whose optimizer update made them.

After a checked step's update the guards queue one on-device value, :func:`weights_flag` (the
largest weight norm over the parameters the update touched: NaN or Inf when any weight is), and read it
back in the next check's one device sync: no sync of its own. When it is non-finite, the bad step
is the one whose update ran, and :func:`update_forensics` (a rare path) names the parameters, the
learning rate and the optimizer state that made them (Adam's second moment at 0 with ``eps=0``:
cause ``div``). Fused and foreach optimizers update the same parameters: the flag reads the
weights, not the optimizer's code path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..base.report import Cause, Finding, Fix, Mechanism, Phase
from ..base.sharding import local_value


def weights_flag(params: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """The largest per-parameter L2 norm over ``params`` as a 0-dim float32 tensor on their device, no
    sync (foreach kernels: one pass over the weights, read only): NaN or Inf exactly when a weight is
    (or a norm passes float32's 3.4e38). None without parameters. Sharded parameters: this rank's
    shards (the guards all-reduce the flag)."""
    shards = [s for s in (local_value(p.detach()) for p in params) if s.numel()]   # a rank's shard may be empty
    if not shards:
        return None
    with torch.no_grad():   # L2 norms accumulated in float32 (the inf-norm kernels are 6x slower on CPU)
        return torch.stack(torch._foreach_norm(shards, dtype=torch.float32)).amax()


# optimizers whose update is bounded for finite gradients, weights and LR when eps > 0 (SGD, Adam's
# m / (sqrt(v) + eps), ...): in float32/float64 weights such an update cannot make a weight non-finite
_BOUNDED = frozenset({"SGD", "Adam", "AdamW", "NAdam", "RAdam", "Adamax", "RMSprop", "Adagrad", "Adadelta", "ASGD"})
_WIDE = (torch.float32, torch.float64)


def unbounded_update(optimizers: Iterable[torch.optim.Optimizer]) -> str | None:
    """Why these optimizers' next update may make finite weights non-finite from finite gradients (an
    eps of 0: Adam's 0/0 where the second moment is 0; fp16/bf16 weights: an update past the dtype's
    range; an optimizer nanprobe does not know), or None when it cannot. Reads only settings and dtypes."""
    for opt in optimizers:
        name = type(opt).__name__
        if name not in _BOUNDED:
            return f"{name} is not an optimizer whose update nanprobe can bound"
        for group in opt.param_groups:
            eps = group.get("eps")
            if isinstance(eps, (int, float)) and eps <= 0:
                return f"{name} has eps={eps:g}"
            if any(p.dtype not in _WIDE for p in group["params"]):
                return f"{name} updates {next(p.dtype for p in group['params'] if p.dtype not in _WIDE)} weights"
    return None


class UpdateCheck:
    """Which applied updates have their weights read (``guard.check_updates_every``).

    Reading the weights after an update (:func:`weights_flag`, queued for the next check's sync) is one
    read-only pass over them, about the cost of the gradient-norm pass. It runs after every update
    whose optimizer can make finite weights non-finite from finite gradients
    (:func:`unbounded_update`: eps=0, fp16/bf16 weights, an unknown optimizer), and after every
    ``every``-th of the others. An update not read is not lost from view: a step whose loss or
    gradients go non-finite asks :meth:`unread` whether the last update was read and, when not, the
    guard reads the weights there (the rare path), so weights a forward uses are named at the update
    that made them. Weights no forward uses are caught at the next read, which names the range of
    updates since the last finite one (:meth:`since`)."""

    RECHECK = 100   # updates between two looks at the optimizers' settings (a param group may change)

    def __init__(self, every: int = 1):
        self.every = every
        self.applied = 0                              # updates applied since the start
        self.last: int | None = None                  # the step of the last applied (checked good) update
        self.read_finite: int | None = None           # the last update whose weights were read finite
        self.unbounded: str | None = None             # why every update is read (unbounded_update)

    def applied_update(self, step: int, optimizers: list[torch.optim.Optimizer]) -> torch.Tensor | None:
        """The update of ``step`` ran: the weights flag to queue (no sync) when this update is read."""
        if self.every > 1 and self.applied % self.RECHECK == 0:
            self.unbounded = unbounded_update(optimizers)
        self.applied += 1
        self.last = step
        if self.every > 1 and self.unbounded is None and (self.applied - 1) % self.every:
            return None
        return weights_flag(p for opt in optimizers for g in opt.param_groups for p in g["params"])

    def unchecked(self) -> None:
        """An update of an unchecked step (``guard.check_every``) ran: its gradients were never read, so
        weights non-finite after it are not an update's doing that :meth:`unread` may name."""
        self.last = None

    def read(self, step: int, finite: bool) -> None:
        """The flag queued after ``step``'s update was read back."""
        if finite:
            self.read_finite = step

    def unread(self) -> int | None:
        """The last applied update, when its weights were not read finite since: the one to read on a bad
        step (None: nothing to read)."""
        return None if self.read_finite == self.last else self.last

    def since(self, step: int) -> str | None:
        """Evidence for weights first seen non-finite after ``step``'s update when earlier updates were
        not read (``every`` > 1): the range of updates that may have made them. None when ``step``
        follows the last finite read."""
        first = 0 if self.read_finite is None else self.read_finite + 1
        if first >= step:
            return None
        last = "before the first update" if self.read_finite is None else f"after the update of step {self.read_finite}"
        return (f"the weights were last read finite {last}, so one of the updates of steps {first}-{step} made them "
                f"non-finite; this report names the last, step {step} (the weights of an optimizer whose update is "
                f"bounded are read every {self.every} updates, guard.check_updates_every, and on every bad step)")


def update_forensics(optimizers: Iterable[torch.optim.Optimizer], names: dict[int, str], *,
                     weights: bool = True) -> dict[str, Any]:
    """The first optimizer's settings and (``weights``) the parameters that hold non-finite values,
    with their optimizer state (one sync per parameter: the rare path). ``names``: id(parameter) ->
    qualified name."""
    optimizers = [o for o in optimizers if o is not None]
    if not optimizers:
        return {}
    opt = optimizers[0]
    groups = [{k: (float(v) if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool) else
                   [float(x) for x in v] if isinstance(v, tuple) else v)
               for k, v in g.items() if k in ("lr", "eps", "weight_decay", "betas", "momentum")}
              for g in opt.param_groups]
    flags = {k: bool(opt.defaults.get(k)) for k in ("fused", "foreach") if opt.defaults.get(k)}
    out: dict[str, Any] = {"optimizer": type(opt).__name__, "param_groups": groups, **flags}
    if not weights:
        return out
    bad = []
    for oi, o in enumerate(optimizers):
        for gi, g in enumerate(o.param_groups):
            for q in g["params"]:
                w = local_value(q.detach())
                nonfinite = int((~torch.isfinite(w)).sum())
                if not nonfinite:
                    continue
                row: dict[str, Any] = {"parameter": names.get(id(q), "?"), "group": gi, "optimizer": oi,
                                       "nonfinite": nonfinite, "numel": w.numel(),
                                       "kind": "nan" if bool(torch.isnan(w).any()) else "inf",
                                       "dtype": str(w.dtype).replace("torch.", "")}
                st = o.state.get(q, {})
                for key in ("exp_avg_sq", "exp_avg", "momentum_buffer"):
                    v = st.get(key)
                    if isinstance(v, torch.Tensor):
                        a = local_value(v.detach()).float().abs()
                        row[key] = {"min": float(a.min()), "max": float(a.max()), "zeros": int((a == 0).sum())}
                if "step" in st:
                    row["step"] = float(st["step"])
                bad.append(row)
    out["nonfinite_parameters"] = bad
    return out


def _group(upd: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The settings of the param group a non-finite parameter is in (recorded for the first optimizer only)."""
    return (upd.get("param_groups") or [{}])[row["group"]] if row["optimizer"] == 0 else {}


def describe(upd: dict[str, Any], step: int) -> str:
    """One line for the log: which update, which parameter, the LR and the optimizer state."""
    bad = upd["nonfinite_parameters"]
    first = bad[0]
    group = _group(upd, first)
    text = (f"the {upd.get('optimizer', 'optimizer')} update of step {step} made the weights non-finite: "
            f"{first['nonfinite']} value(s) of {first['parameter']}"
            + (f" and {len(bad) - 1} more parameter(s)" if len(bad) > 1 else "")
            + (f" (lr={group['lr']:g}" if "lr" in group else " (")
            + (f", eps={group['eps']:g}" if "eps" in group else "") + ")")
    v = first.get("exp_avg_sq")
    if v is not None:
        text += f"; its Adam second moment has {v['zeros']} zero(s), min {v['min']:.3g}"
    return text


def update_finding(upd: dict[str, Any], step: int) -> Finding:
    """The finding for weights an update made non-finite: ``div`` for Adam's 0/0 (``eps=0`` and a second
    moment at 0), else ``lr_spike`` (a step too large for the weights)."""
    first = upd["nonfinite_parameters"][0]
    group = _group(upd, first)
    lines = [describe(upd, step),
             "optimizer settings: " + ", ".join(f"{k}={v}" for k, v in group.items())]
    module = first["parameter"].rpartition(".")[0] or None
    eps = group.get("eps")
    if eps is not None and eps <= 1e-30 and (first.get("exp_avg_sq") or {}).get("zeros", 0) > 0:
        opt = upd.get("optimizer", "Adam")
        lines.append("the update is m / (sqrt(v) + eps): where a weight's gradient has been 0, m = v = 0 and "
                     "eps = 0 makes it 0/0")
        fix = Fix(title=f"Give {opt} a positive eps",
                  code=f"optimizer = torch.optim.{opt}(model.parameters(), lr={group.get('lr', 1e-3):g}, eps=1e-8)",
                  why="parameters with zero gradient have m = v = 0, so eps = 0 makes the update 0/0")
        return Finding(cause=Cause.DIV, confidence=0.9, phase=Phase.UPDATE, module=module, op=None,
                       evidence=tuple(lines), fixes=(fix,), mechanism=Mechanism.ADAM_SECOND_MOMENT)
    return Finding(cause=Cause.LR_SPIKE, confidence=0.6, phase=Phase.UPDATE, module=module, op=None,
                   evidence=tuple(lines))


__all__ = ["UpdateCheck", "unbounded_update", "weights_flag", "update_forensics", "update_finding", "describe"]
