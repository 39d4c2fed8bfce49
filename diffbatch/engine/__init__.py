"""diffbatch.engine."""
