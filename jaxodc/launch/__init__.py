"""Starting a jaxodc job: the launcher (`jaxodc launch`, `launch_ranks`), each rank's process
context read from the environment (`init_from_env`), and the rendezvous server the ranks meet at.
Importing it does not import jax."""
from jaxodc.launch.context import Context, init_from_env, init_jax_distributed, shutdown
from jaxodc.launch.launcher import launch_ranks, main

__all__ = ["Context", "init_from_env", "init_jax_distributed", "launch_ranks", "main", "shutdown"]
