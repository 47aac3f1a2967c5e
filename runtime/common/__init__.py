"""What several stages share: the LoRA layout (`lora_layout`), the packed adapter (`packed`), the model
config (`model_config`, with the checkpoint's quantization from `quant_config`), the shared-memory
host pool (`host_pool`) and the CUDA driver asked without torch (`cuda_driver`). Imports no stage."""
