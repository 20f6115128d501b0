"""nanprobe: find where and why a PyTorch training step produced NaN/Inf, and what to change."""

from .base.version import __version__

from .compare import compare_precisions  # noqa: E402
from .pipeline.diagnose import diagnose  # noqa: E402
from .live.guard import Guard, GuardTripped  # noqa: E402
from .base.report import Cause, Finding, Fix, Mechanism, Origin, Phase, Report, Status  # noqa: E402
from .pipeline.scan import ScanResult, scan_data  # noqa: E402
from .pipeline.smoke import SmokeResult, smoke  # noqa: E402
from .reach.target import Target  # noqa: E402

__all__ = [
    "Cause",
    "Finding",
    "Fix",
    "Guard",
    "GuardTripped",
    "Mechanism",
    "Origin",
    "Phase",
    "Report",
    "ScanResult",
    "SmokeResult",
    "Status",
    "Target",
    "__version__",
    "compare_precisions",
    "diagnose",
    "scan_data",
    "smoke",
]
