"""Writing the output: the worker pipeline, shard files, digests, the manifest and the destination's safety."""
