"""The latency model's formulas, and `specwire bench` / `specwire experiment` run end to end on tiny
models: every reported field present and consistent (not a speed test)."""

from __future__ import annotations

import argparse
import csv
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from specwire.bench import bench, bounds, experiment, report
from specwire.bench.bounds import medusa_bounds, speculative_bound
from specwire.client.cli import build_parser
from specwire.client.cli import main as specwire_main
from specwire.orchestrator.speedup import (
    alpha_estimate,
    best_gamma,
    expected_tokens_per_round,
    predicted_speedup,
    time_per_token_ms,
)

from tests.tiny import save_llama

ROOT = Path(__file__).resolve().parent.parent
REQUIRED_FIELDS = [
    "name",
    "tokens_per_s",
    "ratio_vs_hf_target",
    "ratio_vs_hf_assisted",
    "acceptance_rate",
    "tokens_per_target_forward",
    "cost_ratio_c",
    "predicted_speedup",
    "efficiency",
    "bytes_per_round",
    "overhead_ms_per_round",
    "expansions_per_generation",
    "expansions_ratio_vs_beam",
    "wall_ratio_vs_beam",
    "matches_beam",
]


# -- formulas ---------------------------------------------------------------------------------


def test_expected_tokens_per_round_matches_leviathan_eq1() -> None:
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)  # 3.3616
    # The geometric series it sums: 1 + α + … + α^γ.
    assert expected_tokens_per_round(0.6, 3) == pytest.approx(sum(0.6**k for k in range(4)))


def test_predicted_speedup_divides_by_round_cost() -> None:
    assert predicted_speedup(0.8, 4, 0.0) == pytest.approx(3.3616)
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert predicted_speedup(0.0, 4, 0.5) == pytest.approx(1 / 3)  # nothing accepted: pure overhead
    with pytest.raises(ValueError):
        predicted_speedup(1.5, 4, 0.1)


def test_time_per_token_and_best_gamma() -> None:
    # (γ t_d + t_v + RTT) / E[tokens per round]
    assert time_per_token_ms(2, 0.5, 1.0, 10.0, 4.0) == pytest.approx((2 + 10 + 4) / 1.75)
    assert best_gamma(0.0, 1.0, 10.0, 0.0) == 1  # nothing is ever accepted: the shortest round
    # A longer round trip makes each round dearer, so it pays to draft more per round.
    gammas = [best_gamma(0.8, 1.0, 10.0, rtt) for rtt in (0.0, 10.0, 50.0, 200.0)]
    assert gammas == sorted(gammas) and gammas[-1] > gammas[0]
    # Brute force agrees.
    brute = min(range(1, 33), key=lambda g: time_per_token_ms(g, 0.7, 2.0, 10.0, 20.0))
    assert best_gamma(0.7, 2.0, 10.0, 20.0) == brute


def test_alpha_estimate_counts_compared_tokens_only() -> None:
    # Rounds: accepted 4 of 4 (no rejection), accepted 1 then rejected: 5 successes, 1 failure.
    assert alpha_estimate(5, 1) == pytest.approx(5 / 6)
    assert alpha_estimate(0, 0) == 0.0


def test_fit_compute_separates_per_token_and_per_round_cost() -> None:
    # 3 ms per round plus 1.5 ms per drafted token, as a linear fit recovers it.
    fitted = experiment.fit_compute([1, 2, 4], [4.5, 6.0, 9.0])
    assert fitted is not None
    slope, intercept = fitted
    assert (slope, intercept) == (pytest.approx(1.5), pytest.approx(3.0))
    assert experiment.fit_compute([4, 4], [9.0, 9.5]) is None  # one γ: nothing to fit
    assert experiment.fit_compute([1, 2], [5.0, 4.0]) is None  # noise made it fall


pytest_plugins = ["tests.medusa_fixtures"]  # random heads for the Medusa rows


# -- bench ------------------------------------------------------------------------------------


