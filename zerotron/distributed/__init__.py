"""The only code that touches torch.distributed: the mesh, the collectives and the launcher.

- :mod:`zerotron.distributed.mesh`: ``ParallelDims`` (degrees, validation, rank grid) and ``Mesh`` (this rank's
  groups on every axis).
- :mod:`zerotron.distributed.collectives`: every collective, with byte counts and a log (``CommStats``).
- :mod:`zerotron.distributed.launch`: ``init_distributed`` under torchrun, ``spawn`` for local ranks.
"""

from zerotron.distributed import collectives
from zerotron.distributed.collectives import CollectiveError, CommStats
from zerotron.distributed.launch import (
    LaunchError,
    current_rank_and_world,
    destroy_distributed,
    free_port,
    init_distributed,
    spawn,
    under_torchrun,
)
from zerotron.distributed.mesh import AXES, Group, Mesh, MeshError, ParallelDims

__all__ = [
    "AXES",
    "CollectiveError",
    "CommStats",
    "Group",
    "LaunchError",
    "Mesh",
    "MeshError",
    "ParallelDims",
    "collectives",
    "current_rank_and_world",
    "destroy_distributed",
    "free_port",
    "init_distributed",
    "spawn",
    "under_torchrun",
]
