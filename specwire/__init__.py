"""specwire's shared core: wire codec, logits processing, model sessions, server bootstrap.

The service packages (`draft_service`, `target_service`, `orchestrator`) and the `client` stay
thin and import what they share from here.
"""

import os
from pathlib import Path

__version__ = "0.1.0"

# Compiled code is cached on disk for the next start, in a directory of our own. torch fixes its
# cache directory the first time anything asks for it, and importing transformers does, so this
# is set here, before any of specwire imports either.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "specwire" / "inductor"))