def test_rows_that_draft_with_no_model_start_no_draft_model() -> None:
    """A target without a draft of its own (Gemma before `specwire pair`) benches its greedy rows:
    the draft service drafts n-grams in the target's tokenizer instead of loading a foreign draft,
    and the n-gram row runs on that stack rather than on a second copy of the target."""
    config = bench.BenchConfig(target_model="target", draft_model="draft", prompts=["x"])
    rows = {"specwire_greedy", "specwire_sample", "specwire_medusa", "specwire_speculative_ngram"}
    undrafted = bench.stack_configs(config, rows)
    assert set(undrafted) == {"model"}
    assert (undrafted["model"].drafter, undrafted["model"].draft_model) == ("ngram", "target")
    assert bench.row_stack("specwire_speculative_ngram", set(undrafted)) == "model"
    for row in ("specwire_speculative", "specwire_speculative_sampled", "specwire_entropix_speculative"):
        drafted = bench.stack_configs(config, {"specwire_greedy", row, "specwire_speculative_ngram"})
        assert (drafted["model"].drafter, drafted["model"].draft_model) == ("model", "draft")
        assert (drafted["ngram"].drafter, drafted["ngram"].draft_model) == ("ngram", "target")
        assert bench.row_stack("specwire_speculative_ngram", set(drafted)) == "ngram"


@pytest.fixture(scope="module")
def bench_report(llama_target_dir: Path, llama_draft_dir: Path, llama_heads_dir: Path) -> dict[str, Any]:
    config = bench.BenchConfig(
        target_model=str(llama_target_dir),
        draft_model=str(llama_draft_dir),
        prompts=["def add(a, b):\n", "x = [1, 2,"],
        max_new_tokens=8,
        repeats=1,
        device="cpu",
        dtype="float32",
        warmup=False,
        show_progress=False,
        medusa=str(llama_heads_dir),
        rows=BENCH_ROWS,
        concurrency=(1, 3),
    )
    return bench.run_bench(config)


# llama.cpp needs llama-cpp-python (a long native build) and a GGUF: its row has a test of its own.
BENCH_ROWS = tuple(name for name in bench.ROW_NAMES if name != "llamacpp")


def test_bench_reports_every_row_and_field(bench_report: dict[str, Any], llama_heads_dir: Path) -> None:
    rows = {row["name"]: row for row in bench_report["rows"]}
    assert list(rows) == list(BENCH_ROWS)
    for row in rows.values():
        assert row["error"] is None, (row["name"], row["error"])
        for name in REQUIRED_FIELDS:
            assert name in row, (row["name"], name)
        assert row["tokens_per_s"] > 0
        beam = row["group"] == bench.BEAM_GROUP  # beam rows end at eos
        assert row["new_tokens_per_repeat"] <= 16 if beam else row["new_tokens_per_repeat"] == 16  # 2 prompts × 8
    meta = bench_report["metadata"]
    assert (meta["prompts"], meta["max_new_tokens"], meta["repeats"], meta["gamma"]) == (2, 8, 1, 4)
    assert meta["machine"]["cpu_count"] and meta["parameters"]["target"] > meta["parameters"]["draft"] > 0
    assert meta["single_forward"]["target_forward_ms"] > 0 and meta["single_forward"]["cost_ratio_c_direct"] > 0
    assert meta["medusa"] == bench.home_as_tilde(str(llama_heads_dir))  # the heads the Medusa rows ran with
    assert f"the target's heads: `{meta['medusa']}`" in report.render(bench_report)
    json.dumps(bench_report)  # serialisable as is


