"""Planning a run from metadata alone: options, per-tensor decisions, work items, shards, and which engines load the result."""
