"""adapter_model.safetensors read as an untrusted file: every inconsistency of the header (length, JSON,
dtypes, shapes, offsets out of bounds, overlapping tensors, holes) and of the file itself (not regular,
too large, truncated after the header was read, too slow) is an AdapterError naming the adapter; tensors
the format leaves unaligned still pack exactly."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_plan import ReadLimits
from stages.loader.adapter_reader import plan_adapter, read_adapter
from stages.loader.block_writer import write_all

pytestmark = pytest.mark.timeout(60)
FILE = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def base(tiny_llama) -> tuple[ModelConfig, LoraLayout]:
    cfg = ModelConfig.from_dir(tiny_llama)
    return cfg, LoraLayout.for_model(cfg, 16)


@pytest.fixture
def adapter(llama_adapters, tmp_path) -> Path:
    dst = tmp_path / "bad"
    shutil.copytree(llama_adapters["qv5"], dst)  # rank 5, q_proj and v_proj, float32
    return dst


def split(path: Path) -> tuple[dict, bytes]:
    """(header dict, data section) of a file, parsed here from the format's definition."""
    raw = (path / FILE).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write(path: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    (path / FILE).write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def refused(base, path: Path, *reasons: str, limits: ReadLimits | None = None) -> str:
    with pytest.raises(AdapterError) as e:
        read_adapter("bad", path, *base, torch.bfloat16, limits=limits)
    msg = str(e.value)
    assert msg.startswith("adapter 'bad': "), msg
    for reason in reasons:
        assert reason in msg, msg
    return msg


def first_tensor(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


@pytest.mark.parametrize(
    ("length", "reason"),
    [(1 << 40, "header length"), (1, "header length"), (0, "header length")],
    ids=["beyond-file", "one", "zero"],
)
def test_header_length(base, adapter, length, reason):
    header, data = split(adapter)
    write(adapter, header, data, length=length)
    refused(base, adapter, "unreadable adapter_model.safetensors", reason)


@pytest.mark.parametrize(
    ("text", "reason"),
    [(b"[1, 2]", "not a JSON object"), (b"{\xff\xfe}", "bad header"), (b'{"a": 1, "a": 2}', "appears twice")],
    ids=["array", "not-utf8", "duplicate-key"],
)
def test_header_not_a_json_object(base, adapter, text, reason):
    write(adapter, text, b"")
    refused(base, adapter, "unreadable", reason)


def _edit_first(base, adapter, edit, *reasons):
    header, data = split(adapter)
    key = first_tensor(header)
    edit(header, header[key])
    write(adapter, header, data)
    return refused(base, adapter, *reasons)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda h, t: t.update(dtype="F33"), "unknown dtype 'F33'"),
        (lambda h, t: t.update(dtype=["F32"]), "unknown dtype"),
        (lambda h, t: t.update(shape=[5, -64]), "not a list of non-negative integers"),
        (lambda h, t: t.update(shape=[5, True]), "not a list of non-negative integers"),
        (lambda h, t: t.update(shape="5,64"), "not a list of non-negative integers"),
        (lambda h, t: t.update(shape=[5, 32]), "bytes for shape [5, 32]"),
        (lambda h, t: t.update(data_offsets=[0]), "is not two integers"),
        (lambda h, t: t.update(data_offsets=[0, 1 << 40]), "outside the"),
        (lambda h, t: t.update(data_offsets=[-4, 1276]), "outside the"),
        (lambda h, t: t.update(extra=1), "expected exactly dtype, shape and data_offsets"),
        (lambda h, t: t.pop("dtype"), "expected exactly dtype, shape and data_offsets"),
        (lambda h, t: h.update(__metadata__={"format": 1}), "__metadata__ must map strings to strings"),
    ],
    ids=["dtype", "dtype-list", "negative-dim", "bool-dim", "shape-str", "size-mismatch", "one-offset",
         "end-oob", "negative-offset", "extra-field", "no-dtype", "metadata"],
)  # fmt: skip
def test_bad_tensor_entries(base, adapter, edit, reason):
    _edit_first(base, adapter, edit, "unreadable adapter_model.safetensors", reason)


