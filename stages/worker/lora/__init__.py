"""LoRA on the worker: device slots (`slots`), their copies (`pitched_copy`) and the backends that add
every token's adapter delta (`factory.make_backend`: torch or triton)."""
