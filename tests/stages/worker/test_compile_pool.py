"""The warm-up's compile pool on the CPU, for explicit CUDA targets: what the pool compiles for recorded
launches is exactly what the launch path then finds (a second warm-up and the in-process path compile
nothing), a cache holding another target's kernels is not used, and the cache's namespace changes with
the target, the Triton version and any kernel source."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from stages.worker import compile_pool
from stages.worker.compile_pool import cache_tag, namespace_cache

SCENARIO = Path(__file__).with_name("compile_scenario.py")
ROOT = Path(__file__).resolve().parents[3]


def _scenario(tmp_path: Path, cache: Path, arch: int) -> dict:
    out = tmp_path / f"result{arch}.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, str(SCENARIO), str(out), str(arch)], env=env, check=True, timeout=240, cwd=ROOT
    )
    return json.loads(out.read_text())


def test_second_warm_up_compiles_nothing_and_another_target_is_not_served(tmp_path):
    cache = tmp_path / "cache"
    h100 = _scenario(tmp_path, cache, 90)
    assert h100["names"] == ["_lora_expand_kernel", "_lora_shrink_kernel"]
    assert h100["first"] == len(h100["specs"]) >= 2  # the empty cache: all compiled by the pool
    assert h100["second"] == 0 and h100["in_process"] == 0  # the same cache: nothing compiled again
    entries = sorted(p.name for p in cache.iterdir())
    a100 = _scenario(tmp_path, cache, 80)  # same kernels and launches, another GPU, same directory
    assert a100["in_process"] == len(a100["specs"])  # every one compiled, none taken from sm_90's
    assert set(entries) < {p.name for p in cache.iterdir()}


def test_cache_namespace_follows_target_triton_and_kernel_sources(tmp_path, monkeypatch):
    h100, a100 = GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)
    assert cache_tag(h100) != cache_tag(a100) and f"triton{triton.__version__}" in cache_tag(h100)
    copy = tmp_path / "kernels"
    shutil.copytree(compile_pool.KERNEL_DIR, copy)
    monkeypatch.setattr(compile_pool, "KERNEL_DIR", copy)
    before = cache_tag(h100)
    shrink = copy / "lora_shrink.py"
    shrink.write_text(shrink.read_text().replace("BLOCK_K", "BLOCK_KK"))
    assert cache_tag(h100) != before
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "base"))
    path = namespace_cache(h100)
    assert path == str(tmp_path / "base" / cache_tag(h100)) and os.environ["TRITON_CACHE_DIR"] == path
    assert namespace_cache(h100) == path  # already there: not nested again


def test_sources_hash_follows_every_file_its_name_and_its_place(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("A = 1\n")
    (tmp_path / "b.py").write_text("B = 2\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not a source")
    paths = [tmp_path / "pkg", tmp_path / "b.py"]
    before = compile_pool.sources_hash(paths, tmp_path)
    assert before == hashlib.sha256(b"pkg/a.pyA = 1\nb.pyB = 2\n").hexdigest()  # *.py files only
    (tmp_path / "pkg" / "a.py").write_text("A = 3\n")
    edited = compile_pool.sources_hash(paths, tmp_path)
    assert edited != before
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "c.py")
    assert compile_pool.sources_hash(paths, tmp_path) not in (before, edited)  # same bytes, other name
