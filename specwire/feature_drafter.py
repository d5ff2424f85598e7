"""A draft head on the target's own features: one decoder layer that drafts a chain of tokens from
the target's final hidden states (EAGLE, Li et al. 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty", arXiv:2401.15077).

Slot j of its sequence reads the target's final-normed hidden state f_j at position j and the
embedding of the token x_{j+1} that followed it; its output predicts f_{j+1}, and its head scores
x_{j+2} from that prediction. Deeper drafts feed its own predicted feature back in. Unlike Medusa
heads, each depth conditions on the tokens drafted before it, so the chain stays coherent.

It serves as the target service's heads (`--medusa DIR`): the service keeps each session's slots
for committed positions (`FeatureDrafterState`) and drafts a round's tree from them; the
orchestrator's Medusa rounds and their acceptance rules are unchanged, so every output stays the
target's. Its head scores `head_vocab` frequent ids (`vocab_ids`), initialised from the target's
output embedding; its token embedding is the target's input embedding, bound at load, not stored.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_NAME = "feature_drafter_config.json"
WEIGHTS_NAME = "feature_drafter.safetensors"

log = logging.getLogger("specwire")


@dataclass(frozen=True)
class FeatureDrafterConfig:
    hidden_size: int
    vocab_size: int
    head_vocab: int  # ids its head scores (`vocab_ids`)
    num_heads: int = 10
    num_kv_heads: int = 2
    intermediate_size: int = 2048
    max_depth: int = 6  # the longest chain it drafts: what `Info.medusa_heads` reports
    rope_theta: float = 10000.0

    @classmethod
    def for_target(cls, hidden_size: int, vocab_size: int, head_vocab: int, max_depth: int) -> FeatureDrafterConfig:
        """One layer shaped after the target's width: heads of 64 (one where the width is less),
        two KV heads where they divide, an MLP 3.2 times as wide (Gemma-3-270M: 10, 2, 2048)."""
        heads = hidden_size // 64 if hidden_size % 64 == 0 and hidden_size >= 64 else 1
        kv_heads = 2 if heads % 2 == 0 else 1
        intermediate = max(32, round(hidden_size * 3.2 / 32) * 32)
        return cls(hidden_size, vocab_size, head_vocab, heads, kv_heads, intermediate, max_depth)


def is_feature_drafter(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_NAME).is_file()


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021), half-split layout. x: [..., T, d]; positions: [T]."""
    half = x.shape[-1] // 2
    inverse = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)  # [d/2]
    angles = positions.to(x.device, torch.float32)[:, None] * inverse[None]  # [T, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _standard(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with the standard strides: `contiguous` keeps any stride of a dimension of
    size 1 (one past slot, one batch row), and a compiled graph's guards then fail and recompile."""
    t = t.contiguous()
    return t.view(-1).view(t.shape)


