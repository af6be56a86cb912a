"""Sharded-parameter training: the FSDP core both trainers share (`core`), the collective baseline
(`collective`), the ODC trainer (`odc`), units (`units`), checkpoints, metrics, the single-process
reference (`reference`) and the user-facing `Trainer` / `sharded_step` (`api`)."""
