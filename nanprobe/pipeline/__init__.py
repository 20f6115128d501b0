"""The commands that run the stages in order: diagnose one step, smoke-train a target, scan its data."""
