"""adapter_ops against `lorapipe serve` on the tiny model (CPU): `load` registers adapters and leaves
them staged in the host cache without taking a slot, `list` shows that, `unload` removes them, and a
malformed NAME=PATH fails before anything is sent."""

from __future__ import annotations

import pytest

from tests.integration.serving import serve
from tools import adapter_ops

pytestmark = pytest.mark.timeout(180)


def test_load_list_unload(tiny_llama, llama_adapters, capsys):
    first = {"full8": llama_adapters["full8"]}
    flags = ("--max-loras-per-batch", "2", "--max-lora-rank", "16", "--allow-any-adapter-path")
    with serve(tiny_llama, first, *flags) as server:
        ep = ["--endpoint", server.endpoint, "--timeout", "60"]
        adapter_ops.main([*ep, "load", f"qv5={llama_adapters['qv5']}", f"rs12={llama_adapters['rs12']}"])
        assert "loaded 2 adapters: qv5, rs12" in capsys.readouterr().out
        with server.client() as c:
            tiers = {e.name: (e.tier, e.slot) for e in c.list_adapters()}
        assert tiers["qv5"] == ("host", None) and tiers["rs12"] == ("host", None)
        adapter_ops.main([*ep, "list"])
        listing = capsys.readouterr().out
        assert listing.splitlines()[0].split() == ["adapter", "tier", "slot", "state", "rank"]
        assert any(line.split()[:3] == ["rs12", "host", "-"] for line in listing.splitlines())
        adapter_ops.main([*ep, "unload", "qv5"])
        with server.client() as c:
            assert "qv5" not in {e.name for e in c.list_adapters()}
    with pytest.raises(SystemExit):
        adapter_ops.main(["load", "no-equals-sign"])
    assert "expected NAME=PATH" in capsys.readouterr().err
