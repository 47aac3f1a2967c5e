"""The Kubernetes manifests in deploy/k8s/ parse, hang together (labels, ports, names, the EPP's config
file) and name exactly the series lorapipe's scheduler registers for the endpoint picker: the names are
imported from the code and checked against a real scheduler registry, never copied here."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from runtime.base.metrics import StageMetrics
from runtime.serve_args import add_serve_arguments, from_namespace
from stages.scheduler.gateway_metrics import EPP_METRICS, LORA_INFO, add_gateway_metrics
from stages.scheduler.metrics import HOLD_STATES, TIERS, WAITING_TIERS, SchedulerMetrics

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
ENGINE_LABEL = "inference.networking.k8s.io/engine-type"


def load_all() -> dict[tuple[str, str], dict]:
    """{(kind, name): object} over every document of every manifest; a duplicate is an error."""
    objs: dict[tuple[str, str], dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict) and {"apiVersion", "kind", "metadata"} <= doc.keys(), path.name
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objs, f"{key} defined twice"
            objs[key] = doc
    return objs


@pytest.fixture(scope="module")
def objs() -> dict[tuple[str, str], dict]:
    return load_all()


def epp_config(objs) -> dict:
    return yaml.safe_load(objs["ConfigMap", "lorapipe-epp-config"]["data"]["epp.yaml"])


def flags(args: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--") and "=" in a)


def server_container(objs) -> dict:
    (c,) = objs["Deployment", "lorapipe"]["spec"]["template"]["spec"]["containers"]
    return c


def test_every_object_the_guide_names_is_there(objs):
    want = {
        ("Deployment", "lorapipe"),
        ("Service", "lorapipe"),
        ("InferencePool", "lorapipe"),
        ("HTTPRoute", "lorapipe"),
        ("ConfigMap", "lorapipe-epp-config"),
        ("Deployment", "lorapipe-epp"),
        ("Service", "lorapipe-epp"),
    }
    assert want <= objs.keys()


def test_the_epp_reads_the_series_the_scheduler_registers(objs):
    m = StageMetrics("scheduler")
    SchedulerMetrics(
        m,
        lambda: None,
        lambda: 0,
        lambda: dict.fromkeys(TIERS, 0),
        lambda: dict.fromkeys(WAITING_TIERS, 0),
        lambda: dict.fromkeys(HOLD_STATES, 0),
    )
    add_gateway_metrics(m, lambda: None, lambda: ["a"], lambda: 4)
    registered = {metric.name for metric in m.registry.collect()}
    assert set(EPP_METRICS.values()) <= registered
    info = next(metric for metric in m.registry.collect() if metric.name == LORA_INFO)
    labels = info.samples[0].labels
    assert {"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= labels.keys()

    cfg = epp_config(objs)
    (extractor,) = [p for p in cfg["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    assert {k: v for k, v in engine.items() if k != "name"} == EPP_METRICS
    assert extractor["parameters"]["defaultEngine"] == engine["name"]
    pod_labels = objs["Deployment", "lorapipe"]["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[ENGINE_LABEL] == engine["name"]


def test_the_scheduling_profile_uses_only_declared_plugins_and_lora_affinity(objs):
    cfg = epp_config(objs)
    declared = {p.get("name", p["type"]) for p in cfg["plugins"]}
    (profile,) = cfg["schedulingProfiles"]
    refs = [p["pluginRef"] for p in profile["plugins"]]
    assert set(refs) <= declared
    assert "lora-affinity-scorer" in refs


def test_server_args_parse_as_lorapipe_serve_and_ports_line_up(objs):
    c = server_container(objs)
    assert c["command"] == ["lorapipe"] and c["args"][0] == "serve"
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    serve = from_namespace(parser.parse_args(c["args"][1:]))  # a wrong flag exits here
    assert serve.host == "0.0.0.0"
    port = serve.port
    assert [p["containerPort"] for p in c["ports"]] == [port]
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and named[get["port"]] == port, probe
    pool = objs["InferencePool", "lorapipe"]["spec"]
    assert [p["number"] for p in pool["targetPorts"]] == [port]
    (svc_port,) = objs["Service", "lorapipe"]["spec"]["ports"]
    assert svc_port["targetPort"] == port
    grace = objs["Deployment", "lorapipe"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > serve.drain_timeout_s


def test_selectors_match_the_pods(objs):
    pods = objs["Deployment", "lorapipe"]["spec"]["template"]["metadata"]["labels"]
    for selector in (
        objs["Deployment", "lorapipe"]["spec"]["selector"]["matchLabels"],
        objs["InferencePool", "lorapipe"]["spec"]["selector"]["matchLabels"],
        objs["Service", "lorapipe"]["spec"]["selector"],
    ):
        assert selector.items() <= pods.items()
    epp_pods = objs["Deployment", "lorapipe-epp"]["spec"]["template"]["metadata"]["labels"]
    assert objs["Service", "lorapipe-epp"]["spec"]["selector"].items() <= epp_pods.items()


def test_the_pool_points_at_the_epp_and_the_epp_at_the_pool_and_its_config(objs):
    ref = objs["InferencePool", "lorapipe"]["spec"]["endpointPickerRef"]
    (svc_port,) = objs["Service", "lorapipe-epp"]["spec"]["ports"]
    assert ref["name"] == "lorapipe-epp" and ref["port"]["number"] == svc_port["port"]
    epp = objs["Deployment", "lorapipe-epp"]["spec"]["template"]["spec"]
    (c,) = epp["containers"]
    f = flags(c["args"])
    assert f["pool-name"] == "lorapipe"
    assert int(f["grpc-port"]) == svc_port["targetPort"]
    (mount,) = c["volumeMounts"]
    (vol,) = [v for v in epp["volumes"] if v["name"] == mount["name"]]
    config_map = objs["ConfigMap", vol["configMap"]["name"]]
    key = f["config-file"].removeprefix(mount["mountPath"] + "/")
    assert key in config_map["data"]
    route = objs["HTTPRoute", "lorapipe"]["spec"]["rules"][0]["backendRefs"][0]
    assert (route["kind"], route["name"]) == ("InferencePool", "lorapipe")


def test_a_drifted_metric_name_is_caught():
    """The check above compares whole dicts: renaming one series in the config must fail it."""
    cfg = epp_config(load_all())
    (extractor,) = [p for p in cfg["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    engine["loraSpec"] = "vllm:lora_requests_info"
    assert {k: v for k, v in engine.items() if k != "name"} != EPP_METRICS
