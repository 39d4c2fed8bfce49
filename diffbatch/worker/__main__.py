"""`python -m diffbatch.worker`: the worker process program (started by the mp executor)."""

import logging
import os
import sys

from diffbatch.worker.worker import main

code = main()
# Nothing is left to finalize once `main` returned (its shared memory is swept, its
# pipe closed), and tearing down an interpreter with torch loaded takes seconds that
# every shutdown and restart would wait for: flush what was logged and exit now.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
