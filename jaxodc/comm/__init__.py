"""Fault-tolerant communicator (PCCL-style): client, shared state, ring topology.

The native data path (jaxodc.comm.ring, jaxodc.comm.hashing) is imported lazily by the
communicator, so importing this package does not load the extension."""
from jaxodc.comm.communicator import (
    AllReduceHandle,
    CollectiveAborted,
    CommError,
    Communicator,
    MasterUnavailable,
    NotAccepted,
    TopologyStale,
)
from jaxodc.comm.shared_state import STRATEGIES, SyncInfo
from jaxodc.coord.topology import solve_ring

__all__ = ["AllReduceHandle", "CollectiveAborted", "CommError", "Communicator", "MasterUnavailable",
           "NotAccepted", "TopologyStale", "STRATEGIES", "SyncInfo", "solve_ring"]
