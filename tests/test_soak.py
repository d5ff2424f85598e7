"""`specwire soak`, short: steady concurrent streams of every strategy for ~20 s against real
processes, with a target replica pair; no errors, and no KV tokens held once the streams end."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from specwire.bench.soak import SoakConfig, parse_duration, run_soak


def test_a_short_soak_ends_with_no_errors_and_no_kv_tokens_held(llama_target_dir: Path, llama_draft_dir: Path) -> None:
    config = SoakConfig(
        duration_s=20, streams=4, interval_s=4, max_new_tokens=24, target_model=str(llama_target_dir),
        draft_model=str(llama_draft_dir), target_replicas=2, device="cpu",
    )
    report = run_soak(config)
    totals = report["totals"]
    assert totals["errors"] == 0, totals["error_messages"]
    assert totals["generations"] >= 8 and totals["tokens"] > 0
    assert len(report["samples"]) >= 4 and all(s["tokens_per_s"] > 0 for s in report["samples"])
    roles = {"orchestrator", "draft", "target", "target-2"}
    assert set(report["samples"][-1]["rss_mb"]) == roles
    assert all(mb and mb > 10 for mb in report["rss_end_mb"].values())
    assert set(report["after"]) == {"draft", "target", "target-2"}
    # While the streams ran, the services held KV tokens; after, none.
    assert any(s["held"]["target"]["kv_cache_tokens"] + s["held"]["target-2"]["kv_cache_tokens"] > 0 for s in report["samples"])
    for held in report["after"].values():
        assert held == {"kv_cache_tokens": 0.0, "active_sessions": 0.0}


def test_durations_parse_with_units() -> None:
    assert [parse_duration(t) for t in ("90", "30s", "10m", "1.5h")] == [90, 30, 600, 5400]
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number"):
        parse_duration("ten minutes")
