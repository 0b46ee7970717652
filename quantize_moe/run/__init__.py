"""Running the real model: transformers' own modules of the family, one decoder layer in memory at a time."""
