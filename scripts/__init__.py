"""The recipe of the built-in default model: its training and evaluation scripts, and
`shapes_data` (the procedural dataset and pixel judge they share with the tests).

Not part of the runtime package: nothing under `diffbatch/` imports from here.
"""
