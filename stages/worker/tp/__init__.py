"""Tensor parallelism: one worker process per GPU, each holding a shard of the base weights, the KV
heads and every adapter; rank 0 takes the plans and hands each step to the others."""
