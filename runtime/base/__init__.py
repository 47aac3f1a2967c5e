"""The floor every stage stands on: the actor (`actor`), the one socket helper (`sockets`), every address
(`endpoints`) and per-stage metrics (`metrics`). Imports `proto` and nothing above it."""
