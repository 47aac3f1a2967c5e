"""lorapipe on Ray Serve: one `lorapipe serve` per replica (one GPU each), LoRA adapters multiplexed by
name with Ray's model multiplexing, and an OpenAI-compatible ingress routing by `model`. Optional: needs
the `lorapipe[ray]` extra. `python -m runtime.ray_serve --help`; docs/deploy.md has the guide.

Modules: `config` (the frozen ClusterConfig and the command line), `catalog` (adapter names to
directories), `server_process` (the replica's server as a process group), `adapter_table` (leases,
requests in flight, deferred unloads), `forward` (pass-through to the server's HTTP front end),
`replica` and `ingress` (the two deployments), `app` (binds them). Only `app`, `replica` and `ingress`
import Ray."""
