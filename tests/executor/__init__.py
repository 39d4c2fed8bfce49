"""Tests for diffbatch.executor."""