def test_bench_figures_are_consistent(bench_report: dict[str, Any]) -> None:
    rows = {row["name"]: row for row in bench_report["rows"]}
    assert rows["hf_target"]["ratio_vs_hf_target"] == pytest.approx(1.0)
    best = rows["hf_target"]["best_hf_assisted_row"]
    assert rows[best]["ratio_vs_hf_assisted"] == pytest.approx(1.0)
    assert rows["hf_target"]["tokens_per_target_forward"] == pytest.approx(1.0)
    # Greedy everywhere but the sampled rows: every engine produces the target's own greedy tokens.
    for row in rows.values():
        if row["name"] == "specwire_speculative_sampled":
            continue
        compared = row["group"] not in ("specwire_sampled", "specwire_medusa_sampled", bench.BEAM_GROUP)
        assert row["matches_hf_target"] == (1.0 if compared else None), row["name"]
    assert rows["specwire_speculative_sampled"]["bytes_per_round"] > 0
    cost = bench_report["metadata"]["entropix_metrics_cost"]
    assert cost["step_ms"] > 0 and cost["step_with_metrics_ms"] > 0
    medusa = rows["specwire_medusa"]
    assert 0.0 <= medusa["acceptance_rate"] <= 1.0 and medusa["tokens_per_target_forward"] >= 1.0
    assert medusa["predicted_speedup"] is None  # the chain model does not describe a tree
    # Not a speculative row: no speculation figures; transformers rows have no wire.
    for name in ("hf_target", "specwire_greedy"):
        assert rows[name]["acceptance_rate"] is None and rows[name]["predicted_speedup"] is None
    assert rows["hf_assisted_constant"]["bytes_per_round"] is None
    # The fixed-γ row always speculates; auto γ may plan every round target-only (no figures).
    auto = rows["specwire_speculative"]
    assert auto["acceptance_rate"] is None or 0.0 <= auto["acceptance_rate"] <= 1.0
    spec = rows["specwire_speculative_sequential"]
    assert 0.0 <= spec["acceptance_rate"] <= 1.0 and spec["cost_ratio_c"] > 0
    assert spec["predicted_speedup"] == pytest.approx(
        predicted_speedup(spec["alpha"], spec["gamma"], spec["cost_ratio_c"])
    )
    assert spec["efficiency"] == pytest.approx(spec["measured_speedup"] / spec["predicted_speedup"])
    assert spec["bytes_per_round"] > 0 and spec["overhead_ms_per_round"] >= 0
    assert rows["specwire_greedy"]["bytes_per_round"] > 0
    # Beam rows: best-first's result is beam's; beam scores num_beams rows in every forward.
    beam, best_first = rows["specwire_beam"], rows["specwire_best_first_beam"]
    assert beam["expansions_per_generation"] == 4 * beam["target_forwards_per_generation"]
    assert beam["matches_beam"] is None and best_first["matches_beam"] == 1.0
    assert best_first["expansions_ratio_vs_beam"] == pytest.approx(
        best_first["expansions_per_generation"] / beam["expansions_per_generation"]
    )
    assert best_first["wall_ratio_vs_beam"] > 0 and best_first["ratio_vs_hf_target"] is None
    assert all(row["expansions_per_generation"] is None for row in rows.values() if row["group"] != bench.BEAM_GROUP)
    assert rows["specwire_speculative_sequential"]["pipelined_round_share"] == 0.0
    # A fixed γ never falls back; only a last round with nothing left to draft is target-only.
    assert rows["specwire_speculative_sequential"]["speculation_off_rounds_per_generation"] <= 1.0
    for name in ("specwire_speculative", "specwire_speculative_ngram", "specwire_greedy"):
        row = rows[name]
        assert row["ratio_vs_hf_target"] == pytest.approx(row["tokens_per_s"] / rows["hf_target"]["tokens_per_s"])


