"""The adapter-loader stage: reads and validates PEFT adapters and packs them into the shared host pool
(`LoaderActor`, `LoaderConfig`; the host cache bookkeeping in `host_cache`)."""
