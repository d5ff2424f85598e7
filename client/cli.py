"""The `specwire` command line: serve, up, generate, demo, trace, bench, experiment, startup-time, distill."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specwire.bench.entropix_plot import STATE_COLOURS, plot_decisions
from specwire.client import pair
from specwire.client.sdk import Client, GenerateResult, GenerationError, enum_names
from specwire.v1 import orchestrator_pb2

from specwire import __version__, model_zoo
from specwire.config import QUANTIZE_MODES, ModelServiceConfig, OrchestratorConfig, compile_default
from specwire.extras import require
from specwire.serving import exit_now

# Commands defined in their own modules: (module, entry point, help line). Only the command being
# run is imported, so a client command such as `generate`, or `--help`, starts in a second.
MODULE_COMMANDS: dict[str, tuple[str, str, str]] = {
    "bench": ("specwire.bench.bench", "run",
        "specwire vs transformers (target-only, assisted, prompt lookup), side by side"),
    "report": ("specwire.bench.report", "run",
        "Markdown tables from a `specwire bench --json` report"),
    "experiment": ("specwire.bench.experiment", "run",
        "speculative decoding across emulated RTTs and γ: CSV + plots"),
    "soak": ("specwire.bench.soak", "run",
        "steady concurrent load for a while: tokens/s, RSS per process, KV tokens held, errors"),
    "bounds": ("specwire.bench.bounds", "run",
        "the engine's costs here, and the best ratio to greedy each strategy could reach"),
    "startup-time": ("specwire.bench.startup", "run",
        "time to SERVING (cold and warm compile cache), restart under up, SIGTERM to exit"),
    "distill": ("specwire.draft_service.distill", "run",
        "train a draft to match a target's next-token distributions (KL), report α before/after"),
    "self-text": ("specwire.draft_service.self_text", "run",
        "a corpus of the target's own greedy continuations (distill --data)"),
    "train-medusa": ("specwire.target_service.train_medusa", "main",
        "train Medusa heads on a frozen base model"),
    "teacher-cache": ("specwire.teacher_cache", "run",
        "run a target over a corpus once, storing its top-k log-probs (distill, train-medusa)"),
    "pair": ("specwire.client.pair", "run",
        "a real target with its distilled draft and Medusa heads (cached steps)"),
    "models": ("specwire.model_zoo", "run",
        "real models pip can install, prepared for serving"),
    "quality": ("specwire.bench.quality", "run",
        "quantised weights against the float model: perplexity, agreement"),
    "draft-quality": ("specwire.bench.draft_quality", "run",
        "a draft against its target: α, greedy agreement, KL (exact)"),
}

# Generation flags: (flag, type, help). The SDK keyword is the flag with underscores.
GENERATION_FLAGS: list[tuple[str, Any, str]] = [
    ("--temperature", float, "softmax temperature (≥ 0; 0 = greedy)"),
    ("--top-k", int, "keep the k most likely tokens (0 = off)"),
    ("--top-p", float, "nucleus: keep the smallest set with this probability, in (0, 1]"),
    ("--min-p", float, "drop tokens below min_p × the top probability"),
    ("--repetition-penalty", float, "CTRL repetition penalty (> 0; 1 = off)"),
    ("--no-repeat-ngram-size", int, "forbid repeating n-grams of this size (0 = off)"),
    ("--num-beams", int, "beams for --strategy beam / contrastive"),
    ("--length-penalty", float, "beam score = sum log p / length^length_penalty"),
    ("--num-return-sequences", int, "beam hypotheses to return (≤ num_beams)"),
    ("--num-speculative-tokens", int, "γ: draft tokens per speculative round, 0 or unset = auto (with entropix: speculate)"),
    ("--draft-confidence-threshold", float, "draft stops proposing below this top probability"),
    ("--draft-alternatives", int, "greedy speculation: verify the draft's k runners-up a position too, as a tree"),
    ("--lookup-min-ngram", int, "speculation: copy drafts from the history where its last n ≥ this tokens recur (0 = off; default 1)"),
    ("--cd-alpha", float, "contrastive plausibility cut-off α"),
    ("--cd-beta", float, "O'Brien & Lewis contrast weight β"),
    ("--amateur-temperature", float, "Li et al. amateur temperature τ"),
    ("--posterior-threshold", float, "typical acceptance ε (default 0.09)"),
    ("--posterior-alpha", float, "typical acceptance δ (default 0.3)"),
    ("--seed", int, "seed every random choice of the request"),
]


def _add_model_service_flags(parser: argparse.ArgumentParser, role: str, port: int) -> None:
    parser.add_argument("--model", help="model directory, hub id or FILE.gguf (default: the embedded demo model)")
    parser.add_argument("--gguf-file", help="with --model DIR: the GGUF file in it to load")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    _add_quantize_flag(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port, help="0 picks a free port")
    parser.add_argument("--max-sessions", type=int, default=256, help="concurrent sessions before RESOURCE_EXHAUSTED")
    parser.add_argument("--max-batch-rows", type=int, default=0, help="KV-cache rows (branches of all sessions); 0 = from free memory")
    parser.add_argument("--max-cache-len", type=int, default=0, help="tokens per KV-cache row; 0 = the model's context")
    parser.add_argument("--max-queued-sessions", type=int, default=64, help="sessions waiting for free rows before RESOURCE_EXHAUSTED")
    parser.add_argument(
        "--prefix-cache", default="on", choices=["on", "off"],
        help="closed sessions' KV-cache rows keep their keys until needed, and a prompt that begins the same way "
        "reuses them, where the forward is row-invariant (--quantize int8, int4, w4a8); off: nothing is shared "
        "between sessions, e.g. between tenants",
    )
    parser.add_argument(
        "--engine", default="batched", choices=["batched", "hf"],
        help="batched: slot cache and cross-session batching; hf: transformers' forward, one session at a time",
    )
    parser.add_argument(
        "--compile", default=compile_default(), choices=["auto", "on", "off"],
        help="torch.compile the batched forward (CUDA graphs on CUDA); auto = where measured to pay "
        "(default: $SPECWIRE_COMPILE, else auto)",
    )
    parser.add_argument(
        "--threads", type=int, default=0,
        help="CPU threads for the model's arithmetic; 0 = every core (services sharing a machine should split them)",
    )
    if role == "target":
        parser.add_argument("--medusa", help="Medusa heads directory (default: the demo target's own heads)")
    if role == "draft":
        parser.add_argument("--drafter", default="model", choices=["model", "ngram"])
        parser.add_argument("--ngram-max", type=int, default=3, help="n-gram drafter: longest n-gram to match")
        parser.add_argument("--ngram-min", type=int, default=1, help="n-gram drafter: shortest n-gram to match")
    _add_server_tls_flags(parser)
    _add_drain_flag(parser)
    _add_telemetry_flags(parser)


def _add_quantize_flag(parser: argparse.ArgumentParser, flag: str = "--quantize", whom: str = "the model") -> None:
    parser.add_argument(
        flag, default="auto", choices=list(QUANTIZE_MODES),
        help=f"{whom}'s linear weights, on CPU: int8, int4, w4a8, mixed (the LM head w4a8, the rest int8), "
        "or w8a8 (all int8 through the w4a8 kernel's file, on AMX from 4 rows where the CPU has it); "
        "auto = none for a model in the CPU's caches, else mixed where the w4a8 kernel runs "
        "(AVX2 or AVX-512 VNNI), int4 or int8 elsewhere; none on CUDA",
    )


def _add_drain_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--grace", type=float, default=ModelServiceConfig.grace_s,
        help="on SIGTERM: seconds running calls get to finish before the service exits (a second signal: none)",
    )


def _add_server_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM; with --tls-key)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    parser.add_argument(
        "--health-port", type=int, default=0, help="also serve health alone, in plaintext, here (probes; 0 = off)"
    )


def _add_client_tls_flags(parser: argparse.ArgumentParser, prefix: str = "", whom: str = "the server") -> None:
    parser.add_argument(f"--{prefix}tls-ca", help=f"TLS to {whom}, trusting this CA (PEM)")
    parser.add_argument(f"--{prefix}tls-cert", help=f"client certificate to present to {whom} (mutual TLS)")
    parser.add_argument(f"--{prefix}tls-key", help="the client certificate's private key")


def _add_telemetry_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace-exporter", default="none", choices=["none", "otlp", "console", "file"],
        help="OpenTelemetry span export; otlp reads the OTEL_EXPORTER_OTLP_* variables",
    )
    parser.add_argument("--trace-file", help="--trace-exporter file: JSON lines, one span per line")
    parser.add_argument("--trace-sample-ratio", type=float, default=1.0, help="fraction of new traces kept, in [0, 1]")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = off)")


def _telemetry_config(args: argparse.Namespace) -> Any:
    from specwire.config import TelemetryConfig

    if args.trace_file and args.trace_exporter == "none":
        args.trace_exporter = "file"  # a file named is a file wanted
    if args.trace_exporter == "file" and not args.trace_file:
        raise SystemExit("--trace-exporter file needs --trace-file PATH")
    if not 0.0 <= args.trace_sample_ratio <= 1.0:
        raise SystemExit(f"--trace-sample-ratio must be in [0, 1], got {args.trace_sample_ratio}")
    return TelemetryConfig(args.trace_exporter, args.trace_file, args.trace_sample_ratio, args.metrics_port)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser (None); given the command being run ("" for none), the other
    modules' commands are names with their help line, their modules not imported."""
    parser = argparse.ArgumentParser(prog="specwire", description="LLM decoding as a gRPC draft/target service pair.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    parser.add_argument("--version", action="version", version=f"specwire {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    _add_model_service_flags(roles.add_parser("draft", help="the draft model service"), "draft", 50052)
    _add_model_service_flags(roles.add_parser("target", help="the target model service"), "target", 50053)
    orch = roles.add_parser("orchestrator", help="the public Generate API")
    orch.add_argument(
        "--target", default="127.0.0.1:50053",
        help="target replicas: host:port[,host:port…]; a DNS name stands for all its addresses",
    )
    orch.add_argument("--draft", default="127.0.0.1:50052", help="draft replicas, as --target ('none' for no draft)")
    orch.add_argument(
        "--failover-timeout", type=float, default=5.0,
        help="seconds a session lost with its replica may take to be rebuilt on another before UNAVAILABLE",
    )
    orch.add_argument("--auth-token-file", help="accept only calls with `authorization: Bearer <a line of FILE>`")
    _add_server_tls_flags(orch)
    _add_drain_flag(orch)
    _add_client_tls_flags(orch, "services-", "the model services")
    orch.add_argument("--tokenizer", help="tokenizer directory or hub id (default: the target's)")
    orch.add_argument("--host", default="127.0.0.1")
    orch.add_argument("--port", type=int, default=50051)
    orch.add_argument("--max-new-tokens-limit", type=int, default=4096)
    orch.add_argument(
        "--max-tokens-per-round", type=int, default=OrchestratorConfig.max_tokens_per_round,
        help="target-only decoding: tokens the target may decide per message (1 = one per round trip)",
    )
    orch.add_argument(
        "--speculative-pipeline", choices=("on", "off"), default="on",
        help="pipelined drafting for requests that leave speculative_pipeline unset "
        "(off where draft and target compute on the same cores: the draft's work slows the verification)",
    )
    _add_telemetry_flags(orch)
    _add_http_front_flags(roles.add_parser("http", help="the OpenAI-compatible HTTP front (pip install 'specwire[http]')"))

    up = commands.add_parser("up", help="run all three services until Ctrl-C / SIGTERM")
    _add_stack_flags(up)
    up.add_argument(
        "--http-port", type=int, default=0,
        help="also serve the OpenAI-compatible HTTP API on this port (0 = off; pip install 'specwire[http]')",
    )
    up.add_argument("--chat-template", metavar="FILE", help="--http-port: a Jinja chat template instead of the tokenizer's own")

    generate = commands.add_parser("generate", help="generate text through an orchestrator")
    generate.add_argument("--address", default="127.0.0.1:50051")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--input-ids", help="prompt token ids, comma-separated")
    _add_generation_flags(generate)
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.add_argument("--json", action="store_true", help="print the result as JSON")
    generate.add_argument("--plot", help="entropix: draw the tokens on the entropy × varentropy plane to this PNG")
    generate.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    _add_client_tls_flags(generate, "", "the orchestrator")
    generate.add_argument("--token-file", help="send the first line of FILE as the bearer token")

    demo = commands.add_parser("demo", help="start the services on the demo pair, generate, stop")
    _add_stack_flags(demo)
    demo.add_argument("--pair", choices=sorted(pair.RECIPES),
                      help="run on this real pair as `specwire pair NAME` built it (its default directory)")
    demo.add_argument("--prompt", default="def fibonacci(n):\n")
    demo.add_argument("--max-new-tokens", type=int, default=48)

    traces = commands.add_parser("trace", help="analyse trace files")
    trace_commands = traces.add_subparsers(dest="trace_command", required=True)
    summarize = trace_commands.add_parser(
        "summarize", help="per-round breakdown (draft, target, queue, network, orchestrator) from JSONL span files"
    )
    summarize.add_argument("paths", nargs="+", help="JSONL span files, or directories of them (`up --trace-dir`)")
    summarize.add_argument("--plot", help="also write a stacked-bar chart of the rounds to this PNG")
    summarize.add_argument("--json", action="store_true", help="print the summary as JSON")
    certs = commands.add_parser(
        "certs", help="make a private CA and certificates for the three services and a client (mutual TLS)"
    )
    certs.add_argument("directory", help="where to write ca.pem and <name>.pem / <name>.key")
    certs.add_argument(
        "--host", action="append", default=[],
        help="a name or IP the certificates are valid for (repeatable; localhost and 127.0.0.1 always, "
        "and specwire-<service>, the Kubernetes Service names)",
    )
    for name, (module, _, help_line) in MODULE_COMMANDS.items():
        if command in (None, name):
            importlib.import_module(module).add_parser(_HelpedCommands(commands, help_line))
        else:
            commands.add_parser(name, help=help_line)
    return parser


class _HelpedCommands:
    """The subcommands action as a module's `add_parser(commands)` sees it: its command gets the
    help line MODULE_COMMANDS gives it."""

    def __init__(self, commands: Any, help_line: str) -> None:
        self.commands, self.help_line = commands, help_line

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return self.commands.add_parser(name, help=self.help_line, **kwargs)  # type: ignore[no-any-return]


def _add_http_front_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--orchestrator", default="127.0.0.1:50051", help="the orchestrator's host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--tokenizer", help="tokenizer directory or hub id for chat templates (default: the orchestrator's)")
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template used instead of the tokenizer's own")
    parser.add_argument("--model-name", help="the model id listed and accepted (default: the orchestrator's target model)")
    parser.add_argument("--auth-token-file", help="accept only requests with `Authorization: Bearer <a line of FILE>`")
    parser.add_argument("--orchestrator-token-file", help="send the first line of FILE to the orchestrator as the bearer token")
    _add_client_tls_flags(parser, "orchestrator-", "the orchestrator")


def _add_stack_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target-model", help="target model directory or hub id (default: demo target)")
    parser.add_argument("--draft-model", help="draft model directory or hub id (default: demo draft)")
    parser.add_argument("--drafter", default="model", choices=["model", "ngram"])
    parser.add_argument("--medusa", help="Medusa heads directory for the target (default: the demo target's)")
    parser.add_argument("--port", type=int, default=50051, help="orchestrator port; draft on +1, target on +2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    _add_quantize_flag(parser, whom="each model service")
    parser.add_argument("--target-quantize", choices=list(QUANTIZE_MODES),
                        help="the target's --quantize where it differs from --quantize (e.g. w8a8 for many streams)")
    parser.add_argument("--target-threads", type=int, default=0, help="the target's torch threads (0: cores split between the services)")
    parser.add_argument("--draft-threads", type=int, default=0, help="the draft's torch threads (0: cores split between the services)")
    parser.add_argument("--trace-dir", help="each service writes its spans to DIR/<service>.jsonl")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus: orchestrator on P, draft P+1, target P+2")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="emulated round trip to each model service (delay proxy)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="± uniform jitter on each one-way delay")
    parser.add_argument("--bandwidth-mbps", type=float, default=0.0, help="per-direction bandwidth cap (0 = none)")
    parser.add_argument("--target-replicas", type=int, default=1, help="target replicas (the 2nd on port+5, then +6, …)")
    parser.add_argument(
        "--tls", metavar="DIR",
        help="mutual TLS between the services: a private CA and certificates made in DIR (reused if there)",
    )
    parser.add_argument("--auth-token-file", help="the orchestrator accepts only these bearer tokens (one per line)")


def _add_generation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strategy", default="greedy", choices=enum_names("strategy"))
    parser.add_argument("--medusa-choices", help="medusa candidate tree: a JSON file (or inline JSON) of top-k paths")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    parser.add_argument("--stop-strings", action="append", metavar="STRING", help="stop string (repeatable)")
    parser.add_argument("--early-stopping", choices=enum_names("early_stopping"), default=None)
    parser.add_argument("--cd-form", choices=enum_names("cd_form"), default=None)
    parser.add_argument(
        "--medusa-acceptance", choices=enum_names("medusa_acceptance"), default=None,
        help="medusa sampling: lossless (default) | typical (LOSSY)",
    )
    parser.add_argument(
        "--entropix", action="append", metavar="NAME=VALUE",
        help="an entropix threshold or coefficient (repeatable), e.g. argmax_entropy=0.2",
    )
    for flag, kind, text in GENERATION_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=text)


