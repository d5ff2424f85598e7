"""`specwire startup-time`: how long a stack takes to reach SERVING, cold and warm; how long a
killed target takes to serve again under `up`'s supervision; how long SIGTERM takes to end each
service.

Each repeat starts the three services as `specwire up` does (the demo pair unless told
otherwise) and measures:
- cold: the stack started on an empty compile cache (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR
  in a new temporary directory), from the launcher's first spawn until every service is SERVING,
  and (compiling) until both model services' forwards run compiled (`Info.compiled`: they
  compile in the background, serving eagerly meanwhile);
- warm: the same, started again on the cache the cold start filled;
- restart: the warm stack's target SIGKILLed and restarted by the launcher's supervision (after
  its 1 s back-off), until it is SERVING again;
- drain: SIGTERM until exit, for the draft and the orchestrator idle, and for the target while it
  holds an open session (a generation between two rounds), which it waits for until `--grace`
  is up.
Beside each wall time stands each service's own account (`Info.startup`: seconds from its
process's start to SERVING, by phase). Timings depend on the machine and its load: the report
carries the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from specwire.bench.bench import default_models, machine_info
from specwire.bench.report import emit
from specwire.client.launcher import Stack, StackConfig, free_base_port
from specwire.client.sdk import Client
from specwire.v1 import common_pb2, model_pb2, model_pb2_grpc

from specwire import wire
from specwire.session import OpenRequest

SCHEMA = "specwire.startup/1"
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser("startup-time")
    parser.add_argument("--target-model", help="target model directory (default: the demo target)")
    parser.add_argument("--draft-model", help="draft model directory (default: the demo draft)")
    parser.add_argument("--drafter", default="model", choices=["model", "ngram"], help="the draft service's drafter")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quantize", default="auto", help="the model services' --quantize")
    parser.add_argument("--compile", choices=["auto", "on", "off"], help="the services' --compile (default: theirs)")
    parser.add_argument("--grace", type=float, default=10.0, help="the services' --grace: seconds a drain waits")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a start may take before it fails")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", help="also write the JSON report here")
    return parser


@contextlib.contextmanager
def compile_cache(directory: str) -> Iterator[None]:
    """Children started inside compile into, and read from, `directory` only."""
    saved = {name: os.environ.get(name) for name in CACHE_VARIABLES}
    os.environ.update({name: str(Path(directory) / name.lower()) for name in CACHE_VARIABLES})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def startup_dict(startup: common_pb2.StartupTimes) -> dict[str, Any]:
    return {"serving_s": round(startup.serving_s, 3), "phases": {p.name: round(p.seconds, 3) for p in startup.phases}}


def model_startup(address: str) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        info = model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest(), timeout=30)
    return startup_dict(info.startup)


def services_startup(stack: Stack) -> dict[str, Any]:
    """Each service's `Info.startup`."""
    c = stack.config
    with Client(c.address, timeout=30) as client:
        orchestrator = startup_dict(client.info().startup)
    return {
        "target": model_startup(f"{c.host}:{c.target_port}"),
        "draft": model_startup(f"{c.host}:{c.draft_port}"),
        "orchestrator": orchestrator,
    }


def compiled(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        return bool(model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest(), timeout=30).compiled)


def timed_start(config: StackConfig, timeout: float, compiling: bool) -> tuple[Stack, dict[str, Any]]:
    stack = Stack(config)
    began = time.monotonic()
    stack.start(timeout=timeout)
    stack_s = time.monotonic() - began
    report: dict[str, Any] = {"stack_s": round(stack_s, 3), "services": services_startup(stack)}
    if compiling:
        c = stack.config
        addresses = [f"{c.host}:{c.target_port}"] + ([f"{c.host}:{c.draft_port}"] if c.drafter == "model" else [])
        while not all(compiled(address) for address in addresses):
            if time.monotonic() - began > timeout:
                raise TimeoutError(f"the model services did not run compiled within {timeout:.0f} s")
            time.sleep(0.5)
        report["compiled_s"] = round(time.monotonic() - began, 3)
    return stack, report


def timed_restart(stack: Stack, role: str, timeout: float) -> dict[str, Any]:
    """SIGKILL `role`'s process; seconds until the launcher's restart of it is SERVING."""
    killed = stack.processes[role]
    began = time.monotonic()
    killed.kill()
    killed.wait()
    while stack.processes[role] is killed or not stack.ready(role):
        stack.supervise(log=lambda line: None)
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"{role} was not serving again within {timeout:.0f} s")
        time.sleep(0.02)
    restart_s = time.monotonic() - began
    c = stack.config
    return {"restart_s": round(restart_s, 3), "service": model_startup(f"{c.host}:{c.target_port}")}


