"""`python -m diffbatch.worker`: the worker process program (started by the mp executor)."""

import sys

from diffbatch.worker.worker import main

sys.exit(main())
