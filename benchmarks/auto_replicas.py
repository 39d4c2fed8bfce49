"""Is `auto` different from a fixed setting, or within the spread between servers?

`auto_batching.py` runs one server per setting, and a setting's figure there is its
policy and its one server's luck together: on this 2-core machine two servers with
the same flags differ by 10-20% in one round. Here each setting runs on `--replicas`
servers (started one after the other, each calibrating on an otherwise idle
machine), and one load is measured for `--rounds` rounds: every server in every
round, in a rotating order (reversed in odd rounds), all servers of a round on the
same arrival schedule.

A setting is `auto` (`diffbatch serve MODEL`, no tuning flag) or `S:W`
(`--max-num-seqs S --request-batch-max-wait-ms W`, either of which may be `auto`).
The load is `--load saturated` (a closed loop of `--concurrency` clients, as
`auto_batching.py`'s saturated load) or `--load R` (Poisson arrivals at R requests/s).

Reported per setting: the median and range of throughput and p50 over all its runs
(replicas x rounds), and the median over rounds of its per-round mean over replicas
divided by the first setting's (paired, as `auto_batching.py` judges).

    .venv/bin/python benchmarks/auto_replicas.py --config tiny-sd:64 --load saturated \\
        --settings auto 16:0 --replicas 2 --rounds 6 --out /tmp/replicas.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from auto_batching import (
    AUTO,
    STARTUP_TIMEOUT_S,
    Setting,
    bench,
    parse_configs,
    rotated,
    server_specs,
)
from peers_servers import harness


def parse_setting(text: str) -> Setting:
    """"auto" or "S:W" (S a positive integer or auto, W a number of ms >= 0 or auto)
    -> the setting, named as `auto_batching.py` names its grid ("seqs16_wait0")."""
    if text == AUTO.name:
        return AUTO
    seqs, sep, wait = text.partition(":")
    valid_seqs = seqs == "auto" or (seqs.isdigit() and int(seqs) >= 1)
    try:
        valid_wait = wait == "auto" or float(wait) >= 0
    except ValueError:
        valid_wait = False
    if not sep or not valid_seqs or not valid_wait:
        raise SystemExit(f"--settings takes auto or S:W (e.g. 16:0, auto:0), got {text!r}")
    name_wait = wait if wait == "auto" else f"{float(wait):g}"
    return Setting(f"seqs{seqs}_wait{name_wait}", seqs, wait)  # type: ignore[arg-type]


def setting_label(text: str) -> str:
    """"auto" or "S:W" -> a server name stem ("auto", "seqs16_wait0", "seqsauto_wait0")."""
    return parse_setting(text).name


def specs_for(model: str, settings: list[str], replicas: int) -> list[harness.ServerSpec]:
    """Servers in the order replica 0 of every setting, replica 1 of every setting..."""
    parsed = [parse_setting(text) for text in settings]
    return server_specs(model, [Setting(f"{s.name}#{replica}", s.max_num_seqs, s.wait_ms)
                                for replica in range(replicas) for s in parsed], None)


def load_shape(args: argparse.Namespace) -> dict[str, Any]:
    if args.load == "saturated":
        return {"num_prompts": args.num_requests, "max_concurrency": args.concurrency}
    try:
        rate = float(args.load)
    except ValueError:
        raise SystemExit(f"--load takes saturated or a rate in requests/s, got "
                         f"{args.load!r}") from None
    if not rate > 0:
        raise SystemExit(f"--load rate must be > 0 requests/s, got {args.load!r}")
    return {"num_prompts": args.num_requests, "request_rate": rate}


def summarize(runs: dict[str, list[dict[str, Any]]], settings: list[str],
              replicas: int) -> dict[str, Any]:
    """Per setting: pooled medians and ranges, and the paired ratios to the first."""
    def round_means(label: str, key: str) -> list[float]:
        per_replica = [runs[f"{label}#{r}"] for r in range(replicas)]
        return [statistics.mean(rep[i][key] for rep in per_replica)
                for i in range(len(per_replica[0]))]

    first = setting_label(settings[0])
    first_means = {key: round_means(first, key) for key in ("throughput_rps", "p50_ms")}
    out = {}
    for text in settings:
        label = setting_label(text)
        pooled = [run for r in range(replicas) for run in runs[f"{label}#{r}"]]
        row: dict[str, Any] = {}
        for key in ("throughput_rps", "p50_ms", "mean_wave_size"):
            values = [run[key] for run in pooled if run[key] is not None]
            row[key] = statistics.median(values) if values else None
            row[f"{key}_range"] = [min(values), max(values)] if values else None
        for key in ("throughput_rps", "p50_ms"):
            mine = round_means(label, key)
            row[f"{key}_paired_to_{first}"] = statistics.median(
                a / b for a, b in zip(mine, first_means[key], strict=True))
            row[f"{key}_round_means"] = mine
        out[label] = row
    return out


def format_table(summary: dict[str, Any], first: str) -> str:
    lines = [f"{'setting':18s} {'req/s':>7s} {'range':>13s} {'paired':>7s} "
             f"{'p50 ms':>7s} {'range':>13s} {'paired':>7s} {'waves':>6s}"]
    for label, row in summary.items():
        thr, p50 = row["throughput_rps_range"], row["p50_ms_range"]
        lines.append(
            f"{label:18s} {row['throughput_rps']:7.2f} {thr[0]:6.1f}-{thr[1]:6.1f} "
            f"{row[f'throughput_rps_paired_to_{first}']:7.3f} {row['p50_ms']:7.1f} "
            f"{p50[0]:6.0f}-{p50[1]:6.0f} {row[f'p50_ms_paired_to_{first}']:7.3f} "
            f"{row['mean_wave_size'] or 0:6.2f}")
    lines.append(f"paired: median over rounds of the round's mean over replicas / {first}'s")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Every run's throughput and p50 by setting, one colour per replica."""
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    labels = list(report["summary"])
    for x, label in enumerate(labels):
        for replica in range(report["args"]["replicas"]):
            runs = report["runs"][f"{label}#{replica}"]
            for ax, key in zip(axes, ("throughput_rps", "p50_ms"), strict=True):
                ax.scatter([x + 0.1 * replica] * len(runs), [r[key] for r in runs], s=12,
                           color=f"C{replica}", label=f"server {replica}" if x == 0 else None)
    for ax, title in zip(axes, ("requests/s per run", "p50 (ms) per run"), strict=True):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(f"{report['args']['config']}, load {report['args']['load']}: {title}",
                     fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-sd:64", metavar="MODEL:SIZE")
    parser.add_argument("--steps", type=int, default=4, help="num_inference_steps")
    parser.add_argument("--settings", nargs="+", default=["auto", "16:0"],
                        help="auto or S:W each; the first is what the others are paired to")
    parser.add_argument("--replicas", type=int, default=2, help="servers per setting")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--load", default="saturated",
                        help="saturated, or a Poisson rate in requests/s")
    parser.add_argument("--num-requests", type=int, default=128, help="per run")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="clients of the saturated closed loop")
    parser.add_argument("--warmup-requests", type=int, default=32,
                        help="per server, closed loop, before measuring")
    parser.add_argument("--out", default="benchmarks/results/auto_replicas.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    (model, sizes), = parse_configs([args.config]).items()
    size = sizes[0]
    if len(set(args.settings)) != len(args.settings):
        raise SystemExit(f"--settings must differ, got {args.settings}")
    if args.replicas < 1 or args.rounds < 1:
        raise SystemExit("--replicas and --rounds must be >= 1")
    shape = load_shape(args)
    specs = specs_for(model, args.settings, args.replicas)
    report = harness.report_header("auto_replicas", args)
    start = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    with harness.running(specs, startup_timeout_s=STARTUP_TIMEOUT_S,
                         one_at_a_time=True) as servers:
        names = [s.name for s in specs]
        for name in names:
            bench(servers[name], size, args.steps, num_prompts=args.warmup_requests,
                  seed=999, max_concurrency=args.concurrency)
        for rep in range(args.rounds):
            for name in rotated(names, rep, reverse=rep % 2 == 1):
                result = bench(servers[name], size, args.steps, seed=1000 + rep, **shape)
                runs.setdefault(name, []).append(result)
                print(f"round {rep} {name:20s} {result['throughput_rps']:7.2f} req/s p50 "
                      f"{result['p50_ms'] or float('nan'):8.1f} ms wave "
                      f"{result['mean_wave_size'] or float('nan'):5.2f}", flush=True)
    report["runs"] = runs
    report["summary"] = summarize(runs, args.settings, args.replicas)
    print(format_table(report["summary"], setting_label(args.settings[0])))
    harness.finish_report(report, args, plot, start_s=start)


if __name__ == "__main__":
    sys.exit(main())
