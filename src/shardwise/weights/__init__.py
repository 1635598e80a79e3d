"""Weights in and out: models built empty and initialized shard by shard (`materialize`; the
constructor's init recorded in `record`, what it keeps in `held`, the generator kept in step by
`draws`), pretrained weights loaded into the shards (`loading`), full weights written
(`export`), peft adapters and a sharded model's own save_pretrained (`adapters`), EMAs (`ema`),
and what every save of shardwise shares, exports and checkpoints alike (`storage`: checksums,
staging, atomic exchange, one-line errors)."""