def test_bench_markdown_and_cli_output(bench_report: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    table = report.render(bench_report)
    assert all(f"| {name} |" in table for name in BENCH_ROWS)
    monkeypatch.setattr(bench, "run_bench", lambda config: bench_report)
    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--json", "--out", str(out), "--repeats", "1"])
    assert bench.run(args) == 0
    assert json.loads(out.read_text())["rows"][0]["name"] == "hf_target"
    assert "| hf_target |" in capsys.readouterr().out
    assert specwire_main(["report", str(out), "--headline"]) == 0
    assert "| specwire_speculative |" in capsys.readouterr().out


def test_concurrent_streams_cover_every_prompt_and_equal_their_solo_runs(bench_report: dict[str, Any]) -> None:
    entries = [(entry["strategy"], entry["streams"]) for entry in bench_report["concurrency"]]
    assert entries == [("greedy", 1), ("greedy", 3), ("speculative", 1), ("speculative", 3),
                       ("speculative_model", 1), ("speculative_model", 3),
                       ("speculative_ngram", 1), ("speculative_ngram", 3), ("medusa", 1), ("medusa", 3)]
    for entry in bench_report["concurrency"]:
        assert entry["matches_solo"] == 1.0 and entry["aggregate_tokens_per_s"] > 0, entry
        assert entry["tokens_per_target_forward"] > 0 and 0.0 <= entry["off_round_share"] <= 1.0, entry
        if entry["strategy"] == "greedy":
            assert entry["off_round_share"] == 0.0 and entry["ratio_vs_greedy"] is None, entry
        else:  # paired with greedy's rate at as many streams; one repeat: the ratio of the two
            greedy = next(e for e in bench_report["concurrency"] if e["strategy"] == "greedy" and e["streams"] == entry["streams"])
            assert entry["ratio_vs_greedy"] == pytest.approx(entry["aggregate_tokens_per_s"] / greedy["aggregate_tokens_per_s"])


def test_bench_records_its_command_date_and_machine(bench_report: dict[str, Any]) -> None:
    meta = bench_report["metadata"]
    assert datetime.fromisoformat(meta["date"]).tzinfo is not None
    assert meta["machine"]["description"].startswith(f"{meta['machine']['cpu_count']} CPUs (")
    parser = build_parser()
    args = parser.parse_args(["bench", "--repeats", "2"])
    assert args.command_line is None  # set by `specwire`'s main from its argv, as typed
    assert "log_dir" not in meta  # a temporary folder of the machine that ran it: printed, not recorded


# The tables' headers and the JSON fields they show, written out here independently of the renderer.
ROW_COLUMNS = {
    "× HF target": "ratio_vs_hf_target", "× best HF assisted": "ratio_vs_hf_assisted", "acceptance": "acceptance_rate",
    "α": "alpha", "tok/target fwd": "tokens_per_target_forward", "c": "cost_ratio_c", "predicted": "predicted_speedup",
    "efficiency": "efficiency", "bytes/round": "bytes_per_round", "overhead ms/round": "overhead_ms_per_round",
    "= HF target": "matches_hf_target",
}
BEAM_COLUMNS = {
    "target rows scored / generation": "expansions_per_generation", "target forwards / generation":
    "target_forwards_per_generation", "rows × beam": "expansions_ratio_vs_beam", "wall × beam": "wall_ratio_vs_beam",
    "= beam": "matches_beam",
}
STREAM_COLUMNS = {
    "aggregate tok/s": "aggregate_tokens_per_s", "× one stream": "ratio_vs_one_stream", "× greedy": "ratio_vs_greedy",
    "p50 ms/token": "p50_token_ms",
    "p99 ms/token": "p99_token_ms", "p50 × one stream": "p50_ratio_vs_one_stream", "= solo": "matches_solo",
}


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Each Markdown table of `text` as a list of {header: cell} rows."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif block:
            tables.append([dict(zip(block[0], cells, strict=True)) for cells in block[2:]])
            block = []
    return tables


def assert_cell_shows(cell: str, value: float | None) -> None:
    """The cell is the value rounded to the decimals it shows, or `–` where there is none."""
    if value is None:
        assert cell == "–"
        return
    decimals = len(cell.partition(".")[2])
    assert abs(float(cell) - value) <= 0.5 * 10**-decimals + 1e-9, (cell, value)


def assert_tables_agree(rendered: str, data: dict[str, Any], headline: bool) -> None:
    tables = markdown_tables(rendered)
    rows = {row["name"]: row for row in data["rows"]}
    shown = tables[0]
    if headline:
        assert [cells["row"] for cells in shown] == [name for name in rows if name in report.HEADLINE_ROWS]
    else:
        assert [cells["row"] for cells in shown] == list(rows)
    for cells in shown:
        row = rows[cells["row"]]
        median, spread = cells["tok/s median [min–max]"].split(" ", 1)
        low, high = spread.strip("[]").split("–")
        for text, key in ((median, "tokens_per_s"), (low, "tokens_per_s_min"), (high, "tokens_per_s_max")):
            assert_cell_shows(text, row[key])
        for header, key in ROW_COLUMNS.items():
            if header in cells:
                assert_cell_shows(cells[header], row[key])
            else:
                assert headline
        if headline:
            assert cells["what it runs"] == row["description"]
    beams = [row for row in data["rows"] if row["group"] == "specwire_beam" and not row["error"]]
    if beams and not headline:
        shown_beams = next(table for table in tables if "= beam" in table[0])
        assert [cells["row"] for cells in shown_beams] == [row["name"] for row in beams]
        for cells, row in zip(shown_beams, beams, strict=True):
            for header, key in BEAM_COLUMNS.items():
                assert_cell_shows(cells[header], row[key])
    if data.get("concurrency") and not headline:
        for cells, entry in zip(tables[1], data["concurrency"], strict=True):
            assert (cells["strategy"], int(cells["streams"])) == (entry["strategy"], entry["streams"])
            for header, key in STREAM_COLUMNS.items():
                assert_cell_shows(cells[header], entry.get(key))
    meta = data["metadata"]
    assert rendered.startswith(f"Measured {meta['date'][:10]} on {meta['machine']['description']}")
    threads = meta["machine"]["omp_num_threads_env"]
    environment = f"OMP_NUM_THREADS={threads} " if threads else ""
    recorded = f"with `{environment}{meta['command']}`" if meta["command"] else "with a command not recorded"
    assert recorded in rendered.splitlines()[0]


@pytest.mark.parametrize("headline", [False, True], ids=["full", "headline"])
def test_report_tables_agree_with_the_json(bench_report: dict[str, Any], headline: bool) -> None:
    assert_tables_agree(report.render(bench_report, headline), bench_report, headline)
    for path in sorted((ROOT / "docs" / "bench").glob("*.json")):  # the reports the documentation shows
        data = report.load(path)
        if data["metadata"]["schema"] == bounds.SCHEMA:
            assert_bounds_tables_agree(data)
        else:
            assert_tables_agree(report.render(data, headline), data, headline)


def test_bench_rtt_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    assert bench.config_from_args(parser.parse_args(["bench", "--rtt-ms", "10"])).rtt_ms == 10.0
    with pytest.raises(SystemExit, match="--rtt-ms"):
        bench.config_from_args(parser.parse_args(["bench", "--rtt-ms", "-1"]))


def test_bench_reports_a_failing_row_instead_of_crashing() -> None:
    specs = {row.name: row for row in bench.ROWS}
    results = {name: bench.RowResult(specs[name]) for name in ("hf_target", "specwire_speculative")}
    results["hf_target"].samples = [[bench.Sample(token_ids=[1, 2], seconds=0.1)]]
    results["specwire_speculative"].error = "INVALID_ARGUMENT: strategy 'speculative' is not available"
    rows = {row["name"]: row for row in bench.summarize(results)}
    failed = rows["specwire_speculative"]
    assert failed["error"] and failed["tokens_per_s"] is None and failed["ratio_vs_hf_target"] is None
    assert rows["hf_target"]["tokens_per_s"] == pytest.approx(20.0)


# -- experiment -------------------------------------------------------------------------------


def test_experiment_writes_csv_and_plots_through_delay_proxies(
    llama_target_dir: Path, llama_draft_dir: Path, tmp_path: Path
) -> None:
    rtt = 6.0
    config = experiment.ExperimentConfig(
        target_model=str(llama_target_dir),
        draft_model=str(llama_draft_dir),
        prompts=["def add(a, b):\n"],
        out_dir=tmp_path / "exp",
        rtts_ms=(rtt,),
        gammas=(1, 2),
        max_new_tokens=6,
        device="cpu",
        dtype="float32",
        show_progress=False,
    )
    summary = experiment.run_experiment(config)
    with (config.out_dir / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["strategy"], r["gamma"]) for r in rows] == [
        ("greedy", ""), ("speculative", "1"), ("speculative", "2"), ("auto", "")
    ]
    for row in rows:
        assert float(row["tokens_per_s"]) > 0 and int(row["new_tokens"]) == 6
        assert float(row["matches_greedy"]) == 1.0
        # Sequential speculative rounds visit both services, one after the other: RTT each time;
        # greedy visits the target alone, and so do auto γ's pipelined and target-only rounds.
        trips = 2 if row["strategy"] == "speculative" else 1
        assert float(row["network_ms_per_round"]) >= 0.8 * trips * rtt
        if row["strategy"] == "speculative":
            assert float(row["t_d_ms"]) > 0 and float(row["t_v_ms"]) > 0 and row["predicted_tokens_per_s"]
    best = summary["best_gamma"][0]
    assert best["gamma_best_measured"] in (1, 2) and 1 <= best["gamma_star_model"] <= config.max_gamma
    assert best["auto_vs_best_fixed"] > 0
    for name in ("tokens_per_s_vs_rtt.png", "best_gamma.png", "round_breakdown.png", "best_gamma.csv", "summary.json"):
        assert (config.out_dir / name).stat().st_size > 0
    assert math.isfinite(summary["alpha_pooled"])


