#!/usr/bin/env python3
"""Plots of a benchmark comparison: reads RESULTS/summary.json (written by the
`compare` binary) and writes its PNGs next to it.

    scripts/plots.py results

- throughput.png     requests/s per strategy (saturation and the small-stock sale),
                     with the no-op (HTTP) and broker ceilings as lines
- latency_cdf.png    latency CDF per strategy, at saturation and at half of it,
                     with a tail view (nines) below each
- side_query.png     the other business's query, p50 and p99, idle and during
                     each strategy's runs
- sale_timeline.png  answers per second during the small-stock sale, with the
                     moment each strategy sold out
- failover.png       answers per 100 ms by status (202, 409, 503) through the loss
                     of a Redis Cluster primary, with the kill, the promotion and the
                     dead node's return marked (when the failover section ran)
- mega_answers.png   (scripts/bench.sh mega) answers per second by code through
                     each mega-sale, with the start, the sell-out and the moment
                     the last user knew their outcome marked
- mega_memory.png    (scripts/bench.sh mega) the service's resident memory and
                     Redis's memory over time, one line a sale
- day.png            (scripts/bench.sh day, from RESULTS/day.json) over the day:
                     the sales' windows with their faults, Redis's memory and
                     keys, each process's resident memory, MySQL statements and
                     Redis commands a request, and the consumer group's lag

scripts/bench.sh runs it from a virtualenv with matplotlib; it needs nothing else.
"""

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "noop": "#7f7f7f",
    "mysql": "#d62728",
    "redis-decr": "#ff7f0e",
    "redis-lock": "#9467bd",
    "service": "#2ca02c",
}


def color(name):
    return COLORS.get(name, "#1f77b4")


def phase(strategy, key):
    return strategy.get(key) or None


def throughput(summary, out):
    strategies = summary["strategies"]
    names = [s["name"] for s in strategies]
    sat = [(phase(s, "saturation") or {}).get("load", {}).get("throughput_rps", 0) for s in strategies]
    small = [(phase(s, "small") or {}).get("load", {}).get("throughput_rps", 0) for s in strategies]
    fig, ax = plt.subplots(figsize=(10, 5.2))
    y = range(len(names))
    h = 0.38
    bars = ax.barh([i - h / 2 for i in y], sat, height=h,
                   color=[color(n) for n in names], label="saturation (stock ≥ users)")
    ax.barh([i + h / 2 for i in y], small, height=h, color=[color(n) for n in names],
            alpha=0.45, hatch="//", label="small-stock sale (mostly sold out)")
    noop = next((v for n, v in zip(names, sat) if n == "noop"), None)
    for bar, value in zip(bars, sat):
        label = f"{value:,.0f}"
        if noop:
            label += f"  ({value / noop:.2f}× no-op)"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, "  " + label,
                va="center", fontsize=9)
    if noop:
        ax.axvline(noop, color=color("noop"), linestyle="--", linewidth=1)
        ax.text(noop, 0.5, " HTTP ceiling (no-op) ", fontsize=8, color=color("noop"), rotation=90,
                ha="right", va="center", transform=ax.get_xaxis_transform())
    conc = summary["options"]["concurrency"]
    broker = next((b for b in summary.get("broker_ceiling", []) if b["in_flight"] == conc), None)
    if broker:
        ax.axvline(broker["rps"], color="#1f77b4", linestyle=":", linewidth=1.2)
        ax.text(broker["rps"], 0.5, f" broker ceiling, {conc} in flight: {broker['rps']:,.0f}/s ",
                fontsize=8, color="#1f77b4", rotation=90, ha="right", va="center",
                transform=ax.get_xaxis_transform())
    redis = [c for c in summary.get("redis_ceiling", []) if c["pipeline"] == 1]
    title = f"Reserve throughput at {conc} connections"
    if redis:
        title += f"  (Redis EVALSHA ceiling: {redis[0]['rps']:,.0f}/s, off the scale)"
    ax.set_title(title, fontsize=11)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel("requests per second")
    ax.set_xlim(0, max(sat + small + [noop or 0]) * 1.35)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)


