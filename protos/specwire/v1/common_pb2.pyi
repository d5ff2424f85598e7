from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("queue_us", "compute_us", "forward_calls", "batch_rows", "batch_costs", "one_row_costs")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_COSTS_FIELD_NUMBER: _ClassVar[int]
    ONE_ROW_COSTS_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    compute_us: int
    forward_calls: int
    batch_rows: int
    batch_costs: _containers.RepeatedCompositeFieldContainer[ForwardCost]
    one_row_costs: _containers.RepeatedCompositeFieldContainer[ForwardCost]
    def __init__(self, queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., forward_calls: _Optional[int] = ..., batch_rows: _Optional[int] = ..., batch_costs: _Optional[_Iterable[_Union[ForwardCost, _Mapping]]] = ..., one_row_costs: _Optional[_Iterable[_Union[ForwardCost, _Mapping]]] = ...) -> None: ...

class ForwardCost(_message.Message):
    __slots__ = ("positions", "ms")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    positions: int
    ms: float
    def __init__(self, positions: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("traceparent", "tracestate")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    tracestate: str
    def __init__(self, traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class StartupTimes(_message.Message):
    __slots__ = ("serving_s", "phases")
    SERVING_S_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    serving_s: float
    phases: _containers.RepeatedCompositeFieldContainer[StartupPhase]
    def __init__(self, serving_s: _Optional[float] = ..., phases: _Optional[_Iterable[_Union[StartupPhase, _Mapping]]] = ...) -> None: ...

class StartupPhase(_message.Message):
    __slots__ = ("name", "seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    seconds: float
    def __init__(self, name: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
