"""Sources: the trainer side's weights (a plain module, FSDP2, Megatron), read live, in manifest order."""
