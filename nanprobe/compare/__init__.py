"""`nanprobe compare-precisions`: the same step under fp64/fp32/tf32/bf16/fp16(+GradScaler), side by side.

Every precision reruns the step from the same state with the same batch and RNG (``rerun.run_step``),
instrumented (``OriginTracker``: the first non-finite site). Beside it a ``_Capture`` reads every
module's output, the gradient w.r.t. that output and the parameter gradients, and compares them
elementwise with the reference run (fp64 where it runs, else fp32), which goes first and is kept.
Nothing here prints; the CLI renders the ``Comparison``.

Definitions (also written into the JSON under ``definitions``) are in ``DEFINITIONS``.
"""

from .plot import check_plot, plot_comparison, plot_trajectory
from .records import _RUNS, CHOICES, DEFINITIONS, Comparison, LayerRow, LayerStat, PrecisionRun, Ranked, ScalerResult, \
    parse_precisions
from .runner import compare_precisions

__all__ = ["CHOICES", "DEFINITIONS", "Comparison", "LayerRow", "LayerStat", "PrecisionRun", "Ranked", "ScalerResult",
           "_RUNS", "check_plot", "compare_precisions", "parse_precisions", "plot_comparison", "plot_trajectory"]
