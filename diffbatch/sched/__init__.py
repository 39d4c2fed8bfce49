"""Scheduling: waiting queue, running set, and waves of compatible requests."""
