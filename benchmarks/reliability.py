"""The fault campaign: does `diffbatch serve` keep its promises when things go wrong?

Starts `diffbatch serve tiny-sd` on a free port (fixed batching settings, a bounded
queue, `--worker-stall-timeout` and `--shutdown-timeout`), then runs, in order:

1. burst: `--burst` requests (1,000) at once against `--max-queue-size` (64). Every
   request gets exactly one answer (200, or 503 with `Retry-After` in the OpenAI
   shape), and /metrics adds up: completed + rejected = sent, each matching the
   answers seen;
2. disconnects: `--disconnects` requests (100) of longer waves whose clients give up
   after a random 0.05-1 s. Afterwards no request is left waiting or running in the
   gauges, the worker holds no shared-memory segment, and RSS (server + worker) grew
   by less than 64 MiB;
3. worker kills: `--kills` times (3), under a closed loop of clients, SIGKILL the
   worker while a wave runs (once the last crash's re-runs are done); only the
   crashed wave may be affected (it is re-run, so in fact no request should fail);
   recovery = kill -> /health 200 again;
4. worker freeze: SIGSTOP the worker mid-wave; detected = /health turns 503 (time to
   detect), then it is killed and replaced, its wave re-run (time to recover);
5. soak: a closed loop for `--soak-s` seconds (300): RSS (server + worker) sampled
   every second, its slope over the second half (MiB/min), and errors (must be 0;
   the slope is judged, < 8 MiB/min, only for soaks of 2 minutes or more);
6. adapters: hostile LoRA loads (`reliability_adapters.py`): a NUL in `lora_path`
   (a 400 on a connection that stays usable), eight kinds of bad adapter file (each
   refused at load with its reason, no server folder in any error), reload after
   overwrite (the new weights are served), bad stack fields (each its own `param`);
7. SIGTERM with waves in flight (and more queued): the server exits
   within `--shutdown-timeout` plus the worker's stop grace and a margin (5 s), and
   every client gets an answer: 200, or 503 in OpenAI JSON.

The campaign runs once per mode of `--modes` (request mode, then step mode,
`--step-execution`), each on a server of its own, with the same scenarios and checks;
in step mode a crash's re-runs are counted by `diffbatch_worker_batch_reruns_total`
(a crashed running batch is re-run in halves) instead of the waves re-run.
`--only` runs some scenarios; `--kill-when-running N` makes each kill wait for N
requests running (8 with `--max-num-seqs 8`: a kill under a full batch).

Prints one table (and writes the JSON report). `--quick` shrinks everything to run
in under two minutes on a small machine: 300-request burst, 40 disconnects, 15 s soak.

    .venv/bin/python benchmarks/reliability.py --quick
    .venv/bin/python benchmarks/reliability.py --out benchmarks/results/reliability.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from peers_servers import harness
from reliability_adapters import adapters

ROUTE = "/v1/images/generations"
SHM = Path("/dev/shm")
RSS_GROWTH_BAR_MIB = 64.0  # disconnects: RSS (server + worker) may grow less than this
SOAK_SLOPE_BAR_MIB_PER_MIN = 8.0  # soak: judged only for soaks of SOAK_JUDGED_S or more
SOAK_JUDGED_S = 120.0
SIGTERM_MARGIN_S = 5.0  # on top of --shutdown-timeout and the engine's 2 s stop grace
DEADLINE_S = 120.0  # bounds any one wait on the server (a replacement worker, an answer)


# -- the server and its processes -------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (the server's worker, fork server and theirs)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = parents.get(todo.pop(), [])
        found += below
        todo += below
    return found


def worker_pid(server_pid: int) -> int | None:
    """The server's live worker process, if any (forked by its fork server, or its
    `python -m diffbatch.worker` child)."""
    for pid in descendants(server_pid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if b"diffbatch.worker" in cmdline and b"forkserver" not in cmdline \
                    and state not in ("Z", "X"):
                return pid
    return None


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024.0


def segments_of(pid: int | None) -> list[str]:
    if pid is None:
        return []
    return [p.name for p in SHM.iterdir() if p.name.startswith(f"diffbatch_{pid}_")]


def metrics(client: httpx.Client, url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by its name and labels as printed."""
    samples: dict[str, float] = {}
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def outcome(samples: dict[str, float], name: str) -> float:
    return samples.get(f'diffbatch_requests_total{{outcome="{name}"}}', 0.0)


