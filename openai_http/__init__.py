"""An OpenAI-compatible HTTP front over the orchestrator (`specwire serve http`, the `http` extra).

`/v1/completions`, `/v1/chat/completions` (with server-sent events), `/v1/models`, `/health`.
`protocol` translates OpenAI's requests, responses and errors to and from the Generate API;
`chat` renders messages with the model's chat template; `server` serves them.
"""
