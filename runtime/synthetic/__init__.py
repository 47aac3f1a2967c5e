"""Seeded random checkpoints and PEFT adapters in real file layouts: the demo's embedded default, the
tests' fixtures and the benchmarks' inputs (`model.make_model`, `adapters.make_adapters`)."""