def cdf_axes(ax_cdf, ax_tail, summary, key, title):
    for s in summary["strategies"]:
        p = phase(s, key)
        if not p or not p["load"]["cdf"]:
            continue
        pts = [(ms, q) for ms, q in p["load"]["cdf"] if ms > 0]
        xs = [ms for ms, _ in pts]
        ys = [q for _, q in pts]
        label = f"{s['name']} (p99 {p['load']['latency']['p99_ms']:.2f} ms)"
        ax_cdf.plot(xs, ys, color=color(s["name"]), label=label, linewidth=1.6)
        tail = [(ms, -math.log10(1 - q)) for ms, q in pts if q < 1]
        ax_tail.plot([t[0] for t in tail], [t[1] for t in tail], color=color(s["name"]), linewidth=1.6)
    ax_cdf.set_xscale("log")
    ax_cdf.set_title(title, fontsize=10)
    ax_cdf.set_ylabel("fraction of requests ≤ x")
    ax_cdf.grid(alpha=0.3, which="both")
    ax_cdf.legend(fontsize=7, loc="lower right")
    ax_tail.set_xscale("log")
    ax_tail.set_xlabel("latency (ms, log scale)")
    ax_tail.set_yticks([0, 1, 2, 3, 4], ["0", "90%", "99%", "99.9%", "99.99%"])
    ax_tail.set_ylabel("percentile (tail view)")
    ax_tail.grid(alpha=0.3, which="both")
    ax_tail.axvline(5, color="black", linestyle=":", linewidth=0.8)


