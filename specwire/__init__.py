"""specwire's shared core: wire codec, logits processing, model sessions, server bootstrap.

The service packages (`draft_service`, `target_service`, `orchestrator`) and the `client` stay
thin and import what they share from here.
"""

__version__ = "0.1.0"
