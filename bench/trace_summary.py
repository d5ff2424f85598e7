"""`specwire trace summarize`: where each round's milliseconds went, from JSON-lines span files.

Input: the files `--trace-exporter file` writes (one span per line in the OpenTelemetry SDK's
JSON form), any number of them or directories of `*.jsonl` — typically the three files of
`specwire up --trace-dir DIR`. The orchestrator's `round` spans carry each round's breakdown,
measured without clock sync between hosts (DESIGN.md, principle 6):

- draft / target compute: what the services report doing (`ServerTiming.compute_us`);
- queue: what they report waiting for their forward-pass executor;
- network: client-measured time of each call minus the server's compute and queue;
- orchestrator: round wall time minus the time at least one call was outstanding.

Without parallel calls these five add up to the round's wall time. Rounds are grouped by trace
(one trace = one generation) and summarized separately for the prefill round (index 0) and the
decode rounds: median, p90, mean and share of the round's wall time for each part, and tokens
per round. The services' own spans are joined to the orchestrator's client spans by parent id,
as a check that one trace covers all three processes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from specwire.extras import require

# (key, label): the parts of a round, in stacking order.
PARTS: tuple[tuple[str, str], ...] = (
    ("draft", "draft compute"),
    ("target", "target compute"),
    ("queue", "queue (services)"),
    ("network", "network"),
    ("orchestrator", "orchestrator"),
)
GROUPS: tuple[tuple[str, str], ...] = (("prefill", "prefill (round 0)"), ("decode", "decode (rounds ≥ 1)"))


@dataclass(frozen=True)
class SpanRecord:
    """One span line, reduced to what the summary needs."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    service: str
    kind: str
    attributes: dict[str, Any]
    duration_ms: float


@dataclass(frozen=True)
class RoundRecord:
    trace_id: str
    index: int
    strategy: str
    parts_ms: dict[str, float]
    wall_ms: float
    tokens: float | None  # tokens the round decided, when known
    bytes: int
    accepted: int | None


@dataclass
class Summary:
    files: list[str]
    spans_by_service: dict[str, int]
    rounds: list[RoundRecord]
    traces: list[dict[str, Any]]
    groups: dict[str, dict[str, Any]]
    service_spans: int = 0
    service_spans_joined: int = 0
    skipped_lines: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "spans_by_service": self.spans_by_service,
            "rounds": len(self.rounds),
            "traces": self.traces,
            "groups": self.groups,
            "service_spans": self.service_spans,
            "service_spans_joined": self.service_spans_joined,
            "skipped_lines": self.skipped_lines,
        }


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _record(line: dict[str, Any]) -> SpanRecord:
    attributes = line.get("attributes") or {}
    resource = (line.get("resource") or {}).get("attributes") or {}
    service = attributes.get("specwire.service") or resource.get("service.name") or "unknown"
    duration = (_time(line["end_time"]) - _time(line["start_time"])).total_seconds() * 1e3
    return SpanRecord(
        name=line["name"],
        trace_id=line["context"]["trace_id"],
        span_id=line["context"]["span_id"],
        parent_id=line.get("parent_id"),
        service=str(service),
        kind=str(line.get("kind", "")),
        attributes=attributes,
        duration_ms=duration,
    )


def trace_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files named, with each directory replaced by the `*.jsonl` files in it."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(path.glob("*.jsonl"))
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such trace file or directory: {path}")
    return files


def load_spans(files: Sequence[Path]) -> tuple[list[SpanRecord], int]:
    """Every span in `files`, and the number of lines that were not spans (e.g. cut off)."""
    spans: list[SpanRecord] = []
    skipped = 0
    for path in files:
        with open(path, encoding="utf-8") as handle:
            for text in handle:
                if not text.strip():
                    continue
                try:
                    spans.append(_record(json.loads(text)))
                except (ValueError, KeyError, TypeError):
                    skipped += 1
    return spans, skipped


def _float(attributes: dict[str, Any], name: str) -> float:
    value = attributes.get(name)
    return float(value) if isinstance(value, (int, float)) else 0.0


