"""ZeRO (Rajbhandari et al. SC20) as one package: stages 1 and 2 (:mod:`.stage12`), stage 3
(:mod:`.stage3`), the flat buffers cut into data-parallel shards under all of them (:mod:`.flat`), the
shards' optimizer state (:mod:`.optim_state`), and CPU/NVMe offload of the optimizer and parameters
(:mod:`.offload`). :mod:`.api` applies it; every engine satisfies
:class:`zerotron.parallel.engine.ShardedEngine`.
"""

from zerotron.parallel.zero.api import ZeroEngine, apply_zero, offload_optimizer
from zerotron.parallel.zero.options import ZeroOptions

__all__ = ["ZeroEngine", "ZeroOptions", "apply_zero", "offload_optimizer"]
