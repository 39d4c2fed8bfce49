"""diffbatch.executor."""