def test_bounds_follow_the_latency_model_and_the_tree_sizes() -> None:
    """`specwire bounds`: with a verification as cheap as a decode step (a GPU-like curve) and a
    free draft, α = 0.9 pays the most at the largest γ; a curve that grows with its positions
    caps both speculation and Medusa below what perfect heads would give on the flat one."""
    flat = [(1, 1.0), (65, 1.0)]
    row = speculative_bound(0.9, 1.0, 0.0, flat)
    assert row["free_draft_best_gamma"] == 16
    assert row["free_draft_ratio_vs_greedy"] == pytest.approx(expected_tokens_per_round(0.9, 16))
    growing = [(1, 1.0), (65, 65.0)]  # every position costs a decode step: nothing can win
    assert speculative_bound(0.9, 1.0, 0.0, growing)["free_draft_ratio_vs_greedy"] <= 1.0
    medusa = medusa_bounds(1.0, flat, heads=3, expected={4: 0.8, 24: 1.5})
    assert medusa["perfect_heads_ratio_vs_greedy"] == pytest.approx(4.0)  # 3 accepted + 1 a forward
    assert medusa["shipped_heads_ratio_vs_greedy"] == pytest.approx(2.5)
    assert medusa_bounds(1.0, growing, 3, {4: 0.8})["perfect_heads_ratio_vs_greedy"] == pytest.approx(1.0)
    # S streams: a verification of S rows × (γ + 1) costing (γ + 1) steps (compute-bound) never pays;
    # one costing a step pays E(α, γ) with a free draft, less a draft step per token.
    compute_bound = [(w, float(w)) for w in (2, 3, 5)]
    assert speculative_bound(0.9, 1.0, 0.0, compute_bound, (1, 2, 4))["free_draft_ratio_vs_greedy"] <= 1.0
    cheap = speculative_bound(0.8, 1.0, 0.1, [(2, 1.0), (5, 1.0)], (1, 4))
    assert cheap["free_draft_best_gamma"] == 4
    assert cheap["free_draft_ratio_vs_greedy"] == pytest.approx(expected_tokens_per_round(0.8, 4))
    assert cheap["ratio_vs_greedy"] == pytest.approx(expected_tokens_per_round(0.8, 4) / 1.4)


