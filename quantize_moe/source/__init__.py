"""Reading sources: checkpoint folders, the Hub, pickle shards, and tiny checkpoints built for the demo and tests."""
