"""Horovod's elastic API (``hvd.elastic``) on dtrain's restart-based fault tolerance.

``@hvd.elastic.run`` wraps a training function of a `TorchState`; `state.commit()` saves
it in memory and to the job's elastic folder; after a process dies, the launcher
restarts the worker group and the function resumes from the last commit, with an
`ElasticSampler` sharding the rest of the epoch over the processes of the new group.
See docs/horovod.md, "Elastic training", for what differs from Horovod.
"""

from __future__ import annotations

from dtrain.horovod.elastic.loop import run
from dtrain.horovod.elastic.sampler import ElasticSampler
from dtrain.horovod.elastic.state import ObjectState, State
from dtrain.horovod.elastic.torch_state import TorchState
from dtrain.horovod.errors import HostsUpdatedInterrupt

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]
