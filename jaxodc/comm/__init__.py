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
           "NotAccepted", "RingAborted", "TopologyStale", "STRATEGIES", "SyncInfo", "solve_ring"]


def __getattr__(name):
    if name == "RingAborted":  # defined beside the native ring, which loads the extension
        from jaxodc.comm.ring import RingAborted
        return RingAborted
    raise AttributeError(f"module 'jaxodc.comm' has no attribute {name!r}")
