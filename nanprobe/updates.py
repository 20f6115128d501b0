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

from .report import Cause, Finding, Fix, Mechanism, Phase
from .sharding import local_value


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


def update_forensics(optimizers: Iterable[torch.optim.Optimizer], names: dict[int, str], *,
                     weights: bool = True) -> dict[str, Any]:
    """The first optimizer's settings and (``weights``) the parameters that hold non-finite values,
    with their optimizer state (one sync per parameter: the rare path). ``names``: id(parameter) ->
    qualified name."""
    optimizers = [o for o in optimizers if o is not None]
    if not optimizers:
        return {}
    opt = optimizers[0]
    groups = []
    for g in opt.param_groups:
        groups.append({k: (float(v) if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool) else
                           [float(x) for x in v] if isinstance(v, tuple) else v)
                       for k, v in g.items() if k in ("lr", "eps", "weight_decay", "betas", "momentum")})
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


def _eps_zero(upd: dict[str, Any], row: dict[str, Any]) -> bool:
    group = (upd.get("param_groups") or [{}])[row["group"]] if row["optimizer"] == 0 else {}
    eps = group.get("eps")
    return eps is not None and eps <= 1e-30 and (row.get("exp_avg_sq") or {}).get("zeros", 0) > 0


def describe(upd: dict[str, Any], step: int) -> str:
    """One line for the log: which update, which parameter, the LR and the optimizer state."""
    bad = upd["nonfinite_parameters"]
    first = bad[0]
    group = (upd.get("param_groups") or [{}])[first["group"]] if first["optimizer"] == 0 else {}
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
    bad = upd["nonfinite_parameters"]
    first = bad[0]
    group = (upd.get("param_groups") or [{}])[first["group"]] if first["optimizer"] == 0 else {}
    lines = [describe(upd, step),
             "optimizer settings: " + ", ".join(f"{k}={v}" for k, v in group.items())]
    module = first["parameter"].rpartition(".")[0] or None
    if _eps_zero(upd, first):
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


__all__ = ["weights_flag", "update_forensics", "update_finding", "describe"]