def test_bounds_times_the_engine_and_reports_consistent_ratios(llama_target_dir: Path, llama_draft_dir: Path) -> None:
    """`specwire bounds` end to end on tiny models (eager here: the suite does not compile)."""
    args = argparse.Namespace(
        target_model=str(llama_target_dir), draft_model=str(llama_draft_dir), medusa="", medusa_prompts=1,
        threads=1, repeats=2, quantize="none", target_shape=None, draft_shape=None, device="cpu", dtype="float32",
        compile="off", streams=[8, 3], positions=bounds.positions_list("16,3,5"),
    )
    measured = bounds.measure(args)
    assert measured["quantization"] == {"target": "none", "draft": "none"}
    assert (measured["device"], measured["dtype"], measured["compiled"]) == ("cpu", "float32", False)
    costs = measured["target"]["forward_costs_ms"]
    assert list(costs) == [1, 3, 5, 16] and all(ms > 0 for ms in costs.values())
    assert measured["target"]["greedy_ms_per_token"] > 0 and measured["draft"]["greedy_ms_per_token"] > 0
    batching = measured["batching"]
    assert batching["fused_step_ms_by_rows"] is None  # no compiled fused steps when eager
    step_ms = batching["step_ms_by_rows"]
    assert list(step_ms) == [1, 3, 8] and all(ms > 0 for ms in step_ms.values())
    for rows, ms in step_ms.items():
        assert batching["streams_vs_1_at_most"][rows] == pytest.approx(rows * step_ms[1] / ms)
        assert batching["p50_latency_vs_1_at_least"][rows] == pytest.approx(rows / batching["streams_vs_1_at_most"][rows])
    for row in measured["speculative"]:  # a free draft can only do better
        assert 0 < row["ratio_vs_greedy"] <= row["free_draft_ratio_vs_greedy"]
    assert list(measured["streams"]) == [3, 8]
    for rows, bound in measured["streams"].items():
        verify = bound["verify_ms_by_positions"]
        assert list(verify) == [gamma + 1 for gamma in bounds.STREAM_GAMMAS] and all(ms > 0 for ms in verify.values())
        assert bound["draft_step_ms"] > 0
        for row in bound["speculative"]:
            assert row == speculative_bound(row["alpha"], step_ms[rows], bound["draft_step_ms"], list(verify.items()),
                                            bounds.STREAM_GAMMAS)
            assert 0 < row["ratio_vs_greedy"] <= row["free_draft_ratio_vs_greedy"]
    assert [product["times_one_row"][1] for product in measured["matmul"]] == [1.0] * len(bounds.MATMUL_SHAPES)
    assert "medusa" not in measured
    assert_bounds_tables_agree(json.loads(json.dumps(measured)))  # as `specwire bounds --out` writes it


