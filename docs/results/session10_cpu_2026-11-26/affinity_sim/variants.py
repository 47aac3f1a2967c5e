"""Other admission orders than `admission_order`'s, over the S2 burst in sim.py's cost model (session 10,
CPU): affine requests first but one request of the rest after every k affine ones (k = 2, 4, 8), and
requests of resident adapters not in the step ranked between the affine ones and the rest. Each order
replaces `stages.scheduler.planner.admission_order` for its run; the age bound is 200 steps throughout.
    python docs/results/session10_cpu_2026-11-26/affinity_sim/variants.py   (from the repository root)"""

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim  # noqa: E402  (puts the repository on the path)

import stages.scheduler.planner as planner_mod  # noqa: E402
from stages.scheduler.admission import admission_order  # noqa: E402

AGE = 200


def _parts(waiting, step, step_adapters, n):
    old, affine, rest = [], [], []
    for r in waiting:
        if step - r.queued_step >= n:
            old.append(r)
        elif r.adapter is None or r.adapter in step_adapters:
            affine.append(r)
        else:
            rest.append(r)
    return old, affine, rest


def interleave(k: int):
    def order(waiting, step, step_adapters, n):
        old, affine, rest = _parts(waiting, step, step_adapters, n)
        out, i, j = [], 0, 0
        while i < len(affine) or j < len(rest):
            out += affine[i : i + k]
            i += k
            out += rest[j : j + 1]
            j += 1
        return old + out

    return order


def resident_next(holder: dict):
    def order(waiting, step, step_adapters, n):
        old, affine, rest = _parts(waiting, step, step_adapters, n)
        pool = holder["planner"].pool
        resident = [r for r in rest if pool.get(r.adapter) is not None]
        return old + affine + resident + [r for r in rest if pool.get(r.adapter) is None]

    return order


def main() -> None:
    holder: dict = {}
    init = planner_mod.Planner.__init__

    def keep(self, *args, **kw):
        init(self, *args, **kw)
        holder["planner"] = self

    planner_mod.Planner.__init__ = keep
    g = ["--num-prompts", "1000", "--input-len", "32:1024", "--output-len", "16:256", "--num-adapters",
         "1000", "--adapter-distribution", "zipf:1.0", "--seed", "0", "--request-rate", "inf"]  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "mix.jsonl"
        cmd = [sys.executable, "-m", "tools.workload", "--out", str(path), *g]
        subprocess.run(cmd, check=True, capture_output=True)
        orders = {"admission_order": admission_order, "resident next": resident_next(holder)}
        orders.update({f"interleave k={k}": interleave(k) for k in (2, 4, 8)})
        for name, order in orders.items():
            planner_mod.admission_order = order
            print(f"{name:<16}: {sim.run(path, AGE)}", flush=True)


if __name__ == "__main__":
    main()
