"""`specwire report`: the Markdown tables of a `specwire bench --json` or `specwire bounds --json` report.

    specwire report bench.json [--headline]       print the tables
    specwire report --refresh README.md docs/*.md  rewrite the tables generated into pages

Every table opens with where its figures come from (the date, the machine and the command
recorded in the report's metadata), so a figure quoted in the documentation can always be
traced to a run and re-run. A page holds a generated table between two comments,

    <!-- specwire report docs/bench/demo-cpu.json --headline -->
    …
    <!-- end of report -->

and `--refresh` replaces what is between them with what the report renders now (paths are
relative to the directory the command runs in: the repository's root). The docs test checks that
every such block is up to date, so the tables cannot drift from their JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path
from typing import Any

# (header, the row's JSON field, decimals) of the full table, after the row name and tok/s spread.
COLUMNS: list[tuple[str, str, int]] = [
    ("× HF target", "ratio_vs_hf_target", 2),
    ("× best HF assisted", "ratio_vs_hf_assisted", 2),
    ("acceptance", "acceptance_rate", 2),
    ("α", "alpha", 2),
    ("tok/target fwd", "tokens_per_target_forward", 2),
    ("c", "cost_ratio_c", 3),
    ("predicted", "predicted_speedup", 2),
    ("efficiency", "efficiency", 2),
    ("bytes/round", "bytes_per_round", 0),
    ("overhead ms/round", "overhead_ms_per_round", 2),
    ("= HF target", "matches_hf_target", 2),
]
HEADLINE_COLUMNS = [column for column in COLUMNS if column[1] in
                    ("ratio_vs_hf_target", "tokens_per_target_forward", "matches_hf_target")]
# The rows a reader compares first: transformers' own decoding, and each of specwire's strategies once.
HEADLINE_ROWS = [
    "hf_target", "hf_prompt_lookup", "llamacpp", "specwire_greedy", "specwire_speculative", "specwire_speculative_sequential",
    "specwire_speculative_tree", "specwire_speculative_ngram", "specwire_sample", "specwire_entropix", "specwire_medusa",
]
CONCURRENCY_COLUMNS: list[tuple[str, str, int]] = [
    ("streams", "streams", 0),
    ("aggregate tok/s", "aggregate_tokens_per_s", 1),
    ("× one stream", "ratio_vs_one_stream", 2),
    ("× greedy", "ratio_vs_greedy", 2),
    ("p50 ms/token", "p50_token_ms", 2),
    ("p99 ms/token", "p99_token_ms", 2),
    ("p50 × one stream", "p50_ratio_vs_one_stream", 2),
    ("= solo", "matches_solo", 2),
]
# The beam rows' own figures (`specwire_beam`, `specwire_best_first_beam`): work and time against beam search's.
BEAM_GROUP = "specwire_beam"
BEAM_COLUMNS: list[tuple[str, str, int]] = [
    ("target rows scored / generation", "expansions_per_generation", 1),
    ("target forwards / generation", "target_forwards_per_generation", 1),
    ("rows × beam", "expansions_ratio_vs_beam", 3),
    ("wall × beam", "wall_ratio_vs_beam", 3),
    ("= beam", "matches_beam", 2),
]
# The forward-cost curve's points a table shows (`specwire bounds` measures more).
BOUNDS_POSITIONS = (1, 2, 4, 5, 8, 16, 25, 65)
BLOCK = re.compile(
    r"^(<!-- specwire report (?P<args>[^>]*?) -->\n)(?P<body>.*?)^(<!-- end of report -->)", re.DOTALL | re.MULTILINE
)


def fmt(value: Any, digits: int = 2) -> str:
    """A cell: a number to `digits` decimals, `–` where the figure does not apply."""
    if value is None:
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.{digits}f}"
    return str(value)


def provenance(meta: dict[str, Any]) -> str:
    """Where the figures come from: date, machine, command (\"not recorded\" in older reports)."""
    machine = meta["machine"]
    description = machine.get("description") or f"{machine['cpu_count']} CPUs"
    start, end = machine.get("loadavg_start"), machine.get("loadavg_end")
    load_text = f"; load average {start[0]:.1f} at the start" if start else ""
    load_text += f", {end[0]:.1f} at the end" if start and end else ""
    date = meta.get("date")
    command = meta.get("command")
    threads = machine.get("omp_num_threads_env")  # inherited by every process of the run: it moves figures
    when = date[:10] if date else "(date not recorded)"
    how = f"`{f'OMP_NUM_THREADS={threads} ' if threads else ''}{command}`" if command else "a command not recorded"
    return f"Measured {when} on {description}{load_text}, with {how}."


def setup(meta: dict[str, Any]) -> str:
    """The run's workload and models in one line."""
    forward = meta["single_forward"]
    costs = meta.get("target_forward_costs") or {}
    quantization = meta.get("target_quantization")
    served = ""
    if costs.get("1") is not None:
        served = (f"; the served target{f' (`--quantize {quantization}`)' if quantization else ''}: "
                  f"{costs['1']:.2f} ms a forward of 1 position" + (f", {costs['8']:.2f} of 8" if costs.get("8") else ""))
    return (
        f"{meta['prompts']} prompts × {meta['max_new_tokens']} new tokens × {meta['repeats']} repeats, "
        f"γ = {meta['gamma']}, RTT {meta.get('rtt_ms', 0.0):g} ms to each specwire service, "
        f"{meta['device']} {meta['dtype']}; target {meta['parameters']['target'] / 1e6:.1f}M / draft "
        f"{meta['parameters']['draft'] / 1e6:.1f}M parameters; one cached forward in process, unquantised: target "
        f"{forward['target_forward_ms']:.2f} ms, draft {forward['draft_forward_ms']:.2f} ms "
        f"(c = {forward['cost_ratio_c_direct']:.2f}){served}"
        + (f"; the target's heads: `{meta['medusa']}`" if meta.get("medusa") else "") + "."
    )


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + ["| " + " | ".join(r) + " |" for r in rows]


def _spread(row: dict[str, Any]) -> str:
    return f"{fmt(row['tokens_per_s'], 1)} [{fmt(row['tokens_per_s_min'], 1)}–{fmt(row['tokens_per_s_max'], 1)}]"


def _row_cells(row: dict[str, Any], columns: list[tuple[str, str, int]], described: bool) -> list[str]:
    first = [row["name"]] + ([row["description"]] if described else [])
    if row["error"]:
        return first + [f"error: {row['error'][:80]}"] + [""] * len(columns)
    return first + [_spread(row)] + [fmt(row[key], digits) for _, key, digits in columns]


def rows_table(report: dict[str, Any], headline: bool = False) -> list[str]:
    """One line per row: every row and figure, or the headline rows with their descriptions."""
    columns = HEADLINE_COLUMNS if headline else COLUMNS
    rows = [row for row in report["rows"] if not headline or row["name"] in HEADLINE_ROWS]
    headers = ["row"] + (["what it runs"] if headline else []) + ["tok/s median [min–max]"]
    return _table(headers + [header for header, _, _ in columns], [_row_cells(row, columns, headline) for row in rows])


def concurrency_table(report: dict[str, Any]) -> list[str]:
    """Concurrent streams per strategy (`specwire bench --concurrency`)."""
    return _table(
        ["strategy"] + [header for header, _, _ in CONCURRENCY_COLUMNS],
        [[entry["strategy"]] + [fmt(entry.get(key), digits) for _, key, digits in CONCURRENCY_COLUMNS]
         for entry in report["concurrency"]],
    )


def render(report: dict[str, Any], headline: bool = False) -> str:
    """The Markdown: provenance, the workload, the rows; the full form adds concurrency and notes."""
    meta = report["metadata"]
    lines = [provenance(meta), "", setup(meta), "", *rows_table(report, headline)]
    if headline:
        return "\n".join(lines)
    if report.get("concurrency"):
        lines += ["", *concurrency_table(report)]
    beam_rows = [row for row in report["rows"] if row["group"] == BEAM_GROUP and not row["error"]]
    if beam_rows:
        lines += ["", f"Beam rows, k = {meta.get('num_beams')}, end-of-sequence honoured:", "", *_table(
            ["row"] + [header for header, _, _ in BEAM_COLUMNS],
            [[row["name"]] + [fmt(row[key], digits) for _, key, digits in BEAM_COLUMNS] for row in beam_rows],
        )]
    best = next((r["best_hf_assisted_row"] for r in report["rows"] if r["best_hf_assisted_row"]), None)
    lines += ["", f"Best HF assisted row: {best or '–'}; the run took {meta['duration_s']:.0f} s."]
    cost = meta.get("entropix_metrics_cost")
    if cost:
        lines.append(
            f"Entropix metrics: one cached target step {cost['step_ms']:.2f} ms without, "
            f"{cost['step_with_metrics_ms']:.2f} ms with them (+{100 * cost['cost']:.1f}%)."
        )
    return "\n".join(lines)


def bounds_tables(report: dict[str, Any]) -> str:
    """`specwire bounds --json`: the engine's costs and the best ratio to greedy each strategy allows."""
    target, batching = report["target"], report["batching"]
    costs = {int(n): ms for n, ms in target["forward_costs_ms"].items() if int(n) in BOUNDS_POSITIONS}
    fused = batching["fused_step_ms_by_rows"] is not None
    step_ms = batching["fused_step_ms_by_rows" if fused else "step_ms_by_rows"]
    where = f" on {report['device']}, {report['dtype']}" + (", compiled" if report["compiled"] else ", eager")
    lines = [
        provenance(report["metadata"]),
        "",
        f"{report['threads']} torch thread(s){where}; a token of a 16-token greedy round t_g = "
        f"{target['greedy_ms_per_token']:.3f} ms; a draft token t_d = {report['draft']['greedy_ms_per_token']:.3f} ms.",
        "",
        *_table(["new positions n", *map(str, costs)], [["target forward, ms", *(fmt(ms) for ms in costs.values())]]),
        "",
        *_table(
            ["decode step, 96 cached positions", *(f"{rows} row{'s' if str(rows) != '1' else ''}" for rows in step_ms)],
            [[("fused greedy steps" if fused else "one forward") + ", ms", *(fmt(ms, 3) for ms in step_ms.values())],
             ["streams ÷ one, at most", *map(fmt, batching["streams_vs_1_at_most"].values())],
             ["their p50 ÷ one stream's, at least", *map(fmt, batching["p50_latency_vs_1_at_least"].values())]],
        ),
        "",
        *_table(
            ["α", "best ratio to greedy", "at γ", "with a free draft", "the free draft at γ"],
            [[fmt(row["alpha"]), fmt(row["ratio_vs_greedy"]), str(row["best_gamma"]),
              fmt(row["free_draft_ratio_vs_greedy"]), str(row["free_draft_best_gamma"])] for row in report["speculative"]],
        ),
        "",
        *_streams_table(report.get("streams", {})),
        *_table(
            ["matrix product, weight", *(f"{rows} rows" for rows in report["matmul"][0]["times_one_row"] if rows != "1")],
            [[f"{p['shape'][0]} × {p['shape'][1]} ({p['weight_mib']:.0f} MiB), × one row's time",
              *(fmt(ratio) for rows, ratio in p["times_one_row"].items() if rows != "1")] for p in report["matmul"]],
        ),
    ]
    medusa = report.get("medusa")
    if medusa:
        nodes = medusa["shipped_heads_by_nodes"]
        lines += [
            "",
            *_table(
                ["Medusa tree nodes N", *nodes],
                [["expected accepted tokens E(N)", *(fmt(medusa["expected_accepted_by_nodes"][n]) for n in nodes)],
                 ["ratio to greedy, at most", *(fmt(ratio) for ratio in nodes.values())]],
            ),
            "",
            f"Perfect heads ({medusa['heads']}): at most {fmt(medusa['perfect_heads_ratio_vs_greedy'])}× greedy.",
        ]
    return "\n".join(lines)


def _streams_table(streams: dict[str, Any]) -> list[str]:
    """Speculation at S streams against S greedy streams, per α (`bounds.speculative_bound` at S streams)."""
    if not streams:
        return []
    header = ["α", *(f"{rows} streams: ratio to greedy (γ)" for rows in streams)]
    alphas = [row["alpha"] for row in next(iter(streams.values()))["speculative"]]
    rows = [[fmt(alpha), *(f"{fmt(bound['speculative'][i]['ratio_vs_greedy'])} ({bound['speculative'][i]['best_gamma']})"
                           for bound in streams.values())] for i, alpha in enumerate(alphas)]
    return [*_table(header, rows), ""]


def load(path: str | Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(Path(path).read_text())
    if str(report.get("metadata", {}).get("schema", "")).split("/")[0] not in ("specwire.bench", "specwire.bounds"):
        raise SystemExit(f"{path}: not a `specwire bench --json` or `specwire bounds --json` report (metadata.schema)")
    return report


def render_any(report: dict[str, Any], headline: bool = False) -> str:
    """The tables of a bench or a bounds report, by its schema."""
    if report["metadata"]["schema"].startswith("specwire.bounds/"):
        return bounds_tables(report)
    return render(report, headline)


def refresh(page: str, root: Path) -> str:
    """`page` with every generated block rendered anew from its JSON (paths relative to `root`)."""
    parser = build_parser()

    def render_block(match: re.Match[str]) -> str:
        args = parser.parse_args(shlex.split(match["args"]))
        if args.refresh or len(args.paths) != 1:
            raise SystemExit(f"<!-- specwire report {match['args']} -->: name one JSON report")
        body = render_any(load(root / args.paths[0]), args.headline)
        return f"{match[1]}{body}\n{match[4]}"

    return BLOCK.sub(render_block, page)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specwire report")
    parser.add_argument("paths", nargs="+", help="a `specwire bench --json` report; with --refresh, Markdown pages")
    parser.add_argument("--headline", action="store_true", help="the headline rows and figures only")
    parser.add_argument(
        "--refresh", action="store_true", help="rewrite the tables generated into these pages from their reports"
    )
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    return build_parser(subparsers.add_parser("report"))


def run(args: argparse.Namespace) -> int:
    if not args.refresh:
        if len(args.paths) != 1:
            raise SystemExit("specwire report: name one JSON report (or --refresh PAGE…)")
        print(render_any(load(args.paths[0]), args.headline))
        return 0
    for path in map(Path, args.paths):
        page = path.read_text()
        fresh = refresh(page, Path.cwd())
        if fresh != page:
            path.write_text(fresh)
            print(f"refreshed {path}")
    return 0


def emit(report: dict[str, Any], out: str | None, as_json: bool) -> bool:
    """A measuring command's JSON report: written to `out` (if given) and printed when `as_json`;
    whether it was printed (else the command prints its own summary)."""
    document = json.dumps(report, indent=2)
    if out:
        Path(out).write_text(document + "\n")
    if as_json:
        print(document)
    return as_json
