"""What several stages share: the LoRA layout (`lora_layout`), the packed adapter (`packed`), the model
config (`model_config`) and the shared-memory host pool (`host_pool`). Imports no stage."""