def wait_until(predicate: Any, what: str, timeout_s: float = DEADLINE_S,
               poll_s: float = 0.05) -> float:
    """Poll `predicate` until it holds; return the seconds it took (RuntimeError after
    `timeout_s`). Polling another process' state: there is nothing to wait on."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - start


def status_of(client: httpx.Client, url: str, path: str = "/health") -> int:
    try:
        return client.get(f"{url}{path}", timeout=5).status_code
    except httpx.HTTPError:
        return 0


# -- load -------------------------------------------------------------------------------
def payload(i: int, steps: int) -> dict[str, Any]:
    return {"prompt": f"a red circle, take {i}", "size": "64x64", "seed": i,
            "num_inference_steps": steps}


def is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any],
              timeout: float | None = DEADLINE_S) -> httpx.Response | Exception:
    try:
        return await client.post(f"{url}{ROUTE}", json=body, timeout=timeout)
    except Exception as exc:  # recorded: a request without an answer
        return exc


async def closed_loop(url: str, clients: int, steps: int, stop: asyncio.Event,
                      results: list[httpx.Response | Exception]) -> None:
    """`clients` clients, each sending its next request when the last one is answered."""
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        async def loop() -> None:
            while not stop.is_set():
                results.append(await one(client, url, payload(next(counter), steps)))

        await asyncio.gather(*(loop() for _ in range(clients)))


def error_messages(results: list[httpx.Response | Exception]) -> dict[str, int]:
    """How often each error message came back (the first 100 characters)."""
    counts: dict[str, int] = {}
    for r in results:
        if isinstance(r, httpx.Response) and r.status_code != 200:
            text = r.json()["error"]["message"] if is_openai_error(r) else r.text
        elif isinstance(r, Exception):
            text = f"{type(r).__name__}: {r}"
        else:
            continue
        counts[text[:100]] = counts.get(text[:100], 0) + 1
    return counts


def summarize_answers(results: list[httpx.Response | Exception]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        key = str(r.status_code) if isinstance(r, httpx.Response) else type(r).__name__
        counts[key] = counts.get(key, 0) + 1
    return counts


# -- scenarios ----------------------------------------------------------------------------
def burst(url: str, args: argparse.Namespace, client: httpx.Client) -> dict[str, Any]:
    before = metrics(client, url)

    async def run() -> list[httpx.Response | Exception]:
        limits = httpx.Limits(max_connections=args.burst)
        async with httpx.AsyncClient(limits=limits, trust_env=False) as http:
            return await asyncio.gather(*(one(http, url, payload(i, args.steps))
                                          for i in range(args.burst)))

    start = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - start
    wait_until(lambda: metrics(client, url)["diffbatch_num_requests_running"] == 0,
               "the burst to drain")
    after = metrics(client, url)
    ok = sum(isinstance(r, httpx.Response) and r.status_code == 200 for r in results)
    refused = [r for r in results if isinstance(r, httpx.Response) and r.status_code == 503]
    completed = outcome(after, "completed") - outcome(before, "completed")
    rejected = outcome(after, "rejected") - outcome(before, "rejected")
    answered = sum(isinstance(r, httpx.Response) for r in results)
    checks = {
        "every request answered once": answered == args.burst,
        "only 200 and 503": ok + len(refused) == args.burst,
        "503s carry Retry-After, OpenAI JSON": all(
            r.headers.get("retry-after") and is_openai_error(r) for r in refused),
        "metrics add up": completed == ok and rejected == len(refused)
        and completed + rejected == args.burst,
    }
    return {"scenario": "burst", "requests": args.burst, "answers": summarize_answers(results),
            "figure": f"{ok} done, {len(refused)} refused in {elapsed:.1f} s",
            "checks": checks}


def disconnects(url: str, args: argparse.Namespace, client: httpx.Client,
                server_pid: int) -> dict[str, Any]:
    rng = random.Random(7)
    pids = [server_pid, *descendants(server_pid)]
    rss_before = rss_mib(pids)
    before = metrics(client, url)

    async def run() -> list[httpx.Response | Exception]:
        async with httpx.AsyncClient(trust_env=False) as http:
            async def leaver(i: int) -> httpx.Response | Exception:
                await asyncio.sleep(rng.uniform(0, 1.0))  # spread the arrivals
                return await one(http, url, payload(i, args.long_steps),
                                 timeout=rng.uniform(0.05, 1.0))

            return await asyncio.gather(*(leaver(i) for i in range(args.disconnects)))

    results = asyncio.run(run())

    def settled() -> bool:
        m = metrics(client, url)
        return m["diffbatch_num_requests_waiting"] == 0 and \
            m["diffbatch_num_requests_running"] == 0

    settle_s = wait_until(settled, "the gauges to return to 0")
    after = metrics(client, url)
    worker = worker_pid(server_pid)
    left = segments_of(worker)
    rss_growth = rss_mib([server_pid, *descendants(server_pid)]) - rss_before
    gone = sum(not isinstance(r, httpx.Response) for r in results)
    cancelled = (after.get("diffbatch_waves_cancelled_total", 0.0)
                 - before.get("diffbatch_waves_cancelled_total", 0.0))
    checks = {
        "gauges back to 0": True,  # settled() above, or it raised
        "no shm segment left": not left,
        f"RSS grew < {RSS_GROWTH_BAR_MIB:g} MiB": rss_growth < RSS_GROWTH_BAR_MIB,
    }
    return {"scenario": "disconnects", "requests": args.disconnects,
            "answers": summarize_answers(results),
            "aborted": outcome(after, "aborted") - outcome(before, "aborted"),
            "waves_cancelled": cancelled, "rss_growth_mib": rss_growth, "settle_s": settle_s,
            "figure": f"{gone} clients left, {cancelled:.0f} waves stopped early, "
                      f"RSS {rss_growth:+.1f} MiB",
            "checks": checks}


def under_load(url: str, args: argparse.Namespace, fault: Any) -> tuple[Any, list[Any]]:
    """Run `fault()` in a thread while a closed loop of clients runs; its result and
    the loop's answers."""
    results: list[httpx.Response | Exception] = []

    async def run() -> Any:
        stop = asyncio.Event()
        load = asyncio.create_task(closed_loop(url, args.clients, args.steps, stop, results))
        try:
            return await asyncio.to_thread(fault)
        finally:
            stop.set()
            await load

    return asyncio.run(run()), results


