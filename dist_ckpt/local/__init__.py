"""The local checkpoint tier: each rank's state on node-local storage or tmpfs, copied to peers
on other nodes, for restarts in seconds (NVIDIA Resiliency Extension's interface:
``LocalCheckpointManager``, ``CliqueReplicationStrategy``, ``TensorAwareStateDict``).

- ``manager``: ``LocalCheckpointManager`` (find_latest, load, save; cleanup of old iterations).
- ``replication``: the clique rule and how parts travel between peers.
- ``base_state_dict``: ``TensorAwareStateDict`` at NVRx's module name.

The part files themselves (checksummed, written exclusively) are ``storage.local_parts``.
"""

from .base_state_dict import TensorAwareStateDict
from .manager import CkptID, LocalCheckpointManager, SameMachineReplicationException
from .replication import (
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
    NoReplicasAvailableError,
    ReplicationBrokenError,
    ReplicationConfigError,
    TransferTurns,
    parse_group_sequence,
)

__all__ = [
    "TensorAwareStateDict",
    "CkptID",
    "LocalCheckpointManager",
    "SameMachineReplicationException",
    "CliqueReplicationStrategy",
    "LazyCliqueReplicationStrategy",
    "NoReplicasAvailableError",
    "ReplicationConfigError",
    "ReplicationBrokenError",
    "TransferTurns",
    "parse_group_sequence",
]
