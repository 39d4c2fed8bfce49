"""diffbatch.worker."""
