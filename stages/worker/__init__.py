"""The gpu-worker stage: weights, KV cache, LoRA slots, slot loads, forward and sampling
(`WorkerActor`, `WorkerConfig`; `runner.ModelRunner` and `executor.StepExecutor` for one-process use)."""