def wait_for_a_running_wave(client: httpx.Client, url: str, running: int = 1) -> None:
    wait_until(lambda: metrics(client, url)["diffbatch_num_requests_running"] >= running,
               "a wave to run", poll_s=0.005)


def kills(url: str, args: argparse.Namespace, client: httpx.Client,
          server_pid: int) -> dict[str, Any]:
    before = metrics(client, url)

    def fault() -> list[float]:
        recoveries = []
        for _ in range(args.kills):
            wait_until(lambda: status_of(client, url) == 200, "a healthy server")
            # Let the last crash's re-runs finish first: a kill that lands on a re-run
            # wave of one request fails that request, by design (it "crashed twice").
            done = outcome(metrics(client, url), "completed")
            wait_until(lambda done=done: outcome(metrics(client, url), "completed")
                       >= done + 2 * args.clients, "waves after the recovery")
            killed = worker_pid(server_pid)
            wait_for_a_running_wave(client, url, args.kill_when_running)
            os.kill(killed, signal.SIGKILL)
            start = time.monotonic()
            wait_until(lambda old=killed: worker_pid(server_pid) not in (None, old)
                       and status_of(client, url) == 200, "the replacement worker")
            recoveries.append(time.monotonic() - start)
        return recoveries

    recoveries, results = under_load(url, args, fault)
    after = metrics(client, url)
    failed = [r for r in results if not isinstance(r, httpx.Response) or r.status_code != 200]
    counter = ("diffbatch_worker_batch_reruns_total" if args.mode == "step"
               else "diffbatch_waves_rerun_total")
    reruns = after.get(counter, 0.0) - before.get(counter, 0.0)
    checks = {
        "only crashed waves affected (none failed)": not failed,
        "every crash re-run": reruns >= args.kills,
    }
    return {"scenario": "worker kills", "requests": len(results),
            "answers": summarize_answers(results), "recovery_s": recoveries,
            "figure": f"{args.kills} kills, recovery mean {statistics.mean(recoveries):.1f} s "
                      f"(max {max(recoveries):.1f} s), {len(failed)} failed",
            "checks": checks}


