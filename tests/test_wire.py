"""The wire codec: tensors round-trip bit for bit; generated modules match the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from specwire.v1 import common_pb2

from specwire import wire
from specwire.processing import ProcessingConfig
from specwire.session import OpenRequest, ScoreKind, Scores, Scoring, ServerTiming, StepRequest, StepResult

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool])
def test_tensor_round_trip_is_exact(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    tensor = (torch.randn(3, 5, generator=generator) * 100).to(dtype)
    decoded = wire.tensor_from_pb(wire.tensor_to_pb(tensor))
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_tensor_bytes_are_raw_little_endian() -> None:
    message = wire.tensor_to_pb(torch.tensor([1.0, -2.0], dtype=torch.float32))
    assert message.dtype == "float32" and list(message.shape) == [2]
    assert message.data == b"\x00\x00\x80\x3f\x00\x00\x00\xc0"


def test_malformed_tensor_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs 16"):
        wire.tensor_from_pb(common_pb2.Tensor(dtype="float32", shape=[4], data=b"\x00" * 12))
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        wire.tensor_from_pb(common_pb2.Tensor(dtype="float8", shape=[1], data=b"\x00"))


def test_session_messages_round_trip() -> None:
    config = ProcessingConfig(repetition_penalty=1.25, no_repeat_ngram_size=3, temperature=0.75, top_k=5, top_p=0.875)
    # (float32 fields: values exactly representable so equality is exact)
    opened = OpenRequest([1, 2, 3], config, 2, Scoring(ScoreKind.LOGPROBS, 1, 8), {"traceparent": "00-ab-cd-01"})
    assert wire.open_from_pb(wire.open_to_pb(opened).open) == opened
    step = StepRequest(keep_tokens=5, branch_order=[1, 1], append_ids=[4, 5], scoring=Scoring(ScoreKind.PROBS, 2), propose=3, propose_seed=9)
    assert wire.step_from_pb(wire.step_to_pb(step).step) == step
    assert wire.step_from_pb(wire.step_to_pb(StepRequest()).step).keep_tokens is None
    result = StepResult(
        scores=Scores(ScoreKind.PROBS, sparse_ids=torch.tensor([[3, -1]], dtype=torch.int32), sparse_values=torch.tensor([[1.0, 0.0]])),
        proposed_ids=torch.tensor([[7, 8]], dtype=torch.int32),
        num_tokens=12,
        timing=ServerTiming(queue_us=3, compute_us=40, forward_calls=2, batch_rows=8,
                            batch_costs=[(1, 9.5), (5, 20.25)], one_row_costs=[(1, 2.5), (5, 3.5)]),
    )
    back = wire.result_from_pb(wire.result_to_pb(result))
    assert back.num_tokens == 12 and back.timing == result.timing
    assert back.scores is not None and torch.equal(back.scores.to_dense(5, 0.0), torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]]))
    assert back.proposed_ids is not None and back.proposed_ids.tolist() == [[7, 8]]


def test_generated_modules_match_the_proto_files(tmp_path: Path) -> None:
    package = Path("specwire") / "v1"
    protos = sorted((package / p.name).as_posix() for p in (ROOT / "protos" / package).glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", *protos],
        cwd=ROOT / "protos", check=True,
    )
    generated = sorted((tmp_path / package).iterdir())
    assert generated, "protoc generated nothing"
    for path in generated:
        committed = ROOT / "protos" / package / path.name
        assert committed.exists(), f"{path.name} is generated but not committed: run `make protos`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} drifted from its .proto: run `make protos`"
