"""The Ray Serve application: the replica deployment (one lorapipe server each, its GPU and CPUs, health
checks, Ray's router bounded by max_ongoing_requests) bound under the OpenAI ingress."""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from runtime.ray_serve.config import ClusterConfig
from runtime.ray_serve.ingress import OpenAIIngress
from runtime.ray_serve.replica import LorapipeReplica

INGRESS_REPLICAS = 1  # a thin pass-through; raise it when one process cannot parse the request rate


def router_env(cfg: ClusterConfig) -> dict[str, str]:
    """Settings of Ray's router, which runs in the ingress's process (the caller of the replicas' handle):
    the queue-length probe's first deadline and its backoff's cap (never below the first), and how long a
    request keeps to the replicas holding its adapter before any replica may take it (Ray's default 1 to
    2 s; a busy ingress loop can let that pass before the request is routed at all). A full replica still
    refuses a request at once, and the next attempt spills it: overload spreads a hot adapter either way."""
    first = cfg.router_probe_deadline_s
    return {
        "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": str(first),
        "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": str(max(first * 4, 1.0)),
        "RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S": str(max(first * 5, 1.0)),
    }


def build_app(cfg: ClusterConfig) -> Application:
    replica = serve.deployment(
        LorapipeReplica,
        name="LorapipeReplica",
        num_replicas=cfg.num_replicas,
        ray_actor_options={"num_gpus": cfg.gpus_per_replica, "num_cpus": cfg.cpus_per_replica},
        max_ongoing_requests=cfg.max_ongoing_requests,
        health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s,
        graceful_shutdown_timeout_s=cfg.health_check_timeout_s + 20.0,
    )
    ingress = serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        num_replicas=INGRESS_REPLICAS,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": router_env(cfg)}},
        max_ongoing_requests=cfg.max_ongoing_requests * cfg.num_replicas,
    )
    return ingress.bind(replica.bind(cfg), cfg)
