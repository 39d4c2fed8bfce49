"""Tests for diffbatch.ipc."""
