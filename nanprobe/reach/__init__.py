"""Reach the step: load the entrypoint, feed its batches, snapshot and restore state, run and replay steps."""
