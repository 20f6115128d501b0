"""What the user reads: the typer CLI and the rich renderings of reports."""