def test_integer_tensor(base, adapter):
    def to_int(h, t):
        t["dtype"] = "I32"

    _edit_first(base, adapter, to_int, "has dtype I32; LoRA weights must be F32, F16, BF16 or F64")


def test_overlapping_tensors(base, adapter):
    header, data = split(adapter)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = header[names[0]]["data_offsets"], header[names[1]]["data_offsets"]
    b[:] = [a[0], a[0] + b[1] - b[0]]  # the second tensor moved onto the first one's bytes
    write(adapter, header, data)
    refused(base, adapter, "overlap")


@pytest.mark.parametrize("where", ["hole", "trailing"])
def test_bytes_that_belong_to_no_tensor(base, adapter, where):
    header, data = split(adapter)
    if where == "hole":  # every tensor after the first moves 4 bytes on
        first = first_tensor(header)
        for k, t in header.items():
            if k not in ("__metadata__", first):
                t["data_offsets"] = [o + 4 for o in t["data_offsets"]]
        size = header[first]["data_offsets"][1]
        data = data[:size] + b"\0" * 4 + data[size:]
    else:
        data += b"\0" * 4
    write(adapter, header, data)
    refused(base, adapter, "belong to no tensor")


def test_truncated_data_section(base, adapter):
    header, data = split(adapter)
    write(adapter, header, data[:-2])
    refused(base, adapter, "outside the")


def test_unaligned_tensors_pack_exactly(base, adapter, llama_adapters):
    """An odd header length (legal: JSON may end in spaces) puts every tensor at an odd file offset."""
    header, data = split(adapter)
    text = json.dumps(header).encode()
    write(adapter, text + b" " * (1 - len(text) % 2 + 2), data)
    assert (len(text) + 8 + 1 - len(text) % 2 + 2) % 2 == 1
    got = read_adapter("odd", adapter, *base, torch.float32)
    want = read_adapter("even", llama_adapters["qv5"], *base, torch.float32)
    assert torch.equal(got.block, want.block)
    tensors = load_file(llama_adapters["qv5"] / FILE)
    q_a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert torch.equal(LoraLayout.a_view(got.block, 0, base[1].group("qkv"))[:, 0], q_a)  # not all zeros


def test_not_a_regular_file(base, adapter):
    (adapter / FILE).unlink()
    (adapter / FILE).mkdir()
    refused(base, adapter, "is not a regular file")


def test_a_fifo_is_refused_without_blocking(base, adapter):
    (adapter / FILE).unlink()
    os.mkfifo(adapter / FILE)
    messages: list[str] = []
    reader = threading.Thread(target=lambda: messages.append(refused(base, adapter)), daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():  # blocked in open(): give it a writer so the thread can end, then fail
        os.close(os.open(adapter / FILE, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading a FIFO blocked")
    assert len(messages) == 1 and "is not a regular file" in messages[0]


def test_size_cap(base, adapter):
    size = (adapter / FILE).stat().st_size
    refused(base, adapter, f"is {size} bytes, more than the limit of {size - 1}", limits=ReadLimits(size - 1))
    assert read_adapter("ok", adapter, *base, torch.bfloat16, limits=ReadLimits(size)).rank == 5


def test_read_deadline(base, adapter):
    refused(base, adapter, "read deadline", limits=ReadLimits(timeout_s=-1.0))


def test_file_truncated_after_the_header_was_read(base, adapter):
    """The file shrinks between planning and reading (rewritten in place): a clean error, no crash."""
    with plan_adapter("bad", adapter, *base, torch.bfloat16) as plan:
        os.truncate(adapter / FILE, plan.segments[-1].end - 3)
        block = torch.empty(plan.shape, dtype=torch.bfloat16)
        with pytest.raises(AdapterError, match="unreadable adapter_model.safetensors .*truncated"):
            write_all(plan, block)


def test_the_file_is_closed_after_success_and_failure(base, adapter, llama_adapters):
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        read_adapter("ok", llama_adapters["qv5"], *base, torch.bfloat16)
        with pytest.raises(AdapterError):
            read_adapter("bad", adapter, *base, torch.bfloat16, limits=ReadLimits(timeout_s=-1.0))
    assert len(os.listdir("/proc/self/fd")) == fds
