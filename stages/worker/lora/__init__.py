"""LoRA on the worker: the rank-paged adapter pool (`pool`), its copies (`pitched_copy`) and the
backends that add every token's adapter delta (`factory.make_backend`: torch or triton)."""
