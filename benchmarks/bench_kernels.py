"""Benchmark the multi-LoRA shrink/expand kernels on Llama-3-8B shapes against the memory floor and the
PEFT way (gather, two matmuls, scatter-add per adapter); prints one table, writes JSON to --out.
Times are CUDA-graph replays of back-to-back launches over rotated inputs (L2 flushed before each).
Adapter rows are read through a row table over slot memory: the backend's identity table, or with
`--rows scattered` the same rows in a random order (every rank row elsewhere, as in a paged pool)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.batch_info import BatchInfoBuilder  # noqa: E402
from kernels.lora_expand import ExpandConfig, expand_config, lora_expand  # noqa: E402
from kernels.lora_shrink import ShrinkConfig, lora_shrink, shrink_config, split_counters  # noqa: E402
from runtime.common.lora_layout import LoraLayout  # noqa: E402
from stages.worker.graph_capture import recording  # noqa: E402
from stages.worker.lora.triton_backend import split_cap, workspace_rows  # noqa: E402

HBM_BYTES_PER_S = 3.0e12  # measured device-to-device copy (read + write) on the H100
NUM_SLOTS, NUM_LAYERS, MAX_RANK, MAX_TOKENS = 64, 16, 64, 4096
DECODE = [(1, 1), (16, 1), (16, 8), (64, 1), (64, 8), (64, 64), (256, 1), (256, 8), (256, 64)]
PREFILL = [(4096, 8)]
TARGET = {"shrink": 60.0, "expand": 50.0}


def llama3_8b_layout(smoke: bool = False) -> LoraLayout:
    if smoke:  # CPU interpreter check of this script itself
        return LoraLayout.build(
            num_layers=NUM_LAYERS, hidden=64, q_out=64, kv_out=32, intermediate=96, max_rank=64
        )
    return LoraLayout.build(
        num_layers=NUM_LAYERS, hidden=4096, q_out=4096, kv_out=1024, intermediate=14336, max_rank=MAX_RANK
    )


@triton.jit
def _noop_kernel(x_ptr, N: tl.constexpr):
    pass


def floor_bytes(kind: str, g, r: int, T: int, n_ad: int) -> int:
    """Bytes that must move: input once, distinct adapters' weights once (real rank), output r+w."""
    n = g.num_slices
    if kind == "shrink":
        return 2 * (T * g.in_dim + n_ad * r * n * g.in_dim + T * n * r)
    return 2 * (T * n * r + n_ad * r * g.out_total + 2 * T * g.out_total)


class Case:
    """One (group, rank, tokens, adapters) problem, replicated over layers as in a forward: the replicas
    share one batch metadata buffer (hot, like every layer of a real forward) and read distinct layers'
    weights and inputs (cold: the graph touches each layer once after do_bench flushes L2)."""

    def __init__(self, slots_mem, rows, layout, g, r, T, n_ad, device):
        self.g, self.r, self.T, self.n_ad, self.layout = g, r, T, n_ad, layout
        self.rows = rows  # [NUM_SLOTS, MAX_RANK] int32 row table over `slots_mem`
        per = T // n_ad
        self.indptr = [a * per for a in range(n_ad + 1)]
        self.seg_slots = list(range(n_ad))
        smallest = min(floor_bytes(k, g, r, T, n_ad) for k in ("shrink", "expand"))
        self.reps = 1 if device.type != "cuda" else max(2, min(NUM_LAYERS, math.ceil(256e6 / smallest)))
        self.replicas = []
        for j in range(self.reps):
            x = torch.randn((T, g.in_dim), device=device, dtype=slots_mem.dtype)  # [T, K]
            out = torch.randn((T, g.out_total), device=device, dtype=slots_mem.dtype)  # [T, D]
            self.replicas.append(dict(layer=j % NUM_LAYERS, seg_slots=self.seg_slots, x=x, out=out))
        self.mem = slots_mem
        self._infos = {}

    def info(self, j: int, block_m: int | None):
        key = block_m or 0
        if key not in self._infos:
            builder = BatchInfoBuilder(MAX_TOKENS, self.mem.device)
            self._infos[key] = builder.build(self.indptr, self.seg_slots, self.r, block_m=block_m)
        return self._infos[key]

    def views(self, j: int, ranks, scalings):
        """One replica's A [P, n, K] and B^T [P, D] pool rows, rank and scaling columns."""
        rep, g = self.replicas[j], self.g
        sl = slice(g.first_slice, g.first_slice + g.num_slices)
        base = LoraLayout.slot_rows(self.mem, rep["layer"])  # [P, row]
        a, b = LoraLayout.a_rows(base, g), LoraLayout.b_rows(base, g)
        return a, b, ranks[:, rep["layer"], sl], scalings[:, rep["layer"], sl]

    def adapter_rows(self, slot: int) -> torch.Tensor:
        """Pool rows of `slot`'s first r rank rows (int64, for the torch checks and the PEFT way)."""
        return self.rows[slot, : self.r].long()


