"""Which threads of a process burn CPU, and where they run: samples /proc/PID/task/*/stat until the process exits.

    python3 lab/probes/thread_cpu.py PID [--interval 0.5] [--start-file F]

Prints, per thread (top 12 by CPU time): its name, CPU seconds, % of the sampled wall time, the CPUs it was seen on;
and how often a busy thread (>50% in a sample) was seen on the hyperthread sibling of the main thread's CPU. Why:
the engine's Python runs at about half its no-device speed in the live loop (docs/decisions.md, 2026-11-28); a runtime
thread spinning on the main thread's core sibling would do that."""

from __future__ import annotations

import argparse
import collections
import os
import time


def siblings() -> dict[int, set[int]]:
    out = {}
    for cpu in range(os.cpu_count() or 1):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                text = f.read().strip()
        except OSError:
            continue
        cpus = set()
        for part in text.split(","):
            a, _, b = part.partition("-")
            cpus.update(range(int(a), int(b or a) + 1))
        out[cpu] = cpus - {cpu}
    return out


def sample(pid: int) -> dict[int, tuple[str, int, int]]:
    """{tid: (name, utime + stime ticks, last CPU)}"""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        name = s[s.index("(") + 1:s.rindex(")")]
        rest = s[s.rindex(")") + 2:].split()
        out[int(tid)] = (name, int(rest[11]) + int(rest[12]), int(rest[36]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pid", type=int)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--start-file", default=None, help="start sampling once this file exists")
    args = ap.parse_args()
    while args.start_file and not os.path.exists(args.start_file) and os.path.exists(f"/proc/{args.pid}"):
        time.sleep(0.05)
    hz = os.sysconf("SC_CLK_TCK")
    sib = siblings()
    print("siblings:", {c: sorted(s) for c, s in list(sib.items())[:4]}, "...", flush=True)
    total = collections.Counter()
    names, cpus = {}, collections.defaultdict(collections.Counter)
    on_sibling = collections.Counter()
    busy_samples = collections.Counter()
    prev, t0 = sample(args.pid), time.monotonic()
    wall = 0.0
    while os.path.exists(f"/proc/{args.pid}"):
        time.sleep(args.interval)
        cur, t1 = sample(args.pid), time.monotonic()
        dt = t1 - t0
        main_cpu = cur.get(args.pid, (None, 0, -1))[2]
        main_busy = args.pid in prev and args.pid in cur and (cur[args.pid][1] - prev[args.pid][1]) / hz > 0.5 * dt
        if main_busy:
            wall += dt
        for tid, (name, ticks, cpu) in cur.items():
            if tid not in prev or not main_busy:
                continue
            d = (ticks - prev[tid][1]) / hz
            total[tid] += d
            names[tid] = name
            cpus[tid][cpu] += 1
            if d > 0.5 * dt and tid != args.pid:
                busy_samples[tid] += 1
                if cpu in sib.get(main_cpu, ()):
                    on_sibling[tid] += 1
        prev, t0 = cur, t1
    print(f"samples with the main thread busy: {wall:.1f} s")
    for tid, sec in total.most_common(12):
        print(f"{names[tid]:>24} tid {tid:>7}: {sec:7.2f} s ({100 * sec / max(wall, 1e-9):5.1f}%)"
              f"  cpus {dict(cpus[tid].most_common(4))}  busy samples {busy_samples[tid]}"
              f" on main's sibling {on_sibling[tid]}")


if __name__ == "__main__":
    main()
