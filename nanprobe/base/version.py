"""The package version, written into every report and capsule."""

__version__ = "0.1.0"
