"""nanprobe: find where and why a PyTorch training step produced NaN/Inf, and what to change."""

__version__ = "0.1.0"
