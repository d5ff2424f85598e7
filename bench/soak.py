"""`specwire soak`: hours of traffic in minutes — does anything leak or fail under steady load?

Starts a stack (draft, target replicas, orchestrator, as `specwire up` does, with Prometheus on),
runs `--streams` concurrent clients that each stream generation after generation until
`--duration` is up, cycling through greedy, seeded sampling, speculative and beam search, and
samples every `--interval`:

- tokens/s over the interval (tokens the clients received);
- RSS of every process (from /proc), so growth shows as a slope;
- KV-cache tokens and sessions the model services hold (their `specwire_kv_cache_tokens` and
  `specwire_active_sessions` gauges);
- errors, with their status and message.

After the streams end it waits for the services to free every session and reports what they still
hold (`after`: 0 KV tokens expected), and each process's RSS at the end against its value one
minute in (`rss_end_vs_1min`; against the first sample after warm-up for runs under 2 minutes).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from specwire.bench.report import emit
from specwire.client.launcher import Stack, StackConfig, free_base_port
from specwire.client.sdk import Client, GenerationError

SCHEMA = "specwire.soak/1"
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "for index, value in enumerate(",
]
# Each stream cycles through these, offset by its index, so every strategy runs concurrently.
MIX: list[dict[str, Any]] = [
    {"strategy": "greedy"},
    {"strategy": "sample", "temperature": 0.8, "top_p": 0.95},
    {"strategy": "speculative", "num_speculative_tokens": 4},
    {"strategy": "beam", "num_beams": 3},
]


def parse_duration(text: str) -> float:
    """Seconds from `90`, `90s`, `10m` or `1h`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"duration {text!r}: expected a number with s, m or h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def rss_mb(pid: int) -> float | None:
    """Resident set size of `pid` in MiB (Linux /proc), None where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scrape(port: int) -> dict[str, float]:
    """Every unlabelled sample of a /metrics page, by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                values[sample.name] = sample.value
    return values


@dataclass
class Tally:
    """What the streams did, shared by their threads."""

    tokens: int = 0
    generations: int = 0
    errors: int = 0
    messages: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float
    streams: int
    interval_s: float
    max_new_tokens: int
    target_model: str | None
    draft_model: str | None
    target_replicas: int
    device: str


def _stream_worker(address: str, index: int, config: SoakConfig, stop: threading.Event, tally: Tally) -> None:
    with Client(address, timeout=120) as client:
        turn = index
        while not stop.is_set():
            params = dict(MIX[turn % len(MIX)], max_new_tokens=config.max_new_tokens, seed=turn)
            prompt = PROMPTS[turn % len(PROMPTS)]
            turn += 1
            try:
                for delta in client.stream(prompt=prompt, **params):
                    with tally.lock:
                        tally.tokens += len(delta.token_ids)
                with tally.lock:
                    tally.generations += 1
            except GenerationError as error:
                with tally.lock:
                    tally.errors += 1
                    tally.messages[f"{error.code.name}: {error.message}"] += 1


class _Services:
    """The stack's processes and their metrics ports, as the launcher lays them out."""

    def __init__(self, stack: Stack, metrics_port: int) -> None:
        self.stack = stack
        c = stack.config
        self.metrics = {"draft": metrics_port + 1, "target": metrics_port + 2}
        for index in range(1, c.target_replicas):
            self.metrics[f"target-{index + 1}"] = metrics_port + 4 + index

    def rss(self) -> dict[str, float | None]:
        return {role: rss_mb(process.pid) for role, process in self.stack.processes.items()}

    def held(self) -> dict[str, dict[str, float]]:
        out = {}
        for role, port in self.metrics.items():
            values = scrape(port)
            out[role] = {
                "kv_cache_tokens": values.get("specwire_kv_cache_tokens", float("nan")),
                "active_sessions": values.get("specwire_active_sessions", float("nan")),
            }
        return out


