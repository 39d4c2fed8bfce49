"""diffbatch.entrypoints."""
