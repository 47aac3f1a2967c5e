"""The four pipeline stages, one process each (`tokenizer`, `scheduler`, `loader`, `worker`). A stage
imports only `proto`, `runtime.base`, `runtime.common` and `kernels`, never another stage."""