def exit_s(stack: Stack, role: str) -> float:
    """SIGTERM to `role`; seconds until its process has exited."""
    process = stack.processes[role]
    began = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=600)
    return round(time.monotonic() - began, 3)


def timed_drains(stack: Stack) -> dict[str, float]:
    """SIGTERM to exit: the target holding an open session, then the draft and the orchestrator."""
    release = threading.Event()

    def requests() -> Iterator[model_pb2.SessionRequest]:
        yield wire.open_to_pb(OpenRequest(prompt_ids=[1, 2, 3]))
        release.wait()

    c = stack.config
    with grpc.insecure_channel(f"{c.host}:{c.target_port}") as channel:
        replies = model_pb2_grpc.ModelServiceStub(channel).Session(requests())
        next(replies)  # the session is open
        try:
            drains = {"target_holding_a_session_s": exit_s(stack, "target")}
        finally:
            release.set()
            replies.cancel()
    drains |= {f"{role}_idle_s": exit_s(stack, role) for role in ("draft", "orchestrator")}
    return drains


def medians(runs: list[dict[str, Any]], grace_s: float) -> dict[str, float]:
    """Median over repeats of each figure the report headlines."""
    figures: dict[str, list[float]] = {}
    for run in runs:
        found = {
            "cold_stack_s": run["cold"]["stack_s"],
            **({"cold_compiled_s": run["cold"]["compiled_s"]} if "compiled_s" in run["cold"] else {}),
            **({"warm_compiled_s": run["warm"]["compiled_s"]} if "compiled_s" in run["warm"] else {}),
            **{f"cold_{role}_serving_s": s["serving_s"] for role, s in run["cold"]["services"].items()},
            "warm_stack_s": run["warm"]["stack_s"],
            **{f"warm_{role}_serving_s": s["serving_s"] for role, s in run["warm"]["services"].items()},
            "restart_s": run["restart"]["restart_s"],
            **{f"drain_{name}": seconds for name, seconds in run["drain"].items()},
            # What exiting costs after the grace: what kubelet's grace period must add to --grace.
            "drain_beyond_grace_s": run["drain"]["target_holding_a_session_s"] - grace_s,
        }
        for name, value in found.items():
            figures.setdefault(name, []).append(value)
    return {name: round(statistics.median(values), 3) for name, values in figures.items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    target, draft = default_models(args.target_model, args.draft_model)
    service_args = ("--grace", str(args.grace)) + (("--compile", args.compile) if args.compile else ())
    config = StackConfig(target_model=target, draft_model=draft, device=args.device, quantize=args.quantize,
                         drafter=args.drafter, extra_target_args=service_args, extra_draft_args=service_args,
                         extra_orchestrator_args=("--grace", str(args.grace)))
    compiling = args.compile != "off" and os.environ.get("SPECWIRE_COMPILE", "auto") != "off"
    info = machine_info()
    runs = []
    for repeat in range(args.repeats):
        config = replace(config, port=free_base_port())
        with tempfile.TemporaryDirectory(prefix="specwire-compile-cache-") as cache, compile_cache(cache):
            stack, cold = timed_start(config, args.timeout, compiling)
            stack.stop()
            stack, warm = timed_start(config, args.timeout, compiling)
            try:
                restart = timed_restart(stack, "target", args.timeout)
                drain = timed_drains(stack)
            finally:
                stack.stop()
        runs.append({"repeat": repeat, "cold": cold, "warm": warm, "restart": restart, "drain": drain})
    return {
        "schema": SCHEMA,
        "config": {"target_model": args.target_model or "demo", "draft_model": args.draft_model or "demo",
                   "drafter": args.drafter, "quantize": args.quantize,
                   "device": args.device, "compile": args.compile or "default", "grace_s": args.grace,
                   "repeats": args.repeats},
        "machine": info | {"loadavg_end": list(os.getloadavg())},
        "median": medians(runs, args.grace),
        "runs": runs,
    }


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or not 0 <= args.grace < float("inf"):
        raise SystemExit("--repeats must be ≥ 1 and --grace a finite number ≥ 0")
    report = measure(args)
    if emit(report, args.out, args.json):
        return 0
    for name, seconds in report["median"].items():
        print(f"{name:<36} {seconds:8.1f} s")
    print(f"(median of {args.repeats}; load average {report['machine']['loadavg_start']} → {report['machine']['loadavg_end']})")
    return 0