def freeze(url: str, args: argparse.Namespace, client: httpx.Client,
           server_pid: int) -> dict[str, Any]:
    def fault() -> tuple[float, float, bool]:
        wait_until(lambda: status_of(client, url) == 200, "a healthy server")
        pid = worker_pid(server_pid)
        wait_for_a_running_wave(client, url)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            detect = wait_until(lambda: status_of(client, url) == 503, "the freeze to show")
            frozen = metrics(client, url).get("diffbatch_worker_frozen_total", 0.0) >= 1
            wait_until(lambda: worker_pid(server_pid) not in (None, pid)
                       and status_of(client, url) == 200, "the replacement worker")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return detect, time.monotonic() - start, frozen

    (detect, recover, counted), results = under_load(url, args, fault)
    failed = [r for r in results if not isinstance(r, httpx.Response) or r.status_code != 200]
    checks = {
        "detected within stall timeout + 2 s": detect <= args.stall_timeout + 2.0,
        "counted in /metrics": counted,
        "its wave re-run (none failed)": not failed,
    }
    return {"scenario": "worker freeze", "requests": len(results),
            "answers": summarize_answers(results), "detect_s": detect, "recover_s": recover,
            "figure": f"detected in {detect:.1f} s (stall timeout {args.stall_timeout:g} s), "
                      f"replaced in {recover:.1f} s",
            "checks": checks}


def soak(url: str, args: argparse.Namespace, client: httpx.Client,
         server_pid: int) -> dict[str, Any]:
    samples: list[tuple[float, float]] = []

    def sample() -> None:
        start = time.monotonic()
        while (now := time.monotonic() - start) < args.soak_s:
            samples.append((now, rss_mib([server_pid, *descendants(server_pid)])))
            time.sleep(1.0)

    _, results = under_load(url, args, sample)
    errors = [r for r in results if not isinstance(r, httpx.Response) or r.status_code != 200]
    half = [s for s in samples if s[0] >= args.soak_s / 2] or samples
    slope = 0.0
    if len(half) >= 2:
        xs, ys = [t / 60.0 for t, _ in half], [m for _, m in half]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0
    judged = args.soak_s >= SOAK_JUDGED_S
    checks = {"no errors": not errors}
    if judged:
        checks[f"RSS slope < {SOAK_SLOPE_BAR_MIB_PER_MIN:g} MiB/min"] = \
            slope < SOAK_SLOPE_BAR_MIB_PER_MIN
    return {"scenario": "soak", "requests": len(results), "answers": summarize_answers(results),
            "rss_mib": samples, "rss_slope_mib_per_min": slope,
            "figure": f"{args.soak_s:g} s, {len(results) / args.soak_s:.1f} req/s, RSS "
                      f"{samples[-1][1] if samples else 0:.0f} MiB, slope {slope:+.2f} MiB/min"
                      + ("" if judged else " (not judged: short soak)"),
            "checks": checks}


