"""Locate the origin: rerun one step with every op checked, and confirm the rerun matches the run."""
