"""`python -m diffbatch ...` is the same as the `diffbatch` command."""

from diffbatch.entrypoints.cli import run

run()