def test_a_published_shape_gets_its_sizes_and_random_weights_the_engine_serves() -> None:
    """`--target-shape`: the model has the shape's published sizes, and the batched engine runs it."""
    import torch
    from specwire.bench.shapes import SHAPES, random_lm

    from specwire.engine import Engine, EngineLimits

    lm = random_lm("gemma-draft", "cpu", torch.float32)
    config = lm.model.config
    for field, value in SHAPES["gemma-draft"].items():
        assert getattr(config, field) == value, field
    engine = Engine(lm, "draft", EngineLimits(max_batch_rows=2, max_cache_len=128, compile="off"))
    assert engine.scheduler is not None
    single, fused = engine.scheduler.time_decode_step(2, start=8, repeats=2)
    assert single > 0 and fused is None
    with pytest.raises(ValueError, match="shape must be one of"):
        random_lm("llama-9t", "cpu", torch.float32)


def assert_bounds_tables_agree(data: dict[str, Any]) -> None:
    tables = markdown_tables(report.render_any(data))
    forward, step, speculative = tables[:3]
    if data.get("streams"):
        streams, matmul = tables[3:5]
        for i, cells in enumerate(streams):
            for rows, bound in data["streams"].items():
                row = bound["speculative"][i]
                assert_cell_shows(cells["α"], row["alpha"])
                shown, gamma = cells[f"{rows} streams: ratio to greedy (γ)"].split()
                assert_cell_shows(shown, row["ratio_vs_greedy"])
                assert gamma == f"({row['best_gamma']})"
    else:
        matmul = tables[3]
    shown = forward[0]
    assert shown["new positions n"] == "target forward, ms"
    for n, ms in data["target"]["forward_costs_ms"].items():
        if int(n) in report.BOUNDS_POSITIONS:
            assert_cell_shows(shown[n], ms)
        else:
            assert n not in shown
    batching = data["batching"]
    for cells, key in zip(step, ("step_ms_by_rows", "streams_vs_1_at_most", "p50_latency_vs_1_at_least"), strict=True):
        for rows, value in batching[key].items():
            assert_cell_shows(cells[f"{rows} row" + ("s" if rows != "1" else "")], value)
    for cells, row in zip(speculative, data["speculative"], strict=True):
        assert_cell_shows(cells["α"], row["alpha"])
        assert_cell_shows(cells["best ratio to greedy"], row["ratio_vs_greedy"])
        assert_cell_shows(cells["with a free draft"], row["free_draft_ratio_vs_greedy"])
        assert (int(cells["at γ"]), int(cells["the free draft at γ"])) == (row["best_gamma"], row["free_draft_best_gamma"])
    for cells, product in zip(matmul, data["matmul"], strict=True):
        assert cells["matrix product, weight"].startswith(f"{product['shape'][0]} × {product['shape'][1]} ")
        for rows, ratio in product["times_one_row"].items():
            if rows != "1":
                assert_cell_shows(cells[f"{rows} rows"], ratio)


