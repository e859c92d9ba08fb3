"""The output side of benchmarks/vs_pytorch.py: the HBM floor of each row, the markdown table, the PNG plot, the
JSON file of a run, and `--merge` of several runs' files into one table and plot."""

from __future__ import annotations

import json
import logging
import pathlib

log = logging.getLogger("vs_pytorch")

ROWS = ("hf-static", "hf-batch", "jphoton-blocking", "jphoton-pipelined")


def matching_lead(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def kv_bytes(shape_cfg: dict, batch: int, ctx: float, itemsize: int) -> float:
    return (batch * ctx * shape_cfg["num_hidden_layers"] * 2 * shape_cfg["num_key_value_heads"]
            * shape_cfg["head_dim"] * itemsize)


def add_floor(r: dict, weight_bytes: int, shape_cfg: dict, bw: float, itemsize: int) -> None:
    """floor = (weights + KV at the mean context of the case) / read bandwidth; step / floor."""
    if r.get("ms_step"):
        ctx = r["prompt_len"] + r["new_tokens"] / 2
        r["floor_ms"] = 1e3 * (weight_bytes + kv_bytes(shape_cfg, r["batch"], ctx, itemsize)) / bw
        r["step_over_floor"] = r["ms_step"] / r["floor_ms"]


def table(results: list[dict]) -> str:
    head = ("| shape | row | case | B | ms/step | decode tok/s | tok/s (e2e) | TTFT ms | floor ms | step/floor |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    order = {r: i for i, r in enumerate(ROWS)}
    for r in sorted(results, key=lambda r: (r["shape"], r["case"].startswith("ctx"), r["batch"], order.get(r["row"], 9))):
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['shape']} | {r['row']} | {r['case']} | {r['batch']} | "
                         f"{'error: ' + r['error'][:60] if 'error' in r else 'skipped: ' + r['skipped']} "
                         "| | | | | |")
            continue

        def f(v, fmt):
            return "-" if v is None else format(v, fmt)

        lines.append(f"| {r['shape']} | {r['row']} | {r['case']} | {r['batch']} | {f(r['ms_step'], '.3f')} | "
                     f"{f(r.get('decode_tok_s'), ',.0f')} | {f(r['tok_s'], ',.0f')} | {f(r['ttft_ms'], '.1f')} | "
                     f"{f(r.get('floor_ms'), '.3f')} | {f(r.get('step_over_floor'), '.2f')} |")
    return "\n".join(lines)


def plot(path: pathlib.Path, results: list[dict]) -> bool:
    try:
        import matplotlib
    except ImportError:  # the CPU smoke run's environment; the GPU image has it
        log.warning("matplotlib is not installed: no plot written (%s)", path)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "ms_step" in r and not r["case"].startswith("ctx")]
    shapes = sorted({r["shape"] for r in ok})
    if not shapes:
        return False
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
    for j, shape in enumerate(shapes):
        for row in ROWS:
            pts = sorted((r["batch"], r["ms_step"], r["decode_tok_s"]) for r in ok if r["shape"] == shape and r["row"] == row)
            if pts:
                b, ms, tps = zip(*pts, strict=True)
                color = f"C{ROWS.index(row)}"  # one colour per row in every panel
                axes[0, j].plot(b, ms, "o-", color=color, label=row)
                axes[1, j].plot(b, tps, "o-", color=color, label=row)
        floor = sorted((r["batch"], r["floor_ms"]) for r in ok if r["shape"] == shape and r.get("floor_ms")
                       and r["row"].startswith("jphoton"))
        if floor:
            b, fl = zip(*dict(floor).items(), strict=True)
            axes[0, j].plot(b, fl, "k--", label="HBM floor")
        axes[0, j].set_title(f"{shape}: ms per decode step (lower is better)")
        axes[1, j].set_title(f"{shape}: decode tok/s = B / ms per step")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch B")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write(out: pathlib.Path, tag: str, payload: dict) -> pathlib.Path:
    from benchmarks.common import write_json

    p = out / f"vs_pytorch_{tag}.json"
    write_json(p, payload)
    return p


def merge(files: list[str], out: pathlib.Path, tag: str) -> None:
    results, meta = {}, []
    for f in files:
        d = json.loads(pathlib.Path(f).read_text())
        meta.append({k: d.get(k) for k in ("info", "args", "read_bandwidth_Bps", "agreement", "handoff")})
        for r in d.get("results", []):
            if "floor_ms" not in r and d.get("read_bandwidth_Bps"):  # a run cut off before its summary
                add_floor(r, d["weight_bytes"], d["shape_config"], d["read_bandwidth_Bps"], d.get("itemsize", 2))
            results[(r["shape"], r["row"], r["case"])] = r  # later files win
    rows = list(results.values())
    write(out, tag, {"sections": meta, "results": rows})
    print(table(rows))
    plot(out / f"vs_pytorch_{tag}.png", rows)