def latency_cdf(summary, out):
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="col")
    conc = summary["options"]["concurrency"]
    cdf_axes(axes[0][0], axes[1][0], summary, "saturation", f"Saturation: {conc} connections, closed loop")
    cdf_axes(axes[0][1], axes[1][1], summary, "half_rate", "Half of each strategy's saturation rate, open loop")
    fig.suptitle("Latency of POST /flash/{sku}/reserve (dotted line: 5 ms)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)
    plt.close(fig)


def side_query(summary, out):
    idle = summary["side_idle"]["latency"]
    labels = ["idle"]
    p50 = [idle["p50_ms"]]
    p99 = [idle["p99_ms"]]
    colors = ["#bbbbbb"]
    for s in summary["strategies"]:
        for key, what in (("saturation", "sat."), ("small", "sale")):
            p = phase(s, key)
            if p and p["side"]["queries"]:
                labels.append(f"{s['name']}\n{what}")
                p50.append(p["side"]["latency"]["p50_ms"])
                p99.append(p["side"]["latency"]["p99_ms"])
                colors.append(color(s["name"]))
    fig, ax = plt.subplots(figsize=(12, 5))
    x = range(len(labels))
    w = 0.4
    ax.bar([i - w / 2 for i in x], p50, width=w, color=colors, alpha=0.55, label="p50")
    bars = ax.bar([i + w / 2 for i in x], p99, width=w, color=colors, label="p99", edgecolor="black", linewidth=0.6)
    for bar, v in zip(bars, p99):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(idle["p99_ms"] * 1.5, color="black", linestyle="--", linewidth=0.8)
    ax.text(len(labels) - 0.5, idle["p99_ms"] * 1.5, "1.5 × idle p99", ha="right", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title(
        f"The other business: point SELECT on another database of the same MariaDB, "
        f"{summary['options']['side_rate']:.0f}/s (light: p50, dark: p99)",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "side_query.png", dpi=110)
    plt.close(fig)


def sale_timeline(summary, out):
    fig, ax = plt.subplots(figsize=(11, 5))
    any_line = False
    for s in summary["strategies"]:
        p = phase(s, "small")
        if not p:
            continue
        tl = p["load"]["timeline"]
        ts, rates = [], []
        for a, b in zip(tl, tl[1:]):
            dt = b["t_s"] - a["t_s"]
            if dt > 0:
                ts.append(b["t_s"])
                rates.append((b["answered"] - a["answered"]) / dt)
        if not ts:
            continue
        any_line = True
        ax.plot(ts, rates, color=color(s["name"]), label=s["name"], linewidth=1.4)
        sold = p["load"]["sale"].get("last_accept_after_s")
        if sold is not None:
            ax.axvline(sold, color=color(s["name"]), linestyle=":", linewidth=1)
    o = summary["options"]
    ax.set_title(
        f"The flash sale: {o['small_stock']} units, {o['small_users']:,} users × {o['small_clicks']} clicks "
        f"(dotted: last 202, the sale sold out)",
        fontsize=10,
    )
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("answers per second")
    ax.grid(alpha=0.3)
    if any_line:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sale_timeline.png", dpi=110)
    plt.close(fig)


STATUS_COLORS = {"202": "#2ca02c", "409": "#ff7f0e", "503": "#d62728", "lost": "#7f7f7f"}


def failover(summary, out):
    """Answers per 100 ms by status through a Cluster primary's loss, with the
    kill, the promotion and the dead node's return marked."""
    f = summary.get("failover")
    if not f or not f["timeline"]:
        return False
    step = f["bucket_ms"] / 1000.0
    ts = [b["t_s"] for b in f["timeline"]]
    seen = {c for b in f["timeline"] for c in b["codes"]}
    # 202, 409 and 503 always (a flat zero says something too), then the rest.
    statuses = ["202", "409", "503"] + sorted(seen - {"202", "409", "503"})
    def label(status):
        if status == "lost":
            return "no answer (connection lost or timed out)"
        codes = [k.split(" ", 1)[1] for k in f["answers"] if k.startswith(status + " ")]
        return f"{status} ({', '.join(codes)})" if codes else status

    fig, ax = plt.subplots(figsize=(12, 5.5))
    highest = 1
    for code in statuses:
        ys = [b["codes"].get(code, 0) for b in f["timeline"]]
        highest = max(highest, *ys)
        # Each slice drawn over its 100 ms, ending with the last one.
        ax.step(ts + [ts[-1] + step], ys + ys[-1:], where="post", linewidth=1.5,
                color=STATUS_COLORS.get(code, "#8c564b"), label=label(code))
    # Headroom above the answers for the marks' names.
    top = highest * 1.35
    gap = f.get("gap_from_kill_ms")
    if gap is not None:
        ax.axvspan(0, gap / 1000.0, color="#d62728", alpha=0.08, linewidth=0)
    marks = [
        (0.0, "primary killed", "#d62728"),
        (f["promoted_after_s"], "replica promoted", "#1f77b4"),
        (f["returned_after_s"], "dead node back on its old address", "#9467bd"),
    ]
    for i, (x, name, c) in enumerate(marks):
        ax.axvline(x, color=c, linestyle="--", linewidth=1)
        ax.text(x, top * (0.97 - 0.06 * i), f" {name}, {x:+.2f} s", va="top", ha="left",
                fontsize=8, color=c)

    def secs(ms):
        return "never" if ms is None else (f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms")

    ax.set_title(
        f"A Cluster primary killed under a sale at {f['rate']:,.0f} req/s (users clicking twice): "
        f"time without service {secs(gap)} from the kill (shaded), "
        f"{secs(f.get('gap_from_promotion_ms'))} from the promotion, "
        f"later gap {secs(f.get('later_gap_ms'))}",
        fontsize=9,
    )
    ax.set_xlabel("seconds from the kill (answers by the moment they arrived)")
    ax.set_ylabel(f"answers per {f['bucket_ms']} ms")
    ax.set_xlim(ts[0], ts[-1] + step)
    ax.set_ylim(0, top)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(out / "failover.png", dpi=110)
    plt.close(fig)
    return True


CLASS_COLORS = {
    "202": "#2ca02c", "200/201": "#1f77b4", "409 sold_out": "#ff7f0e",
    "409 already_reserved": "#bcbd22", "403": "#9467bd", "429": "#8c564b",
    "5xx": "#d62728", "lost": "#7f7f7f", "other": "#e377c2",
}


def mega_title(v):
    return f"{v['admission']}, stock_shards {v['stock_shards']}"


def mega_answers(summary, out):
    """Answers per second by code through each mega-sale, one panel a sale."""
    m = summary.get("mega")
    if not m or not m["variants"]:
        return False
    classes = m["classes"]
    n = len(m["variants"])
    fig, axes = plt.subplots(n, 1, figsize=(12, 3.2 * n), squeeze=False)
    for ax, v in zip(axes[:, 0], m["variants"]):
        samples = v["crowd"]["samples"]
        ts = [s["t_s"] for s in samples]
        for i, name in enumerate(classes):
            ys = [0.0]
            for a, b in zip(samples, samples[1:]):
                dt = max(b["t_s"] - a["t_s"], 1e-9)
                ys.append((b["answers"][i] - a["answers"][i]) / dt)
            if max(ys) > 0:
                ax.plot(ts, ys, linewidth=1.2, color=CLASS_COLORS.get(name, "#17becf"), label=name)
        crowd = v["crowd"]
        marks = [(crowd.get("joins_ended_s"), "joins done", "#1f77b4"),
                 (crowd.get("starts_s"), "start", "#000000"),
                 (crowd.get("last_accept_s"), "sold out (last 202)", "#2ca02c"),
                 (crowd.get("last_known_s"), "last user knew", "#9467bd")]
        for x, label, c in marks:
            if x is not None:
                ax.axvline(x, color=c, linestyle="--", linewidth=0.8)
                ax.text(x, 0.98, f" {label}", transform=ax.get_xaxis_transform(), fontsize=7,
                        color=c, va="top")
        ax.set_title(f"{mega_title(v)}: answers per second by code", fontsize=9)
        ax.set_ylabel("answers / s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds from the crowd's start")
    fig.suptitle(f"Mega-sale: {m['users']:,} users, {m['units']:,} units", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "mega_answers.png", dpi=110)
    plt.close(fig)
    return True


def mega_memory(summary, out):
    """The service's resident memory and Redis's memory through each mega-sale."""
    m = summary.get("mega")
    if not m or not m["variants"]:
        return False
    fig, (rss, red) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    for v in m["variants"]:
        samples = v["crowd"]["samples"]
        ts = [s["t_s"] for s in samples]
        rss.plot(ts, [(s.get("server_rss_kib") or 0) / 1024 for s in samples], label=mega_title(v))
        red.plot(ts, [(s.get("redis_used_memory") or 0) / 1048576 for s in samples],
                 label=mega_title(v))
    rss.set_ylabel("service RSS (MiB)")
    red.set_ylabel("Redis used_memory (MiB)")
    red.set_xlabel("seconds from the crowd's start")
    for ax in (rss, red):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    rss.set_title("Mega-sale: memory over time (Redis's figure is the whole server's)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "mega_memory.png", dpi=110)
    plt.close(fig)
    return True


def day_plot(day, out):
    points = day["points"]
    if not points:
        return False
    t = [p["t_s"] / 60 for p in points]
    fig, axes = plt.subplots(5, 1, figsize=(11, 14), sharex=True)
    ax = axes[0]
    for s in day["sales"]:
        p = s["plan"]
        y = p["index"]
        color = "#1f77b4" if not p["waiting_room"] else "#9467bd"
        ax.barh(y, p["open_s"] / 60, left=p["starts_at_s"] / 60, color=color,
                alpha=0.35 if p["stock_shards"] == 1 else 0.7)
        if s["invariants"] != {"Ok": None} and "Err" in s["invariants"]:
            ax.text(p["ends_at_s"] / 60 if "ends_at_s" in p else (p["starts_at_s"] + p["open_s"]) / 60,
                    y, " broken", color="red", va="center", fontsize=7)
    for d in day["done"]:
        if d["what"] in ("keys lost", "primary killed", "broker restarted"):
            for a in axes:
                a.axvline(d["at_s"] / 60, color="red", lw=0.8, ls="--")
            axes[0].text(d["at_s"] / 60, d["sale"], " " + d["what"], color="red",
                         fontsize=7, va="bottom")
        elif d["what"].startswith("top-up") or d["what"] == "paused":
            axes[0].plot([d["at_s"] / 60], [d["sale"]], marker="|", color="black")
    ax.set_ylabel("sale")
    ax.set_title("Sales (blue: open, purple: waiting room; darker: 3 shards), faults dashed")
    ax.invert_yaxis()
    ax = axes[1]
    ax.plot(t, [p["redis_bytes"] / 1048576 for p in points], label="used memory (MiB)")
    ax.set_ylabel("Redis MiB")
    ax2 = ax.twinx()
    ax2.plot(t, [p["redis_keys"] for p in points], color="#ff7f0e", label="keys")
    ax2.set_ylabel("keys")
    ax.set_title("Redis, summed over the primaries")
    ax = axes[2]
    names = [n for n, _ in points[0]["rss_bytes"]]
    for k, name in enumerate(names):
        ax.plot(t, [p["rss_bytes"][k][1] / 1048576 if k < len(p["rss_bytes"]) else 0
                    for p in points], label=name)
    ax.set_ylabel("RSS MiB")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Resident memory of each process")
    ax = axes[3]
    def commands(a, b):
        before = dict((port, n) for port, n in a["redis_commands"])
        # A node whose counter went back was restarted: it counts from 0.
        return sum(n - before[port] if port in before and n >= before[port] else n
                   for port, n in b["redis_commands"])

    xs, qs, rxs, rs = [], [], [], []
    for a, b in zip(points, points[1:]):
        req = b["requests"] - a["requests"]
        if req < 100:  # a quiet look says more about the background
            continue
        rxs.append(b["t_s"] / 60)
        rs.append(commands(a, b) / req)
        if a["mysql_questions"] is None or b["mysql_questions"] is None:
            continue
        stmts = (b["mysql_questions"] - a["mysql_questions"]
                 - (b["own_statements"] - a["own_statements"])
                 - (b["side_queries"] - a["side_queries"]))
        xs.append(b["t_s"] / 60)
        qs.append(max(stmts, 0) / req)
    ax.plot(xs, qs, label="MySQL statements / request")
    ax.set_ylabel("MySQL / request")
    ax2 = ax.twinx()
    ax2.plot(rxs, rs, color="#2ca02c", label="Redis commands / request")
    ax2.set_ylabel("Redis / request")
    ax.set_title("Per request, looks with 100 requests or more (MySQL: the side query's and the watch's own taken off)")
    ax = axes[4]
    ax.plot(t, [p["consumer_lag"] if p["consumer_lag"] is not None else float("nan")
                for p in points])
    ax.set_ylabel("messages")
    ax.set_title("Consumer group lag")
    ax.set_xlabel("minutes from the day's start")
    fig.tight_layout()
    fig.savefig(out / "day.png", dpi=110)
    plt.close(fig)
    return True


def main():
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
    if (results / "day.json").exists() and not (results / "summary.json").exists():
        day = json.loads((results / "day.json").read_text())
        if day_plot(day, results):
            print(f"plots: {results / 'day.png'}")
        return
    summary = json.loads((results / "summary.json").read_text())
    if summary.get("mega"):
        # The mega-sale runs alone: its own plots only.
        names = []
        if mega_answers(summary, results):
            names.append('mega_answers.png')
        if mega_memory(summary, results):
            names.append('mega_memory.png')
        print(f"plots: {', '.join(str(results / n) for n in names)}")
        return
    throughput(summary, results)
    latency_cdf(summary, results)
    side_query(summary, results)
    sale_timeline(summary, results)
    names = ['throughput.png', 'latency_cdf.png', 'side_query.png', 'sale_timeline.png']
    if failover(summary, results):
        names.append('failover.png')
    print(f"plots: {', '.join(str(results / n) for n in names)}")


if __name__ == "__main__":
    main()
