"""diffbatch.ipc."""
