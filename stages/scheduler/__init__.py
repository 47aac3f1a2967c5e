"""The scheduler stage: waiting and running queues, KV pages, adapter residency and the per-step plan
(`SchedulerActor`, `SchedulerConfig`; the pure-CPU `planner.Planner`)."""
