"""What every service offers besides its API: health, reflection, Info."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from specwire.v1 import model_pb2, model_pb2_grpc

from specwire.engine import COST_POSITIONS
from tests.harness import LoopThread, Stack, start_model_server


def test_reflection_lists_the_services(llama_stack: Stack) -> None:
    for address, expected in (
        (llama_stack.target.address, "specwire.v1.ModelService"),
        (llama_stack.address, "specwire.v1.Orchestrator"),
    ):
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for s in next(replies).list_services_response.service}
        assert {expected, "grpc.health.v1.Health"} <= names


def test_info_describes_the_model(llama_stack: Stack) -> None:
    with grpc.insecure_channel(llama_stack.target.address) as channel:
        info = model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest())
    assert info.vocab_size == 320 and info.max_context == 512 and list(info.eos_token_ids) == [0]
    assert len(info.tokenizer_fingerprint) == 64 and info.role == "target" and "session" in info.capabilities
    assert info.device == "cpu" and info.dtype == "float32"
    # Timed at warm-up: a forward over more positions costs at least something, every point > 0.
    costs = [(cost.positions, cost.ms) for cost in info.forward_costs]
    assert [n for n, _ in costs] == list(COST_POSITIONS) and all(ms > 0 for _, ms in costs)
    assert info.decode_ms_per_token > 0


def test_health_is_not_serving_until_the_model_is_loaded(loop: LoopThread) -> None:
    server = loop.run(start_model_server(None))  # bound, model not loaded yet
    try:
        with grpc.insecure_channel(server.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as caught:
                model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest())
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        loop.run(server.running.server.stop(0))