def rounds_from_spans(spans: Sequence[SpanRecord]) -> list[RoundRecord]:
    """The orchestrator's round spans as breakdowns, ordered by trace and round index."""
    roots = {s.trace_id: s for s in spans if s.name == "generate" and s.service == "orchestrator"}
    rounds = []
    for span in spans:
        if span.name != "round" or span.service != "orchestrator":
            continue
        a = span.attributes
        parts = {
            "draft": _float(a, "specwire.round.draft.compute_ms"),
            "target": _float(a, "specwire.round.target.compute_ms"),
            "queue": _float(a, "specwire.round.draft.queue_ms") + _float(a, "specwire.round.target.queue_ms"),
            "network": _float(a, "specwire.round.draft.network_ms") + _float(a, "specwire.round.target.network_ms"),
            "orchestrator": _float(a, "specwire.round.orchestrator_ms"),
        }
        accepted = a.get("specwire.round.accepted")
        tokens: float | None = None
        if isinstance(a.get("specwire.round.tokens"), (int, float)):
            tokens = float(a["specwire.round.tokens"])
        elif isinstance(accepted, int):
            tokens = accepted + 1.0  # accepted drafts plus the correction or bonus token
        elif span.trace_id in roots:
            root = roots[span.trace_id].attributes
            if _float(root, "specwire.stats.rounds"):
                tokens = _float(root, "specwire.stats.new_tokens") / _float(root, "specwire.stats.rounds")
        rounds.append(
            RoundRecord(
                trace_id=span.trace_id,
                index=int(a.get("specwire.round.index", 0)),
                strategy=str(a.get("specwire.strategy", "")),
                parts_ms=parts,
                wall_ms=_float(a, "specwire.round.wall_ms") or span.duration_ms,
                tokens=tokens,
                bytes=int(_float(a, "specwire.round.bytes_sent") + _float(a, "specwire.round.bytes_received")),
                accepted=accepted if isinstance(accepted, int) else None,
            )
        )
    return sorted(rounds, key=lambda r: (r.trace_id, r.index))


def _describe(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"median": 0.0, "p90": 0.0, "mean": 0.0}
    array = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(array)), "p90": float(np.percentile(array, 90)), "mean": float(array.mean())}


def _group(rounds: Sequence[RoundRecord]) -> dict[str, Any]:
    wall = _describe([r.wall_ms for r in rounds])
    parts = {}
    for key, _ in PARTS:
        described = _describe([r.parts_ms[key] for r in rounds])
        described["share"] = described["mean"] / wall["mean"] if wall["mean"] else 0.0
        parts[key] = described
    tokens = [r.tokens for r in rounds if r.tokens is not None]
    return {
        "rounds": len(rounds),
        "parts_ms": parts,
        "wall_ms": wall,
        "tokens": _describe(tokens) if tokens else None,
        "bytes": _describe([float(r.bytes) for r in rounds]),
    }


def _traces(spans: Sequence[SpanRecord], rounds: Sequence[RoundRecord]) -> list[dict[str, Any]]:
    rounds_per_trace = Counter(r.trace_id for r in rounds)
    out = []
    for span in spans:
        if span.name != "generate" or span.service != "orchestrator":
            continue
        a = span.attributes
        count = rounds_per_trace.get(span.trace_id, 0)
        new_tokens = int(_float(a, "specwire.stats.new_tokens"))
        out.append({
            "trace_id": span.trace_id,
            "strategy": str(a.get("specwire.strategy", "")),
            "status": str(a.get("specwire.status", "")),
            "rounds": count,
            "new_tokens": new_tokens,
            "wall_ms": _float(a, "specwire.stats.wall_ms") or span.duration_ms,
            "orchestrator_ms": _float(a, "specwire.stats.orchestrator_ms"),
            "tokens_per_round": new_tokens / count if count else 0.0,
        })
    return out


def summarize(paths: Iterable[str | Path]) -> Summary:
    """Read the span files and break their rounds down."""
    files = trace_files(paths)
    spans, skipped = load_spans(files)
    rounds = rounds_from_spans(spans)
    groups = {
        "prefill": _group([r for r in rounds if r.index == 0]),
        "decode": _group([r for r in rounds if r.index > 0]),
    }
    # Services' spans joined to the orchestrator's client spans through their parent ids.
    clients = {s.span_id for s in spans if s.service == "orchestrator" and s.kind.endswith("CLIENT")}
    service_spans = [s for s in spans if s.service in ("draft", "target") and s.kind.endswith("SERVER")]
    summary = Summary(
        files=[str(f) for f in files],
        spans_by_service=dict(Counter(s.service for s in spans)),
        rounds=rounds,
        traces=_traces(spans, rounds),
        groups=groups,
        service_spans=len(service_spans),
        service_spans_joined=sum(1 for s in service_spans if s.parent_id in clients),
        skipped_lines=skipped,
    )
    if not rounds:
        summary.notes.append("no round spans found: pass the orchestrator's trace file")
    if skipped:
        summary.notes.append(f"{skipped} line(s) were not spans and were skipped")
    return summary