def sigterm(url: str, args: argparse.Namespace, client: httpx.Client,
            server: harness.Server) -> dict[str, Any]:
    server_pid = server.process.pid
    worker = worker_pid(server_pid)
    results: list[httpx.Response | Exception] = []

    async def run() -> float:
        async with httpx.AsyncClient(trust_env=False) as http:
            tasks = [asyncio.create_task(one(http, url, payload(i, args.sigterm_steps)))
                     for i in range(args.sigterm_requests)]
            await asyncio.to_thread(wait_for_a_running_wave, client, url)
            server.process.send_signal(signal.SIGTERM)
            start = time.monotonic()
            results.extend(await asyncio.gather(*tasks))
            await asyncio.to_thread(server.process.wait, DEADLINE_S)
            return time.monotonic() - start

    exit_s = asyncio.run(run())
    bound = args.shutdown_timeout + 2.0 + SIGTERM_MARGIN_S
    answered_json = all(
        isinstance(r, httpx.Response) and (r.status_code == 200 or
                                           (r.status_code == 503 and is_openai_error(r)))
        for r in results)
    checks = {
        f"exit within {bound:g} s": exit_s <= bound,
        "every client answered (200 or OpenAI 503)": answered_json,
        "worker gone, no shm left": (worker is None or not os.path.exists(f"/proc/{worker}"))
        and not segments_of(worker) and not segments_of(server_pid),
    }
    return {"scenario": "SIGTERM", "requests": args.sigterm_requests,
            "answers": summarize_answers(results), "errors": error_messages(results),
            "exit_s": exit_s,
            "exit_code": server.process.returncode,
            "figure": f"exited in {exit_s:.1f} s (shutdown timeout {args.shutdown_timeout:g} s, "
                      f"exit code {server.process.returncode})",
            "checks": checks}


# -- the run ------------------------------------------------------------------------------
def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | scenario | requests | answers | result | checks |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(row.get("answers", {}).items()))
        checks = "; ".join(f"{name} {'ok' if passed else 'FAIL'}"
                           for name, passed in row["checks"].items())
        verdict = "PASS" if all(row["checks"].values()) else "FAIL"
        lines.append(f"| {row['mode']} | {row['scenario']} | {row['requests']} | {answers} | "
                     f"{row['figure']} | {verdict}: {checks} |")
    return "\n".join(lines)


