"""specwire's client SDK and command line.

    from specwire.client import Client
    result = Client("127.0.0.1:50051").generate(prompt="def add(a, b):", max_new_tokens=32)
    print(result.text, result.finish_reason, result.stats.new_tokens)
"""

from specwire.client.sdk import AsyncClient, BeamSequence, Client, GenerateResult, GenerationError, Stats, StreamDelta

__all__ = ["AsyncClient", "BeamSequence", "Client", "GenerateResult", "GenerationError", "Stats", "StreamDelta"]
