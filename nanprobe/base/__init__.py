"""What every stage shares: errors and exit codes, config, precisions, batches, the report's data model, sharded values."""
