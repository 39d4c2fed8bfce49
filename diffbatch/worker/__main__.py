"""`python -m diffbatch.worker`: the worker process program (started by the mp executor)."""

import logging
import os
import sys

from diffbatch.worker import lifeline

# The lifeline first: importing the worker (torch) takes seconds, and an engine that
# is killed meanwhile must not leave this process running through them.
for _i, _arg in enumerate(sys.argv[:-1]):
    if _arg == "--lifeline-fd" and sys.argv[_i + 1].isdigit():
        lifeline.watch(int(sys.argv[_i + 1]))

from diffbatch.worker.worker import main  # noqa: E402 - after the lifeline, on purpose

code = main()
# Nothing is left to finalize once `main` returned (its shared memory is swept, its
# pipe closed), and tearing down an interpreter with torch loaded takes seconds that
# every shutdown and restart would wait for: flush what was logged and exit now.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
