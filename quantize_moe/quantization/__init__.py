"""FP8 arithmetic (CPU and GPU backends of the same cells), scale layouts and on-disk formats: what every stage shares."""
