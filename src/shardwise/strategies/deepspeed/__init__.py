"""The DeepSpeed backend (`backend="deepspeed"`): the strategy and the prepared model
(`strategy`), the one `import deepspeed` and the config dict (`setup`), the optimizer runner
(`runner`) and every private DeepSpeed name, by ZeRO stage (`internals`)."""
