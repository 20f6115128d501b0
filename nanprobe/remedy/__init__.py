"""Remedy it: the changes a fix makes to a step, the fixes ranked for a cause, and their check over a horizon."""