@dataclass
class Slots:
    """Keys and values of a drafter's slots: [kv_heads, S, head_dim] each, and their positions [S]."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    def before(self, position: int) -> Slots:
        """The slots at positions < `position`."""
        keep = int((self.positions < position).sum())
        return Slots(self.keys[:, :keep], self.values[:, :keep], self.positions[:keep])


class FeatureDrafter(nn.Module):
    """[T] features and next tokens → [T] predicted next features; `scores` maps them to logits."""

    vocab_ids: torch.Tensor  # [head_vocab] long: the target ids its head scores

    def __init__(self, config: FeatureDrafterConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        width, heads, kv_heads = config.hidden_size, config.num_heads, config.num_kv_heads
        if width % heads or heads % kv_heads:
            raise ValueError(f"feature drafter: hidden {width}, {heads} heads, {kv_heads} kv heads do not divide")
        self.head_dim = width // heads
        self.feature_norm, self.token_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.fuse = nn.Linear(2 * width, width, bias=False)
        self.attention_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)
        self.gate_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, width, bias=False)
        self.out_scale = nn.Parameter(torch.ones(width))
        self.head = nn.Linear(width, config.head_vocab, bias=False)
        ids = vocab_ids.long()
        if ids.shape != (config.head_vocab,) or not bool(((ids >= 0) & (ids < config.vocab_size)).all()):
            raise ValueError(f"feature drafter vocab_ids: {config.head_vocab} ids in [0, {config.vocab_size}) expected")
        self.register_buffer("vocab_ids", ids)
        self.embedding: torch.Tensor | None = None  # [vocab, hidden]: the target's, `bind`
        self._compiled_chain: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None  # `compile_steps`
        self._compiled_trees: set[tuple[int, int]] = set()  # (depth, top_k) it was warmed up for
        # Sessions of an engine without a scheduler draft on threads of their own, and the layer's
        # fused projections (`quantize.SharedInputLinear`) keep one product between their calls,
        # which the compiled step's guards also read: one session at a time (eight concurrent Medusa streams on
        # Gemma-3-270M took each other's products, an AssertionError, or recompiled the step).
        self._lock = threading.Lock()

    @property
    def num_heads(self) -> int:
        """The deepest node it drafts (the orchestrator's trees are cut there, as for Medusa heads)."""
        return self.config.max_depth

    def bind(self, embedding: torch.Tensor) -> None:
        """Read token embeddings from the target's input embedding [vocab, hidden] (not copied)."""
        if tuple(embedding.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"feature drafter: embedding {tuple(embedding.shape)}, expected "
                             f"{(self.config.vocab_size, self.config.hidden_size)}")
        self.embedding = embedding.detach()

    def forward(
        self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, past: Slots | None = None
    ) -> tuple[torch.Tensor, Slots]:
        """features [B, T, H], tokens [B, T] (x_{j+1} for slot j), positions [T] → predicted
        f_{j+1} [B, T, H] and the slots with these appended (B = 1 when `past` is given)."""
        with self._lock:
            return self._forward(features, tokens, positions, past)

    def _forward(
        self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, past: Slots | None
    ) -> tuple[torch.Tensor, Slots]:
        if past is None:
            out, keys, values = self._layer(features, tokens, positions, None, None, None)
            if features.shape[0] == 1:
                return out, Slots(keys[0], values[0], positions)
            return out, Slots(keys[0][:, :0], values[0][:, :0], positions[:0])
        out, keys, values = self._layer(features, tokens, positions, past.keys, past.values, past.positions)
        return out, Slots(keys[0], values[0], torch.cat([past.positions, positions]))

    def chain(
        self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, past: Slots | None, depth: int,
        top_k: int,
    ) -> tuple[torch.Tensor, Slots]:
        """A round's drafts in one call: new slots as `forward` (B = 1), then `depth` levels, each
        the `top_k` best target ids [depth, top_k] of the last predicted feature, the best one fed
        back at the next position. Returns them and the slots with the new ones (not the chain's)."""
        with self._lock:
            # Other trees (a generation's last rounds draft less deep) draft eagerly: each would
            # compile graphs of its own while serving.
            if past is None or self._compiled_chain is None or (depth, top_k) not in self._compiled_trees:
                best, keys, values = self._chain(features, tokens, positions, None if past is None else past.keys,
                                                 None if past is None else past.values,
                                                 None if past is None else past.positions, depth, top_k)
            else:  # a compiled graph is specialised on strides
                best, keys, values = self._compiled_chain(
                    *(_standard(t) for t in (features, tokens, positions, past.keys, past.values, past.positions)),
                    depth, top_k)
        known = positions if past is None else torch.cat([past.positions, positions])
        return best, Slots(keys[0], values[0], known)

    def _chain(
        self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, past_keys: torch.Tensor | None,
        past_values: torch.Tensor | None, past_positions: torch.Tensor | None, depth: int, top_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`chain` on tensors: the drafts [depth, top_k] and the keys and values of the past and
        new slots [1, kv, S + T, d]; one graph when compiled, so a level costs no Python."""
        out, keys, values = self._layer(features, tokens, positions, past_keys, past_values, past_positions)
        known = positions if past_positions is None else torch.cat([past_positions, positions])
        chain, chain_keys, chain_values, best = out[:, -1:], keys[0], values[0], []
        for level in range(depth):
            ids = self.vocab_ids[self.head(chain[0, -1]).topk(top_k).indices]  # [top_k] target ids
            best.append(ids)
            if level + 1 < depth:
                at = positions[-1:] + 1 + level  # [1]
                chain, more_keys, more_values = self._layer(chain, ids[:1][None], at, chain_keys, chain_values, known)
                chain_keys, chain_values, known = more_keys[0], more_values[0], torch.cat([known, at])
        return torch.stack(best), keys, values

    def _layer(
        self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
        past_keys: torch.Tensor | None, past_values: torch.Tensor | None, past_positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer on new slots after past ones ([kv, S, d] each, positions [S]): the predicted
        features [B, T, H] and the keys and values of the past and new slots, [B, kv, S + T, d]."""
        assert self.embedding is not None, "bind the target's embedding first"
        batch, steps, _ = features.shape
        embedded = self.embedding[tokens.to(self.embedding.device)].to(features.dtype)  # [B, T, H]
        x = self.fuse(torch.cat([self.feature_norm(features), self.token_norm(embedded)], dim=-1))  # [B, T, H]
        h = self.attention_norm(x)
        kv_heads, dim, theta = self.config.num_kv_heads, self.head_dim, self.config.rope_theta
        q = rotate(self.q_proj(h).view(batch, steps, -1, dim).transpose(1, 2), positions, theta)
        k = rotate(self.k_proj(h).view(batch, steps, kv_heads, dim).transpose(1, 2), positions, theta)
        v = self.v_proj(h).view(batch, steps, kv_heads, dim).transpose(1, 2)  # [B, kv, T, d]
        key_positions = positions
        if past_keys is not None and past_values is not None and past_positions is not None:
            k, v = torch.cat([past_keys[None], k], 2), torch.cat([past_values[None], v], 2)  # [1, kv, S + T, d]
            key_positions = torch.cat([past_positions, positions])
        # Causal by position; one new slot after its predecessors' sees them all (no mask).
        allowed = None if steps == 1 else (key_positions[None, :] <= positions[:, None]).to(q.device)  # [T, S]
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)  # [B, heads, T, d]
        x = x + self.o_proj(out.transpose(1, 2).reshape(batch, steps, -1))
        m = self.mlp_norm(x)
        x = x + self.down_proj(nn.functional.silu(self.gate_proj(m)) * self.up_proj(m))
        return x * self.out_scale, k, v

    def compile_steps(self, trees: Sequence[tuple[int, int]] = ((3, 1),)) -> bool:
        """Compile the serving call (`chain`: one session's new slots after its past ones, any
        count of either, then its levels) for the calling thread's torch threads, warmed up for
        each (depth, top_k) of `trees`; eager it stays where that fails."""
        try:
            self._compiled_chain = torch.compile(self._chain, dynamic=True)
            width, tokens = self.config.hidden_size, torch.zeros(32, dtype=torch.long)
            like = self.out_scale  # the drafter's device and dtype (its linears may be quantised)
            # Sessions as they start, from a prompt's slots or from one (a prefix-cache hit leaves
            # only the prompt's uncached tail), then rounds accepting 1 to 3 tokens. Dynamo
            # specialises counts of 1, so past slots and new ones of 1 and more each get a graph.
            for depth, top_k in trees:
                self._compiled_trees.add((depth, top_k))
                for prompt, rounds in ((8, (1, 2, 3, 1, 2, 3)), (1, (1, 2)), (1, (2, 1))):
                    state = FeatureDrafterState()
                    state.commit(0, like.new_zeros(prompt, width))
                    state.draft(self, tokens[:prompt], 0, depth, top_k)  # no past slots: eager
                    length = prompt
                    for accepted in rounds:
                        state.commit(length, like.new_zeros(accepted, width))
                        length += accepted
                        state.draft(self, tokens[:length], 0, depth, top_k)
        except Exception as error:  # serve eagerly
            log.warning("feature drafter: torch.compile failed, drafting eagerly: %s: %s", type(error).__name__, error)
            self._compiled_chain, self._compiled_trees = None, set()
            return False
        return True

    def get_output_embeddings(self) -> nn.Linear:
        """Its head, where quantisation looks for an output layer (`mixed` gives it 4 bits)."""
        return self.head

    def scores(self, predicted: torch.Tensor) -> torch.Tensor:
        """[..., head_vocab] logits over `vocab_ids` from predicted features [..., H]."""
        return self.head(predicted)

    def save(self, directory: str | Path) -> None:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {name: (t.to(torch.float16) if t.is_floating_point() else t).detach().contiguous()
                 for name, t in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME))
        (out / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> FeatureDrafter:
        path = Path(directory)
        config = FeatureDrafterConfig(**json.loads((path / CONFIG_NAME).read_text()))
        state = load_file(str(path / WEIGHTS_NAME))
        drafter = cls(config, state["vocab_ids"])
        drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        return drafter.eval()


@dataclass
class FeatureDrafterState:
    """One session's drafter slots over committed positions, and the committed features that wait
    for their next token (known once the round's root is decided)."""

    slots: Slots | None = None
    pending_start: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)  # [H] each, positions pending_start…

    def commit(self, start: int, features: torch.Tensor) -> None:
        """Features [m, H] of committed positions start…start+m−1 (contiguous with any pending)."""
        if not self.pending or self.pending_start + len(self.pending) != start:
            self.pending, self.pending_start = [], start
        if self.slots is not None:  # a forward that went back over slotted positions
            self.slots = self.slots.before(start)
        self.pending.extend(features.unbind(0))

    def cut(self, length: int) -> None:
        """Tokens now end at `length`: slot j reads x_{j+1}, so slots from length − 1 on go."""
        if self.slots is not None:
            self.slots = self.slots.before(length - 1)
        keep = max(0, min(len(self.pending), length - self.pending_start))
        self.pending = self.pending[:keep]

    @torch.inference_mode()
    def draft(self, drafter: FeatureDrafter, tokens: torch.Tensor, root: int, depth: int, top_k: int) -> torch.Tensor:
        """[depth, top_k] target ids: each depth's best ids along the drafter's greedy chain.

        tokens: [length] the committed tokens; `root` follows them. The pending features become
        slots (their next tokens are committed or the root); the chain's own slots are dropped."""
        length = int(tokens.shape[0])
        if not self.pending or self.pending_start + len(self.pending) != length:
            raise ValueError("no feature at the last committed token")
        start = self.pending_start
        following = torch.cat([tokens[start + 1 :], torch.tensor([root], dtype=torch.long)])  # [m]
        features = torch.stack(self.pending)[None].to(drafter.out_scale.dtype)  # [1, m, H]
        positions = torch.arange(start, length)
        best, self.slots = drafter.chain(features, following[None], positions, self.slots, depth, top_k)
        self.pending = []
        return best  # [depth, top_k]
