"""The Ray Serve deployment's configuration and adapter catalog: bad flags are refused with a message
naming them, before any cluster is touched; adapter names resolve only to adapter directories."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime.ray_serve.app import router_env
from runtime.ray_serve.catalog import AdapterCatalog, CatalogError
from runtime.ray_serve.config import ClusterConfig, ClusterConfigError, build_parser, from_args
from runtime.ray_serve.ingress import adapter_of


@pytest.fixture
def root(tmp_path):
    for name in ("a0", "a1"):
        (tmp_path / "root" / name).mkdir(parents=True)
        (tmp_path / "root" / name / "adapter_config.json").write_text("{}")
    (tmp_path / "root" / "not_an_adapter").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path


def test_catalog_resolves_root_and_listed_names(root):
    cat = AdapterCatalog.build([f"x={root / 'root' / 'a1'}"], root / "root")
    assert cat.path_of("a0") == str(root / "root" / "a0")
    assert cat.path_of("x") == str(root / "root" / "a1")
    assert cat.path_of("not_an_adapter") is None
    assert cat.path_of("../root/a0") is None and cat.path_of("") is None
    assert cat.names() == ["x", "a0", "a1"]
    (root / "root" / "a2").mkdir()
    (root / "root" / "a2" / "adapter_config.json").write_text("{}")
    assert cat.path_of("a2") is not None  # copied in after start: found without a restart


@pytest.mark.parametrize(
    "listed, want",
    [
        (["nosep"], "expected NAME=PATH"),
        (["bad/name=/tmp"], "is invalid"),
        (["a=/nonexistent"], "adapter_config.json does not exist"),
    ],
)
def test_catalog_names_the_bad_entry(root, listed, want):
    with pytest.raises(CatalogError, match=want):
        AdapterCatalog.build(listed, root / "root")


def test_catalog_needs_some_adapters(root):
    with pytest.raises(CatalogError, match="no adapters"):
        AdapterCatalog.build([], None)
    with pytest.raises(CatalogError, match="not a directory"):
        AdapterCatalog.build([], root / "missing")


def parse(root, *extra):
    ns = build_parser().parse_args(
        ["--model", str(root / "model"), "--adapter-root", str(root / "root"), *extra]
    )
    return from_args(ns)


def test_flags_become_the_config(root):
    cfg = parse(root, "--device", "cpu", "--num-replicas", "3", "--", "--max-lora-rank=16")
    assert (cfg.num_replicas, cfg.gpus_per_replica, cfg.server_args) == (3, 0.0, ("--max-lora-rank=16",))
    assert cfg.base_name == "model"
    assert parse(root).gpus_per_replica == 1.0


@pytest.mark.parametrize(
    "extra, want",
    [
        (["--num-replicas", "0"], "--num-replicas 0"),
        (["--device", "cpu", "--gpus-per-replica", "1"], "--gpus-per-replica must be 0"),
        (["--max-adapters-per-replica", "0"], "--max-adapters-per-replica 0"),
        (["--", "--port=9000"], "server flag --port: each replica sets it"),
        (["--", "--adapter", "x=/y"], "server flag --adapter"),
        (["--router-probe-deadline", "0"], "--router-probe-deadline 0"),
    ],
)
def test_bad_flags_are_named(root, extra, want):
    with pytest.raises(ClusterConfigError, match=want):
        parse(root, *extra)


def test_a_model_without_config_is_refused(root):
    with pytest.raises(ClusterConfigError, match="no config.json"):
        ClusterConfig(model=str(root), catalog=AdapterCatalog.build([], root / "root"))


def test_model_field_names_the_adapter_as_on_one_server():
    assert adapter_of("base", "base") is None
    assert adapter_of("base:a0", "base") == "a0"
    assert adapter_of("a0", "base") == "a0"


def test_the_router_settings_are_the_names_ray_reads(root):
    """The ingress's runtime_env sets these for Ray's router: Ray must read them under these very names."""
    env = router_env(parse(root, "--router-probe-deadline", "0.5"))
    code = (
        "from ray.serve._private import constants as c; print(c.RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S, "
        "c.RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S, "
        "c.RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S)"
    )
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0.5", "2.0", "2.5"]