def server_spec(args: argparse.Namespace) -> harness.ServerSpec:
    return harness.diffbatch_spec(
        args.model, threads=1, max_num_seqs=args.max_num_seqs, wait_ms=args.wait_ms,
        name="reliability", extra_args=[
            "--max-queue-size", str(args.max_queue_size),
            "--worker-stall-timeout", str(args.stall_timeout),
            "--shutdown-timeout", str(args.shutdown_timeout),
            "--log-level", args.server_log_level, "--allow-runtime-lora-updating",
            *(["--step-execution"] if args.mode == "step" else [])])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = server_spec(args)
    server = harness.Server(spec, tempfile.mkdtemp(prefix="diffbatch-reliability-"))
    rows: list[dict[str, Any]] = []
    try:
        with httpx.Client(timeout=30.0, trust_env=False) as client:
            wait_until(lambda: server.process.poll() is not None or
                       status_of(client, spec.base_url) == 200,
                       "the server to start", timeout_s=harness.DEFAULT_STARTUP_TIMEOUT_S,
                       poll_s=0.25)
            if server.process.poll() is not None:
                raise RuntimeError(f"the server exited during start-up:\n{server.log_tail()}")
            url, pid = spec.base_url, server.process.pid
            steps = [
                ("burst", lambda: burst(url, args, client)),
                ("disconnects", lambda: disconnects(url, args, client, pid)),
                ("kills", lambda: kills(url, args, client, pid)),
                ("freeze", lambda: freeze(url, args, client, pid)),
                ("soak", lambda: soak(url, args, client, pid)),
                ("adapters", lambda: adapters(url, args, client)),
                ("sigterm", lambda: sigterm(url, args, client, server)),
            ]
            for name, step in steps:
                if args.only and name not in args.only:
                    continue
                start = time.monotonic()
                row = step()
                row["mode"] = args.mode
                row["elapsed_s"] = time.monotonic() - start
                print(f"{args.mode} {name}: {row['figure']} ({row['elapsed_s']:.1f} s)",
                      flush=True)
                rows.append(row)
    except Exception:
        print(f"server log tail:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()
    return rows


def plot(report: dict[str, Any], path: str) -> None:
    plt = harness.pyplot()
    soak_row = next((r for r in report["results"] if r["scenario"] == "soak"), None)
    if soak_row is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([t for t, _ in soak_row["rss_mib"]], [m for _, m in soak_row["rss_mib"]])
    ax.set_xlabel("soak time (s)")
    ax.set_ylabel("RSS, server + worker (MiB)")
    ax.set_title(f"soak: slope {soak_row['rss_slope_mib_per_min']:+.2f} MiB/min")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--quick", action="store_true",
                        help="under two minutes: smaller burst, fewer disconnects, 15 s soak")
    parser.add_argument("--burst", type=int, default=None, help="requests (quick: 300)")
    parser.add_argument("--disconnects", type=int, default=None, help="requests (quick: 40)")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--soak-s", type=float, default=None, help="seconds (quick: 15)")
    parser.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--steps", type=int, default=2, help="steps of ordinary requests")
    parser.add_argument("--long-steps", type=int, default=200,
                        help="steps of the long waves (disconnects, SIGTERM)")
    parser.add_argument("--sigterm-requests", type=int, default=12)
    parser.add_argument("--sigterm-steps", type=int, default=50,
                        help="steps of the SIGTERM scenario's requests (some waves finish "
                        "within the shutdown timeout, later ones are interrupted)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--wait-ms", type=float, default=10.0)
    parser.add_argument("--max-queue-size", type=int, default=64)
    parser.add_argument("--stall-timeout", type=float, default=3.0,
                        help="the server's --worker-stall-timeout")
    parser.add_argument("--shutdown-timeout", type=float, default=3.0,
                        help="the server's --shutdown-timeout")
    parser.add_argument("--server-log-level", default="warning",
                        help="the server's --log-level (its log is kept in a temp folder)")
    parser.add_argument("--modes", default="request,step",
                        help="comma-separated: request (the default engine), step "
                        "(--step-execution); each runs the whole campaign on its own server")
    parser.add_argument("--only", default="",
                        help="comma-separated scenarios to run (burst, disconnects, kills, "
                        "freeze, soak, adapters, sigterm); all when empty")
    parser.add_argument("--kill-when-running", type=int, default=1,
                        help="each kill waits for this many requests running")
    parser.add_argument("--out", default="benchmarks/results/reliability.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    for name, full, quick in (("burst", 1000, 300), ("disconnects", 100, 40),
                              ("soak_s", 300.0, 15.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.only = [name for name in args.only.split(",") if name]
    report = harness.report_header("reliability", args)
    start = time.perf_counter()
    rows = []
    for mode in args.modes.split(","):
        if mode not in ("request", "step"):
            parser.error(f"--modes takes request and step, got {mode!r}")
        args.mode = mode
        rows += run(args)
    report["results"] = rows
    report["pass"] = all(all(r["checks"].values()) for r in rows)
    report["elapsed_s"] = time.perf_counter() - start
    print(format_table(rows))
    print(f"{'PASS' if report['pass'] else 'FAIL'} in {report['elapsed_s']:.0f} s")
    harness.finish_report(report, args, plot)
    return 0  # the verdicts are in the table and the report, as in the other benchmarks


if __name__ == "__main__":
    sys.exit(main())