def test_llamacpp_row_runs_the_targets_gguf(models_dir: Path, tokenizer: Any) -> None:
    """llama.cpp on the same weights as a GGUF file: the same greedy tokens as transformers'."""
    pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM

    from tests.gguf_tiny import write_llama_gguf

    source = models_dir / "llamacpp-source"
    if not source.exists():
        save_llama(source, tokenizer, seed=5)
    gguf = write_llama_gguf(AutoModelForCausalLM.from_pretrained(source), tokenizer, source / "gguf" / "tiny.gguf")
    assert bench.llamacpp.find_gguf(str(source)) == gguf
    report = bench.run_bench(bench.BenchConfig(
        target_model=str(source), draft_model=str(source), prompts=["def add(a, b):\n"], max_new_tokens=8,
        repeats=1, device="cpu", dtype="float32", warmup=False, show_progress=False,
        rows=("hf_target", "llamacpp"), target_threads=1,
    ))
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["llamacpp"]["error"] is None and rows["llamacpp"]["new_tokens_per_repeat"] == 8
    assert rows["llamacpp"]["ratio_vs_hf_target"] > 0 and report["metadata"]["llamacpp_gguf"] == str(gguf)
    assert rows["llamacpp"]["matches_hf_target"] == 1.0


def test_a_llamacpp_probe_that_dies_names_how() -> None:
    """The llamacpp row's probe runs in a child process: a native crash (llama.cpp built with AMX
    on a CPU that has it dies of SIGILL or SIGSEGV) becomes the row's error, not the bench's end."""
    import sys

    from specwire.bench import llamacpp

    python = sys.executable
    assert llamacpp.child_failure([python, "-c", "pass"]) is None
    killed = llamacpp.child_failure([python, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    assert killed is not None and "killed by SIGILL" in killed and "AMX" in killed
    failed = llamacpp.child_failure([python, "-c", "raise SystemExit('no model here')"])
    assert failed is not None and "exit status 1: no model here" in failed


def test_a_targets_own_pair_supplies_the_bench_draft_and_medusa_heads(tmp_path: Path) -> None:
    """`specwire pair` leaves DIR/draft, DIR/medusa and DIR/feature-drafter: the bench takes them
    without flags, the feature drafter before the Medusa heads."""
    from specwire.demo import demo_medusa_dir, demo_target_dir

    target = tmp_path / "target"
    (target / "draft").mkdir(parents=True)
    (target / "medusa").mkdir()
    assert bench._default_medusa(str(target)) is None  # no heads saved there
    assert bench.default_models(str(target), None)[1] != str(target / "draft")
    (target / "draft" / "config.json").write_text("{}")
    (target / "medusa" / "medusa_config.json").write_text("{}")
    assert bench.default_models(str(target), None) == (str(target), str(target / "draft"))
    assert bench._default_medusa(str(target)) == str(target / "medusa")
    (target / "feature-drafter").mkdir()
    (target / "feature-drafter" / "feature_drafter_config.json").write_text("{}")
    assert bench._default_medusa(str(target)) == str(target / "feature-drafter")  # drafts more a round
    assert bench._default_medusa(str(demo_target_dir())) == str(demo_medusa_dir())
