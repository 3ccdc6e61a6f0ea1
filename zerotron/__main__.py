"""`python -m zerotron`: the command line; as one rank of a torchrun/srun job, it leaves without the
interpreter's object teardown.

A rank's process group is destroyed when its command ends (:func:`zerotron.distributed.destroy_distributed`),
but the interpreter's teardown can still destroy a C++ object of a group after the group's threads,
which aborts the process ("terminate called without an active exception") now and then — and torchrun
then fails the whole job. A launched rank therefore runs the exit handlers (``atexit``, which include
``weakref.finalize``: offload files are removed), flushes its streams and leaves with ``os._exit``.
"""

import atexit
import os
import sys

from zerotron.cli import main
from zerotron.distributed.launch import under_torchrun

code = main()
if under_torchrun():
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
raise SystemExit(code)
