"""Sharded-parameter training: the FSDP core both trainers share (`core`), the collective baseline
(`collective`), the ODC trainer (`odc`) and its end of minibatch (`unitwise`), checkpoints, metrics,
the single-process reference (`reference`) and the user-facing `Trainer` / `sharded_step` (`api`).
What a trainer trains — units, Programs, adapters, precision — is `jaxodc.modeling`."""