def run_soak(config: SoakConfig, log_dir: Path | None = None) -> dict[str, Any]:
    port = free_base_port(5 + config.target_replicas)
    metrics_port = free_base_port(5 + config.target_replicas)
    extra = ("--metrics-port",)
    stack_config = StackConfig(
        port=port,
        target_model=config.target_model,
        draft_model=config.draft_model,
        device=config.device,
        target_replicas=config.target_replicas,
        extra_orchestrator_args=(*extra, str(metrics_port)),
        extra_draft_args=(*extra, str(metrics_port + 1)),
        extra_target_args=(*extra, str(metrics_port + 2)),
    )
    samples: list[dict[str, Any]] = []
    tally = Tally()
    with Stack(stack_config) as stack:
        stack.start(log_dir=log_dir)
        services = _Services(stack, metrics_port)
        stop = threading.Event()
        workers = [
            threading.Thread(target=_stream_worker, args=(stack.config.address, i, config, stop, tally), daemon=True)
            for i in range(config.streams)
        ]
        started = time.monotonic()
        for worker in workers:
            worker.start()
        last_tokens, last_time = 0, started
        while (now := time.monotonic()) - started < config.duration_s:
            time.sleep(min(config.interval_s, max(0.0, config.duration_s - (now - started))))
            now = time.monotonic()
            with tally.lock:
                tokens, generations, errors = tally.tokens, tally.generations, tally.errors
            samples.append({
                "t_s": round(now - started, 2),
                "tokens_per_s": (tokens - last_tokens) / max(now - last_time, 1e-9),
                "tokens": tokens,
                "generations": generations,
                "errors": errors,
                "rss_mb": services.rss(),
                "held": services.held(),
            })
            last_tokens, last_time = tokens, now
            dead = stack.dead()
            if dead:
                with tally.lock:
                    tally.errors += 1
                    tally.messages[f"{dead} process exited"] += 1
                break
        stop.set()
        for worker in workers:
            worker.join(150)
        elapsed = time.monotonic() - started
        after = services.held()
        deadline = time.monotonic() + 15
        while any(v["kv_cache_tokens"] or v["active_sessions"] for v in after.values()) and time.monotonic() < deadline:
            time.sleep(0.2)  # a cancelled stream's session is freed when the service sees it end
            after = services.held()
        rss_end = services.rss()
    return {
        "schema": SCHEMA,
        "config": {
            "duration_s": config.duration_s, "streams": config.streams, "interval_s": config.interval_s,
            "max_new_tokens": config.max_new_tokens, "strategies": [m["strategy"] for m in MIX],
            "target_model": config.target_model or "demo target", "draft_model": config.draft_model or "demo draft",
            "target_replicas": config.target_replicas, "device": config.device,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "samples": samples,
        "totals": {
            "elapsed_s": elapsed,
            "tokens": tally.tokens,
            "generations": tally.generations,
            "tokens_per_s": tally.tokens / max(elapsed, 1e-9),
            "errors": tally.errors,
            "error_messages": dict(tally.messages.most_common(10)),
        },
        "after": after,
        "rss_end_mb": rss_end,
        "rss_end_vs_1min": _rss_growth(samples, rss_end),
    }


def _rss_growth(samples: list[dict[str, Any]], rss_end: dict[str, float | None]) -> dict[str, float | None]:
    """Each process's RSS at the end over its RSS one minute in (or after the first tenth of a
    run shorter than 2 minutes, once warm-up allocations are done)."""
    if not samples:
        return {}
    duration = samples[-1]["t_s"]
    mark = 60.0 if duration >= 120 else duration / 10
    reference = next((s for s in samples if s["t_s"] >= mark), samples[0])["rss_mb"]
    return {
        role: (end / reference[role]) if end and reference.get(role) else None for role, end in rss_end.items()
    }


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser("soak")
    parser.add_argument("--duration", type=parse_duration, default=parse_duration("10m"), help="e.g. 30s, 10m, 1h")
    parser.add_argument("--streams", type=int, default=8, help="concurrent client streams")
    parser.add_argument("--interval", type=parse_duration, default=parse_duration("10s"), help="sampling period")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--target-model", help="target model directory (default: the demo target)")
    parser.add_argument("--draft-model", help="draft model directory (default: the demo draft)")
    parser.add_argument("--target-replicas", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--log-dir", help="write each service's log here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", help="also write the JSON report here")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.streams < 1 or args.duration <= 0 or args.interval <= 0 or args.target_replicas < 1:
        raise SystemExit("--streams, --duration, --interval and --target-replicas must be positive")
    config = SoakConfig(
        duration_s=args.duration, streams=args.streams, interval_s=args.interval, max_new_tokens=args.max_new_tokens,
        target_model=args.target_model, draft_model=args.draft_model, target_replicas=args.target_replicas,
        device=args.device,
    )
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    report = run_soak(config, log_dir)
    if not emit(report, args.out, args.json):
        totals = report["totals"]
        print(f"{totals['generations']} generations, {totals['tokens']} tokens, {totals['tokens_per_s']:.1f} tok/s, "
              f"{totals['errors']} errors over {totals['elapsed_s']:.0f} s")
        for sample in report["samples"]:
            rss = ", ".join(f"{k} {v:.0f}" for k, v in sample["rss_mb"].items() if v is not None)
            kv = ", ".join(f"{k} {v['kv_cache_tokens']:.0f}" for k, v in sample["held"].items())
            print(f"  t={sample['t_s']:>7.1f}s  {sample['tokens_per_s']:7.1f} tok/s  RSS MiB: {rss}  KV tokens: {kv}")
        print(f"after: {report['after']}; RSS end / 1 min: {report['rss_end_vs_1min']}")
    failed = report["totals"]["errors"] or any(v["kv_cache_tokens"] for v in report["after"].values())
    if failed:
        print(f"soak: {report['totals']['errors']} errors {report['totals']['error_messages']}; after: {report['after']}",
              file=sys.stderr)
    return 1 if failed else 0