def graph_us(launches, device, rep_ms: int = 40) -> float:
    """Median µs per launch: one CUDA graph of all launches, replayed (L2 flushed by do_bench)."""
    for f in launches:
        f()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for f in launches:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(launches)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with recording(graph):
        for f in launches:
            f()
    ms = triton.testing.do_bench(graph.replay, warmup=rep_ms // 4, rep=rep_ms, return_mode="median")
    del graph
    return ms * 1e3 / len(launches)


def shrink_launches(case, ranks, scalings, block_m, cfg):
    """One shrink launch per replica, each with its own output, split-K partials and split counters."""
    vs, launches = [], []
    for j, rep in enumerate(case.replicas):
        info = case.info(j, block_m)
        a, _, rk, _ = case.views(j, ranks, scalings)
        v = torch.empty((cfg.parts, case.T, case.g.num_slices, info.block_rank), device=a.device)
        p = torch.empty(cfg.split_k * v.numel(), device=a.device)
        c = split_counters(case.T, case.g.num_slices, info.block_rank, a.device)
        vs.append(v)
        launches.append(
            lambda x=rep["x"], a=a, rk=rk, info=info, v=v, p=p, c=c: lora_shrink(
                x, a, rk, case.rows, info, out=v, partials=p, counters=c, config=cfg
            )
        )
    return launches, vs


def run_shrink(case, ranks, scalings, block_m, cfg, rep_ms=40):
    """Time one shrink config over all replicas; returns (µs, rel. error vs torch on replica 0, vs)."""
    launches, vs = shrink_launches(case, ranks, scalings, block_m, cfg)
    launches[0]()
    a, _, _, _ = case.views(0, ranks, scalings)
    got = vs[0].sum(0)[..., : case.r]  # [T, N, r]
    ref = torch.empty_like(got)
    rep = case.replicas[0]
    for i, slot in enumerate(rep["seg_slots"]):
        lo, hi = case.indptr[i], case.indptr[i + 1]
        ref[lo:hi] = torch.einsum("tk,rsk->tsr", rep["x"][lo:hi].float(), a[case.adapter_rows(slot)].float())
    err = float((got - ref).norm() / ref.norm())
    return graph_us(launches, case.mem.device, rep_ms), err, vs


def run_expand(case, ranks, scalings, block_m, cfg, vs, rep_ms=40):
    launches = []
    for j, rep in enumerate(case.replicas):
        info = case.info(j, block_m)
        _, b, rk, sc = case.views(j, ranks, scalings)
        g = case.g
        launches.append(
            lambda v=vs[j], b=b, rk=rk, sc=sc, out=rep["out"], info=info, g=g: lora_expand(
                v, b, rk, sc, case.rows, out, g.out_offsets, g.out_dims, info, config=cfg
            )
        )
    rep, g = case.replicas[0], case.g
    _, b, _, _ = case.views(0, ranks, scalings)
    rep["out"].normal_()  # earlier timings accumulated into it
    before = rep["out"].float()
    launches[0]()
    vsum = vs[0].sum(0)[..., : case.r].to(b.dtype).float()  # [T, N, r]
    delta = torch.zeros_like(before)
    for i, slot in enumerate(rep["seg_slots"]):
        lo, hi = case.indptr[i], case.indptr[i + 1]
        for s, (off, w) in enumerate(zip(g.out_offsets, g.out_dims, strict=True)):
            b_s = b[case.adapter_rows(slot), off : off + w].float()  # [r, w]
            delta[lo:hi, off : off + w] = 2.0 * vsum[lo:hi, s] @ b_s
    err = float((rep["out"].float() - before - delta).norm() / delta.norm())
    return graph_us(launches, case.mem.device, rep_ms), err


def run_peft(case, ranks, scalings) -> float:
    """The PEFT way on replica 0: per distinct adapter gather rows, x@A^T, @B^T, scale, scatter-add."""
    rep, g = case.replicas[0], case.g
    a, b, _, _ = case.views(0, ranks, scalings)
    work = []
    for i, slot in enumerate(rep["seg_slots"]):
        idx = torch.arange(case.indptr[i], case.indptr[i + 1], device=a.device)
        rows = case.adapter_rows(slot)
        wa = [a[rows, s].contiguous() for s in range(g.num_slices)]  # lora_A.weight [r, K]
        wb = [b[rows, o : o + w].t().contiguous() for o, w in zip(g.out_offsets, g.out_dims, strict=True)]
        work.append((idx, wa, wb))
    x, out = rep["x"], rep["out"]

    def peft():
        for idx, wa, wb in work:
            xs = x.index_select(0, idx)
            delta = torch.cat(
                [(xs @ wa_s.t()) @ wb_s.t() * 2.0 for wa_s, wb_s in zip(wa, wb, strict=True)], dim=1
            )
            out.index_add_(0, idx, delta)

    return graph_us([peft], a.device)


def default_configs(case):
    """The backend's choice for this case: token tile, shrink and expand configs."""
    info = case.info(0, None)
    cap = split_cap(case.T, workspace_rows(MAX_TOKENS))
    sc = shrink_config(info, case.g.in_dim, case.g.num_slices, cap, operand_bytes=(2, 2))  # bf16 x and pool
    return info.block_m, sc, expand_config(info, case.g.out_dims, sc.parts)


def sweep_candidates(case):
    """(block_m, config) lists around the heuristic's choice: block shapes and split-K (phase 1)."""
    bm, sc, _ = default_configs(case)
    g, br = case.g, max(16, triton.next_power_of_2(case.r))
    cols = g.num_slices * br
    shrink, expand = {}, {}
    for b in [bm] + ([128] if bm >= 64 else []):
        bns = {16, sc.block_n, min(64, triton.next_power_of_2(cols)), min(256, triton.next_power_of_2(cols))}
        for bn in sorted(x for x in bns if (x % br == 0 if x > br else br % x == 0)):
            for bk in (128, 256) if b <= 16 else (64, 128):
                for split in {max(1, sc.split_k // 2), sc.split_k, min(16, sc.split_k * 2)}:
                    if g.in_dim // split >= bk:
                        for w in (4, 8) if b * bn >= 64 * 256 else (4,):
                            shrink[(b, ShrinkConfig(bn, bk, split, w, 3))] = None
        for bn in (64, 128, 256, 512):
            for bk in sorted({16, min(br, 64)}):
                for w in (2, 4) if b <= 16 else (4, 8):
                    expand[(b, ExpandConfig(bn, bk, w, 2))] = None
    return list(shrink), list(expand)


def refine(results, kind: str, top: int = 1):
    """Phase 2: warps and pipeline depth around the `top` fastest phase-1 configs."""
    best = sorted((x for x in results if x["kind"] == kind and x["us"] is not None), key=lambda x: x["us"])[
        :top
    ]
    seen = {(x["block_m"], json.dumps(x["config"])) for x in results if x["kind"] == kind}
    out = []
    cls = ShrinkConfig if kind == "shrink" else ExpandConfig
    for x in best:
        for w in (2, 4, 8):
            for st in (2, 3, 4):
                cfg = cls(**{**x["config"], "num_warps": w, "num_stages": st})
                key = (x["block_m"], json.dumps(asdict(cfg)))
                if key not in seen:
                    seen.add(key)
                    out.append((x["block_m"], cfg))
    return out


def _compile_worker(tasks) -> int:
    """Compile kernels into Triton's disk cache by running each config once on 2-slot tables with the
    same strides, widths and dtypes as the timed run (so the cache keys match)."""
    device = torch.device("cuda")
    layout = llama3_8b_layout()
    mem = torch.zeros((2, NUM_LAYERS, MAX_RANK, layout.row_elems), dtype=torch.bfloat16, device=device)
    rows = layout.slot_row_table(2, device)  # same width and strides as the timed run's table
    done = 0
    for t in tasks:
        try:
            _compile_one(device, layout, mem, rows, *t)
            done += 1
        except Exception as e:  # noqa: BLE001 - a config that cannot compile is reported when timed
            print(f"compile failed {t}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.cuda.synchronize()
    return done


def _compile_one(device, layout, mem, rows, gname, r, T, n_ad, bm, kind, cfg, split) -> None:
    g = layout.group(gname)
    ranks = torch.full((2, NUM_LAYERS, 7), r, dtype=torch.int32, device=device)
    scal = torch.ones((2, NUM_LAYERS, 7), device=device)
    per = T // n_ad
    info = BatchInfoBuilder(MAX_TOKENS, device).build(
        [a * per for a in range(n_ad + 1)], [a % 2 for a in range(n_ad)], r, block_m=bm
    )
    sl = slice(g.first_slice, g.first_slice + g.num_slices)
    parts = cfg.parts if kind == "shrink" else split  # an expand task names the partials it reads
    v = torch.zeros((parts, T, g.num_slices, info.block_rank), device=device)
    base = LoraLayout.slot_rows(mem, 0)  # [P, row]
    if kind == "shrink":
        x = torch.zeros((T, g.in_dim), dtype=mem.dtype, device=device)
        lora_shrink(x, LoraLayout.a_rows(base, g), ranks[:, 0, sl], rows, info, out=v, config=cfg)
    else:
        out = torch.zeros((T, g.out_total), dtype=mem.dtype, device=device)
        b, rk, sc = LoraLayout.b_rows(base, g), ranks[:, 0, sl], scal[:, 0, sl]
        lora_expand(v, b, rk, sc, rows, out, g.out_offsets, g.out_dims, info, config=cfg)


def precompile(tasks, workers: int) -> None:
    uniq = {}
    for t in tasks:
        gname, r, _, _, bm, kind, cfg, split = t
        uniq.setdefault((gname, max(16, triton.next_power_of_2(r)), bm, kind, cfg, split), t)
    tasks = list(uniq.values())
    if workers <= 0 or not tasks or not torch.cuda.is_available():
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    chunks = [tasks[i::workers] for i in range(min(workers, len(tasks)))]
    try:
        with ProcessPoolExecutor(len(chunks), mp_context=mp.get_context("spawn")) as pool:
            n = sum(pool.map(_compile_worker, chunks))
    except Exception as e:  # noqa: BLE001 - compiling ahead is only an optimisation
        print(f"precompile failed ({type(e).__name__}: {e}); compiling on first use", flush=True)
        return
    print(f"precompiled {n} kernels in {time.time() - t0:.1f}s on {len(chunks)} processes", flush=True)


def guarded(fn, *args, **kw):
    """Run one timing; a config that fails (e.g. out of shared memory) gives (None, error text, None)."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e)[:160]}", None


def task(case, bm, kind, cfg, split):
    return (case.g.name, case.r, case.T, case.n_ad, bm, kind, cfg, split)


def verdict(kind: str, us: float, floor_us: float, T: int, launch_us: float) -> bool:
    if T == 1:
        return us <= launch_us + 2.0
    return 100 * floor_us / us >= TARGET[kind] or (floor_us < launch_us and us <= launch_us + 2.0)


def measure(case, kind, us, err, bm, cfg, launch_us):
    fl = floor_bytes(kind, case.g, case.r, case.T, case.n_ad) / HBM_BYTES_PER_S * 1e6
    if us is None:
        return dict(us=None, floor_us=fl, pct=None, err=err, block_m=bm, config=asdict(cfg), met=False)
    return dict(
        us=us,
        floor_us=fl,
        pct=100 * fl / us,
        err=err,
        block_m=bm,
        config=asdict(cfg),
        met=verdict(kind, us, fl, case.T, launch_us),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--out", default=str(Path(tempfile.gettempdir()) / "lorapipe-bench" / "bench_kernels.json")
    )
    ap.add_argument("--sweep", action="store_true", help="also time block-shape variants (tuning data)")
    ap.add_argument("--sweep-budget-s", type=float, default=240.0)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="stop sweeping this long after start")
    ap.add_argument("--workers", type=int, default=12, help="processes compiling kernels ahead")
    ap.add_argument("--groups", default="qkv,o,gate_up,down")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--no-peft", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on the CPU")
    ap.add_argument(
        "--rows",
        choices=("identity", "scattered"),
        default="identity",
        help="row table: the slots' own rows, or the same rows in a random order (paged-pool access)",
    )
    args = ap.parse_args()
    global DECODE, PREFILL
    if args.smoke:
        DECODE, PREFILL = [(1, 1), (16, 8)], [(64, 2)]
    t_start = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    layout = llama3_8b_layout(args.smoke)
    mem = torch.empty(
        (NUM_SLOTS, NUM_LAYERS, MAX_RANK, layout.row_elems), dtype=torch.bfloat16, device=device
    )
    mem.normal_(0.0, 0.02)  # [slots, layers, max_rank, row]: random, never zeros
    ranks = torch.zeros((NUM_SLOTS, NUM_LAYERS, 7), dtype=torch.int32, device=device)
    scalings = torch.full((NUM_SLOTS, NUM_LAYERS, 7), 2.0, device=device)
    row_table = layout.slot_row_table(NUM_SLOTS, device)  # [slots, max_rank] int32
    if args.rows == "scattered":  # every rank row of every adapter somewhere else in the slot memory
        perm = torch.randperm(row_table.numel(), device=device)
        row_table = row_table.flatten()[perm].view_as(row_table)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"

    noop_x = torch.zeros(1, device=device)
    launch_us = graph_us([lambda: _noop_kernel[(1,)](noop_x, 1)] * 32, device)
    copy_tbps = None
    if device.type == "cuda":
        src = torch.empty(1 << 29, dtype=torch.int16, device=device)
        dst = torch.empty_like(src)
        copy_tbps = (
            2
            * src.numel()
            * 2
            / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
            / 1e12
        )
        del src, dst
    print(f"device {dev_name}, {num_sms} SMs, launch {launch_us:.2f} us, copy {copy_tbps} TB/s", flush=True)

    groups = [layout.group(n) for n in args.groups.split(",")]
    rank_list = [int(r) for r in args.ranks.split(",")]
    specs = [(g, r, T, n) for g in groups for r in rank_list for T, n in DECODE + PREFILL]
    sweep_specs = [s for s in specs if s[0].name == "qkv" or (s[2], s[3]) in ((64, 64), (4096, 8))]

    def make_case(spec):
        g, r, T, n = spec
        ranks.fill_(r)
        return Case(mem, row_table, layout, g, r, T, n, device)

    # Compile everything the table and the first sweep phase need, in parallel processes.
    tasks, phase1 = [], {}
    for spec in specs:
        c = _Shape(*spec, device)
        bm, sc, ec = default_configs(c)
        tasks += [task(c, bm, "shrink", sc, sc.split_k), task(c, bm, "expand", ec, sc.parts)]
        if args.sweep and spec in sweep_specs:
            sh, ex = sweep_candidates(c)
            phase1[spec] = (sh, ex, sc.parts, bm)
            tasks += [task(c, b, "shrink", cfg, cfg.split_k) for b, cfg in sh]
            tasks += [task(c, b, "expand", cfg, sc.parts) for b, cfg in ex]
    precompile(tasks, args.workers)

    rows, sweep = [], []

    def save() -> None:
        meta = dict(command=" ".join(sys.argv), device=dev_name, torch=torch.__version__, num_sms=num_sms)
        meta.update(row_table=args.rows)
        meta.update(triton=triton.__version__, launch_us=launch_us, copy_tbps=copy_tbps)
        result = dict(**meta, hbm_bytes_per_s=HBM_BYTES_PER_S, rows=rows, sweep=sweep)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    for spec in specs:
        case = make_case(spec)
        bm, sc, ec = default_configs(case)
        row = dict(group=case.g.name, rank=case.r, tokens=case.T, adapters=case.n_ad, reps=case.reps)
        s_us, s_err, vs = guarded(run_shrink, case, ranks, scalings, bm, sc)
        row["shrink"] = measure(case, "shrink", s_us, s_err, bm, sc, launch_us)
        e_us, e_err = guarded(run_expand, case, ranks, scalings, bm, ec, vs)[:2] if vs else (None, "no v")
        row["expand"] = measure(case, "expand", e_us, e_err, bm, ec, launch_us)
        peft = None if args.no_peft else guarded(run_peft, case, ranks, scalings)
        row["peft_us"] = peft if isinstance(peft, float) else None
        rows.append(row)
        print(fmt_row(row), flush=True)
        del case, vs
    save()

    if args.sweep:
        t0 = time.time()
        for phase in (1, 2):
            budget = min(args.sweep_budget_s, t_start + args.deadline_s - t0)
            t_end = t0 + budget * (0.6 if phase == 1 else 1.0)
            if phase == 2:
                refined = {}
                for spec in phase1:
                    res = [x for x in sweep if x["spec"] == spec_key(spec)]
                    refined[spec] = (
                        refine(res, "shrink"),
                        refine(res, "expand"),
                        phase1[spec][2],
                        phase1[spec][3],
                    )
                phase1 = refined
                precompile(
                    [
                        task(_Shape(*sp, device), b, "shrink", cfg, cfg.split_k)
                        for sp, v in phase1.items()
                        for b, cfg in v[0]
                    ]
                    + [
                        task(_Shape(*sp, device), b, "expand", cfg, v[2])
                        for sp, v in phase1.items()
                        for b, cfg in v[1]
                    ],
                    args.workers,
                )
            for spec, (sh, ex, _split, bm0) in phase1.items():
                if time.time() > t_end:
                    print(f"sweep budget spent in phase {phase}", flush=True)
                    break
                case = make_case(spec)
                key = spec_key(spec)
                for b, cfg in sh:
                    us, err, _ = guarded(run_shrink, case, ranks, scalings, b, cfg, rep_ms=25)
                    sweep.append(dict(spec=key, kind="shrink", block_m=b, config=asdict(cfg), us=us, err=err))
                launches, vs = shrink_launches(case, ranks, scalings, bm0, default_configs(case)[1])
                for f in launches:
                    f()
                for b, cfg in ex:  # v does not depend on the token tile, only on the partials
                    us, err = guarded(run_expand, case, ranks, scalings, b, cfg, vs, rep_ms=25)[:2]
                    sweep.append(dict(spec=key, kind="expand", block_m=b, config=asdict(cfg), us=us, err=err))
                print(f"sweep phase {phase} {spec_key(spec)}: {best_line(sweep, spec_key(spec))}", flush=True)
                save()
                del case

    print(
        f"\n{dev_name}; launch cost {launch_us:.2f} us/launch (empty Triton kernel, graph replay); floor at "
        f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s; targets shrink >= 60%, expand >= 50% of floor"
    )
    print(HEADER)
    for row in rows:
        print(fmt_row(row))
    save()
    print(f"wrote {args.out}")


class _Shape:
    """A case's sizes without buffers (for planning compiles)."""

    def __init__(self, g, r, T, n_ad, device):
        self.g, self.r, self.T, self.n_ad, self.device = g, r, T, n_ad, device
        per = T // n_ad
        self.indptr = [a * per for a in range(n_ad + 1)]
        self._info = None

    def info(self, j, block_m):
        if self._info is None:
            self._info = BatchInfoBuilder(MAX_TOKENS, self.device).build(
                self.indptr, list(range(self.n_ad)), self.r
            )
        return self._info


def spec_key(spec) -> str:
    g, r, T, n = spec
    return f"{g.name}/r{r}/{T}tok/{n}ad"


def best_line(sweep, key) -> str:
    parts = []
    for kind in ("shrink", "expand"):
        xs = [x for x in sweep if x["spec"] == key and x["kind"] == kind and x["us"] is not None]
        if xs:
            b = min(xs, key=lambda x: x["us"])
            parts.append(f"{kind} {b['us']:.1f}us bm{b['block_m']} {tuple(b['config'].values())}")
    return "; ".join(parts)


HEADER = (
    f"{'group':8}{'r':>3}{'tok':>6}{'ad':>4} | {'shrink us':>9}{'floor':>7}{'%':>5} | {'expand us':>9}"
    f"{'floor':>7}{'%':>5} | {'lora us':>8}{'peft us':>9}{'x':>6} | met"
)


def _num(x, width: int, prec: int = 1) -> str:
    return f"{x:{width}.{prec}f}" if x is not None else f"{'fail':>{width}}"


def fmt_row(row) -> str:
    s, e, peft = row["shrink"], row["expand"], row["peft_us"]
    lora = s["us"] + e["us"] if s["us"] is not None and e["us"] is not None else None
    speedup = peft / lora if peft and lora else None
    met = ("S" if s["met"] else "s") + ("E" if e["met"] else "e")
    return (
        f"{row['group']:8}{row['rank']:>3}{row['tokens']:>6}{row['adapters']:>4} | {_num(s['us'], 9)}"
        f"{s['floor_us']:7.1f}{_num(s['pct'], 5, 0)} | {_num(e['us'], 9)}{e['floor_us']:7.1f}"
        f"{_num(e['pct'], 5, 0)} | {_num(lora, 8)}{_num(peft, 9)}{_num(speedup, 6)} | {met}"
    )


if __name__ == "__main__":
    main()
