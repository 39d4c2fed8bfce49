"""diffbatch.entrypoints.openai."""
