"""DS-Sync (divide-and-shuffle synchronisation, docs/ds_sync.md): the group schedule
(:mod:`.schedule`) and the group-wise sync of a step's gradients (:mod:`.sync`). The DeepSpeed
plug-in's route is :mod:`zen_ds.integrations.deepspeed.ds_sync`; the config key is ``"shuffle"``."""
