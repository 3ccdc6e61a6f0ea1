"""pytest setup: make the repository root and ``tests/`` importable here and in spawned ranks.

Spawned ranks (``zerotron.distributed.launch.spawn``, "spawn" start method) inherit ``sys.path`` and the
environment, so a test body defined in ``tests/test_x.py`` is importable in every child.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

for _path in (str(TESTS), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

_pythonpath = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if str(ROOT) not in _pythonpath:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), *_pythonpath] if p)

# Without a GPU, the Triton paged-attention kernel (zerotron.serve.triton_attention) is tested in
# Triton's interpreter, which must be chosen before Triton is first imported. With a CUDA device the
# kernel compiles as it does in serving.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