def generation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """SDK keywords from parsed flags (unset flags left out)."""
    names = ["strategy", "max_new_tokens", "stop_strings", "early_stopping", "cd_form", "medusa_acceptance"]
    names += [flag[2:].replace("-", "_") for flag, _, _ in GENERATION_FLAGS]
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.ignore_eos:
        kwargs["ignore_eos"] = True
    if args.medusa_choices:
        text = args.medusa_choices
        kwargs["medusa_choices"] = text if text.lstrip().startswith("[") else Path(text).read_text()
    if args.entropix:
        kwargs["entropix"] = dict(_parse_entropix(item) for item in args.entropix)
    return kwargs


def _parse_entropix(item: str) -> tuple[str, float]:
    name, _, value = item.partition("=")
    try:
        return name.strip(), int(value) if name.strip() in _ENTROPIX_INTS else float(value)
    except ValueError:
        raise SystemExit(f"--entropix: expected NAME=NUMBER, got {item!r}") from None


_ENTROPIX_INTS = {
    f.name for f in orchestrator_pb2.EntropixParams.DESCRIPTOR.fields if f.cpp_type == f.CPPTYPE_INT32
}


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--input-ids: expected comma-separated integers, got {text!r}") from None


def _print_result(result: GenerateResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    print(result.text)
    for index, sequence in enumerate(result.sequences[1:], start=2):
        print(f"--- sequence {index} (score {sequence.score:.4f})\n{sequence.text}")
    print_summary(result.finish_reason, result.stats)


def print_summary(finish_reason: str, stats: Any) -> None:
    """One line of the main figures on stderr (and entropix's states), after the text."""
    s = stats
    print(
        f"\n[{finish_reason}] {s.new_tokens} tokens in {s.wall_ms:.0f} ms "
        f"({1000 * s.new_tokens / max(s.wall_ms, 1e-9):.1f} tok/s), {s.rounds} rounds, "
        + (f"{s.expansions} target rows scored in {s.target_forwards} forwards" if s.expansions
           else f"{s.target_forwards} target forwards")
        + speculation_figures(s),
        file=sys.stderr,
    )
    if s.entropix_states:
        print(f"entropix states: {format_states(s.entropix_states)}", file=sys.stderr)


def speculation_figures(stats: Any) -> str:
    """What speculation did, for a human (empty when nothing was drafted or skipped)."""
    text = ""
    if stats.drafted_tokens:
        text += (f", {stats.accepted_tokens} of {stats.drafted_tokens} drafted tokens accepted "
                 f"({stats.acceptance_rate:.0%}), {stats.tokens_per_target_forward:.2f} tokens/forward")
    if stats.speculation_off_rounds:
        text += f", {stats.speculation_off_rounds} of {stats.rounds} rounds target-only"
    return text


def format_states(counts: dict[str, int]) -> str:
    return ", ".join(f"{state} {counts[state]}" for state in STATE_COLOURS if state in counts)


def read_token(path: str, flag: str = "--token-file") -> str:
    """The first non-blank, non-comment line of a token file (given by `flag`)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise SystemExit(f"{flag}: cannot read {path}: {error.strerror}") from None
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            return line.strip()
    raise SystemExit(f"{flag}: {path} holds no token")


def client_security(args: argparse.Namespace) -> dict[str, Any]:
    """SDK keywords for TLS and the bearer token from `--tls-*` / `--token-file`."""
    from specwire.security import client_tls

    tls = client_tls(args.tls_ca, args.tls_cert, args.tls_key)
    token = read_token(args.token_file) if args.token_file else None
    return {"tls_ca": tls.ca if tls else None, "tls_cert": tls.cert if tls else None,
            "tls_key": tls.key if tls else None, "token": token}


def cmd_generate(args: argparse.Namespace) -> int:
    if args.plot:  # refused before any generation
        require("matplotlib", "plots", "specwire generate --plot")
    kwargs = generation_kwargs(args)
    if args.input_ids is not None:
        kwargs["input_ids"] = _parse_ids(args.input_ids)
    with Client(args.address, timeout=args.timeout, **client_security(args)) as client:
        if args.stream and not args.json:
            last = None
            for delta in client.stream(args.prompt, **kwargs):
                print(delta.text, end="", flush=True)
                last = delta
            if last is not None and last.stats is not None:
                print_summary(last.finish_reason, last.stats)
            return 0
        result = client.generate(args.prompt, **kwargs)
        _print_result(result, args.json)
    if args.plot:
        if not result.decisions:
            print("error: --plot needs --strategy entropix (no decision trace)", file=sys.stderr)
            return 2
        plot_decisions(result.decisions, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def _stack_telemetry_args(args: argparse.Namespace, service: str, port_offset: int) -> tuple[str, ...]:
    """`serve` flags that give one service of `up` / `demo` its trace file and metrics port."""
    extra: list[str] = []
    if args.trace_dir:
        path = Path(args.trace_dir).resolve()
        path.mkdir(parents=True, exist_ok=True)
        extra += ["--trace-exporter", "file", "--trace-file", str(path / f"{service}.jsonl")]
    if args.metrics_port:
        extra += ["--metrics-port", str(args.metrics_port + port_offset)]
    return tuple(extra)


def _stack_config(args: argparse.Namespace) -> Any:
    from specwire.client.launcher import StackConfig

    return StackConfig(
        port=args.port,
        target_model=args.target_model,
        draft_model=args.draft_model,
        drafter=args.drafter,
        device=args.device,
        dtype=args.dtype,
        quantize=args.quantize,
        target_quantize=args.target_quantize,
        target_threads=args.target_threads,
        draft_threads=args.draft_threads,
        extra_target_args=_stack_telemetry_args(args, "target", 2),
        medusa=args.medusa,
        extra_draft_args=_stack_telemetry_args(args, "draft", 1),
        extra_orchestrator_args=_stack_telemetry_args(args, "orchestrator", 0),
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        bandwidth_mbps=args.bandwidth_mbps,
        target_replicas=args.target_replicas,
        tls_dir=str(Path(args.tls).resolve()) if args.tls else None,
        auth_token_file=str(Path(args.auth_token_file).resolve()) if args.auth_token_file else None,
        http_port=getattr(args, "http_port", 0),  # `up` only
        chat_template=str(Path(args.chat_template).resolve()) if getattr(args, "chat_template", None) else None,
    )


def cmd_up(args: argparse.Namespace) -> int:
    from specwire.client.launcher import Stack

    stack = Stack(_stack_config(args))
    if args.http_port:  # refused before anything starts
        require("uvicorn", "http", "specwire up --http-port")
    try:
        stack.start()
        c = stack.config
        print(f"orchestrator  {c.address}")
        print(f"draft         {c.host}:{c.draft_port}")
        print(f"target        {', '.join(f'{c.host}:{port}' for port in c.target_ports)}")
        if c.tls_dir:
            print(f"mutual TLS    between the services; CA and certificates in {c.tls_dir}")
        if c.http_port:
            print(f"openai http   http://{c.host}:{c.http_port}/v1")
        if c.auth_token_file:
            print(f"auth          bearer tokens from {c.auth_token_file} (specwire generate --token-file FILE)")
        if c.proxied:
            print(f"delay proxies draft {c.host}:{c.draft_proxy_port}, target {c.host}:{c.target_proxy_port} "
                  f"(RTT {c.rtt_ms:g} ms ± {c.jitter_ms:g}, {c.bandwidth_mbps or '∞'} Mbit/s)")
        if args.trace_dir:
            print(f"traces        {Path(args.trace_dir).resolve()}/{{orchestrator,draft,target}}.jsonl")
        if args.metrics_port:
            print(f"metrics       http://{c.host}:{args.metrics_port}/metrics (draft +1, target +2)")
        print(f"Ctrl-C stops all {'four' if c.http_port else 'three'}; a child that exits is restarted.", flush=True)
        while True:
            stack.supervise()
            time.sleep(0.2)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, while starting too
        return 0
    finally:
        stack.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    from specwire.client.launcher import Stack

    if args.pair:
        built = model_zoo.default_dir(args.pair)
        if not (built / "draft" / "config.json").exists():
            raise SystemExit(f"--pair {args.pair}: run `specwire pair {args.pair}` first ({built} has no draft)")
        args.target_model, args.draft_model = str(built), str(built / "draft")
        args.medusa = args.medusa or pair.pair_heads(built)
    with Stack(_stack_config(args)) as stack:
        print(f"starting draft, target and orchestrator on the {args.pair or 'demo'} pair…", flush=True)
        stack.start()
        with Client(stack.config.address, timeout=120) as client:
            runs: list[tuple[str, dict[str, Any]]] = [
                ("greedy", {"strategy": "greedy"}),
                ("greedy, repetition penalty 1.3, no repeated 3-grams",
                 {"strategy": "greedy", "repetition_penalty": 1.3, "no_repeat_ngram_size": 3}),
                ("sample (T=0.8, top-p 0.95, seed 1)", {"strategy": "sample", "temperature": 0.8, "top_p": 0.95, "seed": 1}),
                ("beam (4 beams, no repeated 3-grams)", {"strategy": "beam", "num_beams": 4, "no_repeat_ngram_size": 3}),
                ("speculative (auto γ): same text as greedy; it drafts only where the measured costs say it pays",
                 {"strategy": "speculative"}),
                ("speculative (γ = 4, every round drafted): same text, fewer target forwards, slower on a CPU",
                 {"strategy": "speculative", "num_speculative_tokens": 4}),
                ("contrastive (O'Brien & Lewis, α=0.1, β=0.5)", {"strategy": "contrastive"}),
                ("entropix (entropy-adaptive, reference defaults, seed 1)", {"strategy": "entropix", "seed": 1}),
            ]
            if "medusa" in client.info().target_capabilities:
                runs.append(("medusa (the target's own heads): same text as greedy, one message per round",
                             {"strategy": "medusa"}))
            for label, kwargs in runs:
                result = client.generate(prompt=args.prompt, max_new_tokens=args.max_new_tokens, **kwargs)
                s = result.stats
                line = f"\n=== {label}\n    {s.new_tokens} tokens in {s.wall_ms:.0f} ms, {s.target_forwards} target forwards"
                line += speculation_figures(s)
                if s.entropix_states:
                    line += f", states: {format_states(s.entropix_states)}"
                print(line + f", finish={result.finish_reason}")
                print(args.prompt + result.text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from specwire.security import client_tls, server_tls

    if args.role == "http":
        return serve_http(args)
    tls = server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    if not 0 <= args.grace < float("inf"):
        raise SystemExit(f"--grace must be a finite number of seconds ≥ 0, got {args.grace}")

    if args.role == "orchestrator":
        from specwire.orchestrator.server import main as serve_orchestrator

        serve_orchestrator(
            OrchestratorConfig(
                target=args.target,
                draft=None if args.draft.lower() in ("", "none") else args.draft,
                tokenizer=args.tokenizer,
                host=args.host,
                port=args.port,
                max_new_tokens_limit=args.max_new_tokens_limit,
                max_tokens_per_round=args.max_tokens_per_round,
                speculative_pipeline=args.speculative_pipeline == "on",
                failover_timeout_s=args.failover_timeout,
                telemetry=_telemetry_config(args),
                tls=tls,
                services_tls=client_tls(args.services_tls_ca, args.services_tls_cert, args.services_tls_key),
                auth_token_file=args.auth_token_file,
                health_port=args.health_port,
                grace_s=args.grace,
            )
        )
        return 0
    config = ModelServiceConfig(
        role=args.role,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        max_batch_rows=args.max_batch_rows,
        max_cache_len=args.max_cache_len,
        max_queued_sessions=args.max_queued_sessions,
        prefix_cache=args.prefix_cache == "on",
        engine=args.engine,
        compile=args.compile,
        quantize=args.quantize,
        gguf_file=args.gguf_file,
        threads=args.threads,
        drafter=getattr(args, "drafter", "model"),
        medusa=getattr(args, "medusa", None),
        ngram_max=getattr(args, "ngram_max", 3),
        ngram_min=getattr(args, "ngram_min", 1),
        telemetry=_telemetry_config(args),
        tls=tls,
        health_port=args.health_port,
        grace_s=args.grace,
    )
    if args.role == "draft":
        from specwire.draft_service.server import main as serve_draft

        serve_draft(config)
    else:
        from specwire.target_service.server import main as serve_target

        serve_target(config)
    return 0


def serve_http(args: argparse.Namespace) -> int:
    from specwire.config import HttpFrontConfig
    from specwire.security import client_tls

    for module in ("starlette", "uvicorn", "jinja2"):
        require(module, "http", "specwire serve http")
    from specwire.openai_http.server import main as serve_front

    serve_front(
        HttpFrontConfig(
            orchestrator=args.orchestrator,
            host=args.host,
            port=args.port,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            model_name=args.model_name,
            auth_token_file=args.auth_token_file,
            orchestrator_token=(
                read_token(args.orchestrator_token_file, "--orchestrator-token-file") if args.orchestrator_token_file else None
            ),
            orchestrator_tls=client_tls(args.orchestrator_tls_ca, args.orchestrator_tls_cert, args.orchestrator_tls_key),
        )
    )
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from specwire.bench.trace_summary import format_summary, plot_rounds, summarize

    if args.plot:
        require("matplotlib", "plots", "specwire trace summarize --plot")
    try:
        summary = summarize(args.paths)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(summary.to_dict(), indent=2) if args.json else format_summary(summary))
    if args.plot:
        if not summary.rounds:
            print("error: no round spans to plot", file=sys.stderr)
            return 1
        plot_rounds(summary, args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from specwire.security import make_certificates

    directory = Path(args.directory)
    if (directory / "ca.pem").exists():
        raise SystemExit(f"{directory / 'ca.pem'} exists: refusing to replace a CA (pick a new directory)")
    issued = make_certificates(directory, hosts=["localhost", "127.0.0.1", *args.host])
    print(f"CA            {directory / 'ca.pem'}")
    for name, (cert, key) in issued.items():
        print(f"{name:<13} {cert} {key}")
    return 0


# The commands that start services as children (`specwire.client.launcher.Stack`).
STACK_COMMANDS = {"up", "demo", "bench", "experiment", "soak", "startup-time"}
# SIGTERM → exit within this many seconds, however the cleanup goes: `up` waits for its services'
# drain (`Stack.stop`'s 10 s grace), the others only stop what they started.
STOP_BACKSTOP_S = {"up": 15}
STOP_BACKSTOP_DEFAULT_S = 3


def interrupt_on_sigterm(backstop_s: int) -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does, so the stacks started
    stop on the way out. A KeyboardInterrupt raised while a finaliser runs is printed and dropped,
    so the signal also arms SIGALRM with its default action: the kernel ends the process after
    `backstop_s` with no Python involved, and the services' lifelines stop them."""

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(backstop_s)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
COMMANDS = {"certs": cmd_certs, "generate": cmd_generate, "up": cmd_up, "demo": cmd_demo, "serve": cmd_serve, "trace": cmd_trace}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The first word that is not a flag names the command; none (`--help`) or an unknown one
    # needs no module's flags either.
    command = next((word for word in argv if not word.startswith("-")), "")
    args = build_parser(command).parse_args(argv)
    args.command_line = shlex.join(["specwire", *argv])  # recorded with measurements (`bench`)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.command in STACK_COMMANDS:
        interrupt_on_sigterm(STOP_BACKSTOP_S.get(args.command, STOP_BACKSTOP_DEFAULT_S))
    try:
        if args.command in MODULE_COMMANDS:
            module, entry, _ = MODULE_COMMANDS[args.command]
            return int(getattr(importlib.import_module(module), entry)(args))
        return COMMANDS[args.command](args)
    except GenerationError as error:
        print(f"{error.code.name}: {error.message}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.command in STACK_COMMANDS:
            # What ran in this thread has cleaned up on the way here; a stack still starting on
            # another thread is not waited for (its children stop with this process).
            exit_now(130)
        return 130
