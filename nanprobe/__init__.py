"""nanprobe: find where and why a PyTorch training step produced NaN/Inf, and what to change."""

__version__ = "0.1.0"

from .compare import compare_precisions  # noqa: E402
from .diagnose import diagnose  # noqa: E402
from .guard import Guard, GuardTripped  # noqa: E402
from .report import Cause, Finding, Fix, Mechanism, Origin, Phase, Report, Status  # noqa: E402
from .scan import ScanResult, scan_data  # noqa: E402
from .smoke import SmokeResult, smoke  # noqa: E402
from .target import Target  # noqa: E402

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
