"""Layer 7, integrations: the one config model (:mod:`.config`), which params zen syncs
(:mod:`.params`), the per-step reducer (:mod:`.reducer`), Megatron-core groups (:mod:`.mpu`) and
the DeepSpeed plug-in (:mod:`.deepspeed`)."""
