"""compare-precisions plot: per-layer |activation| and |gradient| maxima per precision (matplotlib)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..base.errors import UsageError
from .records import Comparison


def check_plot(path: Path) -> None:
    """``--plot``'s file: a suffix matplotlib writes, and matplotlib installed."""
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UsageError(f"cannot write a plot to {path}", "--plot", "Give a file ending in .png, .pdf or .svg")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed", "--plot",
                         "Install it with: pip install 'nanprobe[plot]'") from None


def _figure(path: Path, figsize: tuple[float, float]):
    """A matplotlib Figure (no pyplot, no display) for a plot to be written to ``path``."""
    check_plot(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}", "--plot", "Give a writable path") from None
    return path


def plot_comparison(cmp: Comparison, path: str | Path) -> Path:
    """Per-layer abs-max of activations and gradients for each precision, log axis, fp16/bf16 limits."""
    modules = [row.module for row in cmp.layers]
    fig = _figure(Path(path), (max(8.0, min(0.28 * len(modules) + 4, 30.0)), 8.5))
    axes = fig.subplots(2, 1, sharex=True)
    limits = [(torch.finfo(torch.float16).max, "fp16 max", "tab:red", "--"),
              (torch.finfo(torch.float16).tiny, "fp16 smallest normal", "tab:red", ":"),
              (torch.finfo(torch.bfloat16).max, "bf16 max", "tab:purple", "--"),
              (torch.finfo(torch.bfloat16).tiny, "bf16 smallest normal", "tab:purple", ":")]
    for ax, side, title in ((axes[0], "out", "activations: max |module output|"),
                            (axes[1], "grad", "gradients: max |d loss / d module output| (as held)")):
        lows: list[float] = []
        for name, run in cmp.precisions.items():
            if not run.ran:
                continue
            xs, ys, bad_x, bad_y = [], [], [], []
            for i, row in enumerate(cmp.layers):
                s = row.stats.get(name)
                if s is None:
                    continue
                v = getattr(s, f"{side}_absmax")
                if v is not None and v > 0:
                    xs.append(i)
                    ys.append(v)
                if not getattr(s, f"{side}_finite"):
                    bad_x.append(i)
                    bad_y.append(getattr(s, f"{side}_would_reach") or v or 1.0)
            style = dict(color="black", linewidth=2.5, alpha=0.35) if run.reference else dict(linewidth=1.2)
            line = ax.plot(xs, ys, marker="o", markersize=3, label=name + (" (reference)" if run.reference else ""),
                           **style)[0]
            lows.extend(ys)
            if bad_x:
                ax.scatter(bad_x, bad_y, marker="x", s=40, color=line.get_color(), label=f"{name} non-finite")
        for value, label, color, style in limits:
            ax.axhline(value, color=color, linestyle=style, linewidth=0.9, label=label)
        ax.set_yscale("log")
        floor = float(torch.finfo(torch.float32).smallest_normal) * 1e-3  # fp64-only magnitudes are off the chart
        ax.set_ylim(max(min(lows + [limits[3][0]]) / 10, floor), limits[2][0] * 100)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].legend(fontsize=7, ncols=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[1].set_xticks(range(len(modules)), modules, rotation=90, fontsize=6 if len(modules) > 30 else 7)
    fig.suptitle(f"nanprobe compare-precisions: {cmp.entry} step {cmp.step} (reference {cmp.reference})",
                 fontsize=10)
    return _save(fig, Path(path))


def plot_trajectory(trajectory: dict, path: str | Path, *, title: str = "") -> Path:
    """The precursor monitor's series (``Report.trajectory``): attention logits, entropy, log Z and the
    loss against the step, log axes where they grow, the onset and any warning marked."""
    series = trajectory.get("series", {})
    panels = [("max_logit", "largest attention logit", True), ("max_product", "largest q.k product", True),
              ("entropy", "attention entropy (nats)", False), ("logsumexp", "output log Z", False),
              ("grad_norm", "gradient norm per layer", True), ("loss", "loss", False)]
    panels = [p for p in panels if any(k.endswith("/" + p[0]) for k in series)]
    fig = _figure(Path(path), (10, 2.6 * max(len(panels), 1)))
    axes = fig.subplots(max(len(panels), 1), 1, sharex=True, squeeze=False)[:, 0]
    onset = trajectory.get("onset")
    for ax, (stat, label, log) in zip(axes, panels):
        for key, pts in sorted(series.items()):
            if key.endswith("/" + stat) and pts:
                vals = [(s, v) for s, v in pts if isinstance(v, (int, float)) and (v > 0 or not log)]
                ax.plot([s for s, _ in vals], [v for _, v in vals], linewidth=1.2, label=key.rsplit("/", 1)[0])
        if stat in ("max_product",):
            ax.axhline(torch.finfo(torch.float16).max, color="tab:red", linestyle="--", linewidth=0.9,
                       label="fp16 max")
        if log:
            ax.set_yscale("log")
        if onset is not None:
            ax.axvline(onset, color="tab:orange", linestyle=":", linewidth=1.2, label=f"onset (step {onset})")
        for w in trajectory.get("warnings", []):
            ax.axvline(w["step"], color="tab:red", linestyle=":", linewidth=1.0, label=f"warning (step {w['step']})")
        ax.set_title(label, fontsize=9, loc="left")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xlabel("step")
    fig.suptitle(title or "nanprobe trajectory", fontsize=10)
    return _save(fig, Path(path))
