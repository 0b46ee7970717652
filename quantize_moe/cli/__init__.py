"""The `quantize-moe` command line and its tables."""
