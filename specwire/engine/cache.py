"""One preallocated KV cache per model service, in rows that sessions own.

Keys and values live in one tensor per layer and kind, `[rows + 1, kv_heads, max_len + SLACK,
head_dim]`: separate tensors, so compiled code writes a layer's slots in place (a write into a
view of one all-layer tensor makes `torch.compile` copy the whole cache on every step). The
extra row and positions are scratch space for a batch's padding: a padded forward writes every
token it computes, so no write depends on the data (which compiled code wants).
A session owns one row per branch; a row's *length* says how many leading positions hold valid
keys, so truncation is a length change. Fork and reorder copy rows. Rows return to the pool when
the session closes, however its stream ended. When no row is free, a caller waits — bounded by
the queue limit and its deadline — and then gets `ResourceExhausted` naming the limit.

Prefix caching: a row released with the tokens it holds keeps its keys until a row is needed
(least recently released first). A session that opens with a prompt beginning with those tokens
gets them copied into a free row, or takes the kept row itself when none is free, and computes
only the rest; vLLM's automatic prefix caching and SGLang's radix cache do the same per block of
tokens. The engine keeps keys only where its forward is row-invariant: there a reused key has the
bits a prefill would write.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specwire.errors import ResourceExhausted
from specwire.session import CacheUsage

SLACK = 64  # positions past max_len a padding token may be written to; longer jobs never pad
# A kept row is taken for a shorter shared prefix than this only when no row is free.
MIN_REUSE = 16


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    rows: int
    max_len: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position of one row, over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_row(self) -> int:
        return self.bytes_per_token * (self.max_len + SLACK)

    @property
    def bytes(self) -> int:
        """All rows and the scratch row."""
        return self.bytes_per_row * (self.rows + 1)


class SlotCache:
    """Keys, values and per-row lengths; the row pool is guarded by one condition."""

    def __init__(
        self, shape: CacheShape, device: torch.device, max_waiting: int = 64, prefix_cache: bool = True
    ) -> None:
        self.shape = shape
        self.device = device
        size = (shape.rows + 1, shape.kv_heads, shape.max_len + SLACK, shape.head_dim)
        self.scratch_row = shape.rows  # padding rows of a batch read and write here
        # Zeros, not garbage: a padded slot is masked out of attention, but 0 × NaN would not be.
        self.keys = [torch.zeros(size, dtype=shape.dtype, device=device) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, dtype=shape.dtype, device=device) for _ in range(shape.layers)]
        self.lengths = [0] * (shape.rows + 1)
        self._free = list(range(shape.rows - 1, -1, -1))  # pop() hands out low rows first
        # Released rows whose keys stay (prefix caching): row → the tokens at its first positions,
        # least recently released first. They count as free.
        self.prefix_cache = prefix_cache
        self._kept: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.reused_tokens = 0  # positions sessions found cached, since the start
        self._changed = threading.Condition()
        self._waiting = 0
        self.max_waiting = max_waiting

    # -- the row pool ----------------------------------------------------------------------

    def allocate(
        self, count: int, timeout_s: float | None, cancelled: Callable[[], bool] = lambda: False,
        prompt: Sequence[int] = (),
    ) -> list[int]:
        """`count` rows, waiting at most `timeout_s` (None: the default wait) for others to free,
        and no longer than `cancelled()` stays False (the caller's stream ended). With `prompt`,
        the first row is the kept row holding the longest prefix of it, where one holds at least
        MIN_REUSE tokens (or any, when no row is free): a free row with a copy of those keys, or
        the kept row itself where no row is free. Its length says how many; the other rows are
        empty."""
        if count > self.shape.rows:
            raise ResourceExhausted(f"cache rows: {count} wanted, the cache has {self.shape.rows} (--max-batch-rows)")
        deadline = time.monotonic() + (30.0 if timeout_s is None else max(0.0, timeout_s))
        with self._changed:
            if self._available() < count:
                if self._waiting >= self.max_waiting:
                    raise ResourceExhausted(
                        f"cache rows: all {self.shape.rows} in use and {self._waiting} sessions already waiting "
                        "(--max-batch-rows, --max-queued-sessions)"
                    )
                self._waiting += 1
                try:
                    while self._available() < count:
                        left = deadline - time.monotonic()
                        if left <= 0 or cancelled():
                            raise ResourceExhausted(
                                f"cache rows: {count} wanted, {self._available()} of {self.shape.rows} free "
                                "before the deadline (--max-batch-rows)"
                            )
                        self._changed.wait(min(left, 0.1))  # wakes to notice a cancelled caller
                finally:
                    self._waiting -= 1
            reused, rows = self._take_prefix(prompt, count) if prompt else (0, [])
            while len(rows) < count:
                if self._free:
                    rows.append(self._free.pop())
                else:  # the least recently released kept row
                    rows.append(self._kept.popitem(last=False)[0])
            for row in rows:
                self.lengths[row] = 0
            if rows and reused:
                self.lengths[rows[0]] = reused
                self.reused_tokens += reused
        return rows

    def _available(self) -> int:
        return len(self._free) + len(self._kept)

    def _take_prefix(self, prompt: Sequence[int], count: int) -> tuple[int, list[int]]:
        """(tokens, [row]): the longest prefix of `prompt` a kept row holds, in a free row (the
        kept one stays, for the next such prompt) or in the kept row itself where no row is
        free, where that pays (`allocate`); else (0, [])."""
        best, source = 0, -1
        for row, held in self._kept.items():
            shared = _shared_prefix(held, prompt)
            if shared > best:
                best, source = shared, row
        if best == 0 or (best < MIN_REUSE and len(self._free) >= count):
            return 0, []
        if len(self._free) >= count:
            row = self._free.pop()
            for store in self.keys + self.values:
                store[row, :, :best] = store[source, :, :best]
            self._kept.move_to_end(source)
            return best, [row]
        del self._kept[source]
        return best, [source]

    def release(self, rows: list[int], held: Sequence[Sequence[int]] = ()) -> None:
        """Rows back to the pool. `held[i]`: the tokens at rows[i]'s first positions, whose keys
        it keeps for a later prompt that begins with them (none where empty or not given)."""
        with self._changed:
            for i, row in enumerate(rows):
                tokens = tuple(held[i]) if self.prefix_cache and i < len(held) else ()
                if tokens and self._keep(tokens):
                    self.lengths[row] = len(tokens)
                    self._kept[row] = tokens
                else:
                    self._to_free(row)
            self._free.sort(reverse=True)
            self._changed.notify_all()

    def _to_free(self, row: int) -> None:
        """`row` holds nothing and is free; the caller sorts the free list."""
        self.lengths[row] = 0
        self._free.append(row)

    def _keep(self, tokens: tuple[int, ...]) -> bool:
        """Whether a row holding `tokens` is worth keeping: not where a kept row holds them and
        more; kept rows holding a prefix of them are freed (this one serves their prompts)."""
        for row, held in list(self._kept.items()):
            if len(held) >= len(tokens) and held[: len(tokens)] == tokens:
                return False
            if held == tokens[: len(held)]:
                del self._kept[row]
                self._to_free(row)
        return True

    def forget_kept(self, rows: Sequence[int]) -> None:
        """Rows about to be written outside any session (`Scheduler.time_decode_step`) keep nothing."""
        with self._changed:
            for row in rows:
                if self._kept.pop(row, None) is not None:
                    self._to_free(row)
            self._free.sort(reverse=True)

    def rows_in_use(self) -> int:
        with self._changed:
            return self.shape.rows - len(set(self._free) | set(self._kept))

    def usage(self) -> CacheUsage:
        with self._changed:
            free = set(self._free) | set(self._kept)
            used = [row for row in range(self.shape.rows) if row not in free]
            tokens = sum(self.lengths[row] for row in used)
            return CacheUsage(
                rows=self.shape.rows,
                rows_in_use=len(used),
                max_len=self.shape.max_len,
                tokens_in_use=tokens,
                bytes_in_use=tokens * self.shape.bytes_per_token,
                bytes_total=self.shape.bytes,
                waiting=self._waiting,
                rows_kept=len(self._kept),
                reused_tokens=self.reused_tokens,
            )

    # -- row contents ----------------------------------------------------------------------

    def copy_rows(self, sources: list[int], targets: list[int]) -> None:
        """targets[i] ← sources[i] (keys, values, length); sources may overlap targets."""
        length = max((self.lengths[row] for row in sources), default=0)
        if length:
            src = torch.tensor(sources, device=self.device)
            dst = torch.tensor(targets, device=self.device)
            for store in self.keys + self.values:
                view = store[:, :, :length]
                view.index_copy_(0, dst, view.index_select(0, src))  # index_select copies first
        lengths = [self.lengths[row] for row in sources]
        for row, kept in zip(targets, lengths, strict=True):
            self.lengths[row] = kept

    def keep_positions(self, row: int, start: int, kept: list[int]) -> None:
        """Keep positions start+kept[i] at start+i and cut the row there (an accepted tree path).

        `kept` are offsets from `start`, ascending. Keys keep the rotary positions they were
        computed with, which is what a tree path wants: a node's position is its depth.
        """
        if kept != list(range(len(kept))):
            index = torch.tensor([start + k for k in kept], device=self.device)
            for store in self.keys + self.values:
                picked = store[row].index_select(1, index)  # [kv_heads, len(kept), head_dim]
                store[row, :, start : start + len(kept)] = picked
        self.lengths[row] = start + len(kept)


def _shared_prefix(held: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading tokens `held` and `prompt` share."""
    shorter = min(len(held), len(prompt))
    return next((i for i, (a, b) in enumerate(zip(held[:shorter], prompt[:shorter], strict=True)) if a != b), shorter)
