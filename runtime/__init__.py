"""Below the stages: `base` (actor, sockets, endpoints, metrics) and `common` (adapter format and layout,
model config, host pool). Above them, the assembly: launcher, serve arguments, offline engine, CLI, demo;
and the client SDK (`runtime.client`)."""
