"""A simulated worker for planner tests with an independent model of the GPU adapter pool: which adapter
owns each pool row and which adapter each id holds, built only from the plans' loads. It checks that a
load never takes rows a running request's adapter still owns (nor a pinned adapter's), that every
request runs on an id whose rows all still hold its adapter, and that a step never has more distinct
adapters than `max_loras_per_batch`. It models the KV cache too, position by position (which adapter
and which tokens up to it each slot was written for): every position a running request has computed
holds its own adapter's KV of its own tokens (a prefix-cache hit included), and no step writes a page
that another running request holds. Loads are reported ready one step later when overlapped, at once
otherwise."""

from __future__ import annotations

from proto.plan import FinishedRequest, StepResult
from stages.scheduler.planner import Planner

# The planner alone, as its unit tests drive it: no overlapped loading, prefetch or adapter affinity (the
# engine's defaults turn all three on; tests that want one set it).
PLANNER_ALONE = dict(overlap_loading=False, prefetch_depth=0, adapter_affinity_steps=0, overlap_min_mb=0.0)


class PoolWorker:
    def __init__(self, planner: Planner, ranks: dict[str, int], overlap: bool, adapter_of=None):
        """`adapter_of(request_id)`: its adapter (default: the planner's, which forgets aborted ones)."""
        self.planner, self.ranks, self.overlap = planner, ranks, overlap
        self.adapter_of = adapter_of or (lambda rid: planner._by_id[rid].adapter)
        self.pinned: set[str] = set()  # adapters loaded while the planner honoured their pin
        self.owner: list[str | None] = [None] * planner.cfg.pool_rows  # adapter per pool row
        self.id_adapter: dict[int, str] = {}  # ids whose rows are intact
        self.id_rows: dict[int, list[int]] = {}
        self.state: dict[str, dict] = {}
        self.pending: list[int] = []  # overlapped loads of the previous step, reported in this one
        self.loads = 0
        # (page, offset) -> what the KV there was computed from: (adapter, tokens up to it)
        self.kv: dict[tuple[int, int], tuple] = {}

    def _load(self, load) -> None:
        rows = [s + k for s, n in zip(load.row_starts, load.row_counts, strict=True) for k in range(n)]
        assert len(rows) == self.ranks[load.adapter], f"{load.adapter} got {len(rows)} rows"
        assert len(set(rows)) == len(rows) and all(0 <= r < len(self.owner) for r in rows), rows
        active = [st for st in self.state.values() if st["active"] and st["slot"] >= 0]
        in_use = {r: st["adapter"] for st in active for r in self.id_rows[st["slot"]]}
        intact = {r: a for i, a in self.id_adapter.items() for r in self.id_rows[i]}
        for r in rows:
            assert r not in in_use, f"load of {load.adapter} takes row {r} of {in_use.get(r)}, in use"
            prev = intact.get(r)
            assert prev is None or prev not in self.pinned or prev == load.adapter, f"pinned {prev} evicted"
        for lora_id, old in list(self.id_rows.items()):
            if lora_id == load.slot or set(old) & set(rows):
                self.id_adapter.pop(lora_id, None)
                self.id_rows.pop(lora_id)
        for r in rows:
            self.owner[r] = load.adapter
        self.id_adapter[load.slot], self.id_rows[load.slot] = load.adapter, rows
        res = self.planner.pool.get(load.adapter)
        if res is not None and res.pinned:
            self.pinned.add(load.adapter)
        self.loads += 1

    def run(self, plan) -> StepResult:
        cfg = self.planner.cfg
        report, self.pending = self.pending, []
        sync_ready = []
        for rid in plan.finished_request_ids:  # they run no more: a load may take their rows
            self.state.pop(rid, None)
        for load in plan.slot_loads:
            self._load(load)
            (self.pending if self.overlap and load.layered else sync_ready).append(load.slot)
        for rid in plan.preempted_request_ids:
            self.state[rid].update(computed=0, active=False, pages=[])
        counts = {}
        for n in plan.new_requests:
            prompt = n.prompt_ids.tolist()
            self.state[n.request_id] = dict(
                tokens=len(prompt), prompt=len(prompt), computed=n.num_computed_tokens, active=True,
                pages=list(n.page_ids), max_tokens=n.sampling.max_tokens, slot=n.slot,
                adapter=self.adapter_of(n.request_id), ids=tuple(prompt), rid=n.request_id,
            )  # fmt: skip
            counts[n.request_id] = n.num_scheduled_tokens
        for c in plan.cached_requests:
            st = self.state[c.request_id]
            if c.resumed:
                st.update(
                    active=True, pages=list(c.new_page_ids), slot=c.slot, computed=c.num_computed_tokens
                )
            else:
                st["pages"] += c.new_page_ids
            counts[c.request_id] = c.num_scheduled_tokens
        self._check_kv(counts)
        finished, in_step = [], set()
        for rid, st in self.state.items():
            if not st["active"]:
                continue
            if st["adapter"] is not None:
                in_step.add(st["adapter"])
                lora_id = st["slot"]
                assert self.id_adapter.get(lora_id) == st["adapter"], f"{rid} runs on id {lora_id}"
                assert all(self.owner[r] == st["adapter"] for r in self.id_rows[lora_id]), f"{rid}: rows lost"
            else:
                assert st["slot"] < 0
            st["computed"] += counts.get(rid, 1)
            assert st["computed"] <= st["tokens"], f"{rid} computes tokens it does not have"
            assert len(st["pages"]) * cfg.page_size >= st["computed"], f"{rid} lacks KV pages"
            if st["computed"] == st["tokens"]:
                st["tokens"] += 1
                if st["tokens"] - st["prompt"] >= st["max_tokens"] or st["tokens"] >= cfg.max_model_len:
                    st["active"] = False
                    finished.append(FinishedRequest(request_id=rid, reason="length", num_output_tokens=0))
        assert len(in_step) <= cfg.max_loras_per_batch, f"{len(in_step)} adapters in one step"
        return StepResult(step=plan.step, finished=finished, slots_ready=sync_ready + report)

    def _what(self, st: dict, pos: int) -> tuple:
        """What position `pos` of a request's KV is computed from (outputs: its own, unknown here)."""
        return (st["adapter"], st["ids"][: pos + 1] if pos < st["prompt"] else (st["rid"], pos))

    def _check_kv(self, counts: dict[str, int]) -> None:
        """Before the step: what each request reads is its own KV; then the step's writes, which must
        land in pages no other running request holds."""
        ps = self.planner.cfg.page_size
        active = [st for st in self.state.values() if st["active"]]
        holders: dict[int, int] = {}
        for st in active:
            for p in st["pages"]:
                holders[p] = holders.get(p, 0) + 1
            for pos in range(st["computed"]):
                got = self.kv.get((st["pages"][pos // ps], pos % ps))
                assert got == self._what(st, pos), f"{st['rid']} reads the wrong KV at position {pos}"
        for st in active:
            for pos in range(st["computed"], st["computed"] + counts.get(st["rid"], 1)):
                page = st["pages"][pos // ps]
                assert holders[page] == 1, f"{st['rid']} writes page {page}, which another request holds"
                self.kv[(page, pos % ps)] = self._what(st, pos)


def check_pool(planner: Planner) -> None:
    """The planner's pool: references equal running users, rows disjoint, and no row leaked."""
    pool = planner.pool
    seen: set[int] = set()
    for res in pool.residents.values():
        users = sum(1 for r in planner.running if r.slot == res.lora_id)
        assert res.refs == users, f"{res.adapter}: {res.refs} references, {users} running users"
        rows = {s + k for s, n in res.runs for k in range(n)}
        assert not rows & seen, f"{res.adapter} shares rows"
        seen |= rows
    assert len(seen) + pool.rows.num_free == pool.rows.total_rows, "pool rows leaked"