def format_summary(summary: Summary) -> str:
    """The breakdown as a plain-text table."""
    strategies = sorted({t["strategy"] for t in summary.traces}) or ["?"]
    services = ", ".join(f"{name} {count}" for name, count in sorted(summary.spans_by_service.items()))
    lines = [
        f"{len(summary.traces)} trace(s), {len(summary.rounds)} rounds, strategy {'/'.join(strategies)}; "
        f"spans: {services or 'none'}",
        f"service spans joined to the orchestrator's calls: {summary.service_spans_joined}/{summary.service_spans}",
        "",
    ]
    present = [(key, label) for key, label in GROUPS if summary.groups[key]["rounds"]]
    header = f"{'ms per round':<18}" + "".join(
        f"| {label + ', n=' + str(summary.groups[key]['rounds']):<33}" for key, label in present
    )
    columns = f"{'':<18}" + "".join(f"| {'median':>7} {'p90':>7} {'mean':>7} {'share':>6}  " for _ in present)
    lines += [header, columns, "-" * len(columns)]

    def row(label: str, stats: list[dict[str, float] | None], share: bool) -> str:
        cells = []
        for described in stats:
            if described is None:
                cells.append(f"| {'-':>7} {'-':>7} {'-':>7} {'':>6}  ")
                continue
            tail = f"{100 * described['share']:5.1f}%" if share else ""
            cells.append(f"| {described['median']:7.2f} {described['p90']:7.2f} {described['mean']:7.2f} {tail:>6}  ")
        return f"{label:<18}" + "".join(cells)

    for key, label in PARTS:
        lines.append(row(label, [summary.groups[g]["parts_ms"][key] for g, _ in present], True))
    lines.append(row("round wall", [summary.groups[g]["wall_ms"] for g, _ in present], False))
    lines.append(row("tokens / round", [summary.groups[g]["tokens"] for g, _ in present], False))
    kib = [{k: v / 1024 for k, v in summary.groups[g]["bytes"].items()} for g, _ in present]
    lines.append(row("KiB / round", list(kib), False))
    if summary.traces:
        lines += ["", f"{'trace':<10} {'strategy':<12} {'status':<8} {'rounds':>6} {'tokens':>6} {'wall ms':>9} "
                      f"{'orch ms':>8} {'tok/round':>9}"]
        for t in summary.traces:
            lines.append(
                f"{t['trace_id'][2:10]:<10} {t['strategy']:<12} {t['status']:<8} {t['rounds']:>6} {t['new_tokens']:>6} "
                f"{t['wall_ms']:>9.1f} {t['orchestrator_ms']:>8.1f} {t['tokens_per_round']:>9.2f}"
            )
    lines += [f"note: {note}" for note in summary.notes]
    return "\n".join(lines)


def plot_rounds(summary: Summary, path: str | Path, max_rounds: int = 200) -> None:
    """Stacked bars: for each round index, the median of each part over the traces."""
    matplotlib = require("matplotlib", "plots", "specwire trace summarize --plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_index: dict[int, list[RoundRecord]] = {}
    for record in summary.rounds:
        if record.index < max_rounds:
            by_index.setdefault(record.index, []).append(record)
    indices = sorted(by_index)
    figure, axes = plt.subplots(figsize=(max(6.0, min(16.0, 0.25 * len(indices) + 4)), 4.5))
    bottom = np.zeros(len(indices))
    for key, label in PARTS:
        heights = np.array([np.median([r.parts_ms[key] for r in by_index[i]]) for i in indices])
        axes.bar(indices, heights, bottom=bottom, label=label, width=0.8)
        bottom += heights
    traces = len({r.trace_id for r in summary.rounds})
    axes.set_xlabel("round (0 = prefill)")
    axes.set_ylabel(f"ms (median over {traces} trace{'s' if traces != 1 else ''})")
    axes.set_title("Where each round's time went")
    axes.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
