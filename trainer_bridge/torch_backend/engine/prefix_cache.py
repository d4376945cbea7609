"""The engine's prefix cache: the KV cache of recent prompts, so a prompt that starts like one of
them is prefilled only from where they part.

An agent's prompts share long beginnings: a turn's prompt is the previous turn's prompt plus the
reply and the tool's result, and the rollouts of one task (a GRPO group) all start with the same
instructions and question. Prefilling those tokens again is most of the engine's work on long
prompts (16 clients, ~870-token prompts sharing their first ~850: vLLM, which caches prefixes, was
~5x faster than the engine without this cache).

After each prefill pass the scheduler ``store``s every prompt's keys and values (``prefill.py``
builds the passes); ``longest``
finds the longest stored prefix of a new prompt, in whole blocks of ``BLOCK`` tokens (a chain of
block hashes, checked token by token on a hit), at least ``MIN_REUSED_TOKENS`` long and at least
one token short of the prompt, whose last position must be computed for its logits. Entries are
per LoRA adapter (None: the base model) and are dropped least recently used first beyond
``max_bytes``; ``clear`` drops them all, which the scheduler does whenever weights change (a
cached key or value is a function of them).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 16  # tokens per hashed block: a hit reuses whole blocks only
# prompts with a cached prefix are prefilled in a pass apart from the others, which costs a forward
# pass's fixed overhead: below this many reused tokens a prompt is prefilled with the others instead
MIN_REUSED_TOKENS = 4 * BLOCK


@dataclass
class CachedPrompt:
    """One stored prompt: its tokens and each layer's keys and values ``[1, heads, tokens, head_dim]``."""

    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    index_keys: list[tuple[object, int]] = field(default_factory=list)


@dataclass(frozen=True)
class PrefixHit:
    """The first ``length`` tokens of a prompt, and their keys and values per layer."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def block_hashes(tokens: list[int] | tuple[int, ...], blocks: int) -> list[int]:
    """The chained hash of each of the first ``blocks`` whole blocks (entry k covers k+1 blocks)."""
    hashes, previous = [], 0
    for start in range(0, blocks * BLOCK, BLOCK):
        previous = hash((previous, tuple(tokens[start:start + BLOCK])))
        hashes.append(previous)
    return hashes


class PrefixCache:
    """Recent prompts' KV caches, looked up by their longest shared block-aligned prefix."""

    def __init__(self, max_bytes: int, min_reused_tokens: int = MIN_REUSED_TOKENS):
        self.max_bytes = max_bytes
        self.min_blocks = max(1, -(-min_reused_tokens // BLOCK))
        self.bytes = 0
        self.hits = self.misses = self.tokens_reused = 0
        self._entries: OrderedDict[int, CachedPrompt] = OrderedDict()
        self._index: dict[tuple[object, int], int] = {}  # (adapter, chained block hash) -> entry id
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, prompt: list[int], adapter: object) -> PrefixHit | None:
        """The longest stored prefix of ``prompt`` (at least ``min_blocks`` blocks, at most its
        length - 1)."""
        if self.max_bytes <= 0 or not self._entries:
            return None
        usable_blocks = (len(prompt) - 1) // BLOCK
        for blocks, chained in reversed(list(enumerate(block_hashes(prompt, usable_blocks), start=1))):
            if blocks < self.min_blocks:
                break
            entry_id = self._index.get((adapter, chained))
            if entry_id is None:
                continue
            entry = self._entries[entry_id]
            length = blocks * BLOCK
            if list(entry.tokens[:length]) != prompt[:length]:  # a hash collision
                continue
            self._entries.move_to_end(entry_id)
            self.hits += 1
            self.tokens_reused += length
            return PrefixHit(length, [(keys[:, :, :length], values[:, :, :length]) for keys, values in entry.layers])
        self.misses += 1
        return None

    def store(self, prompt: list[int], adapter: object, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep ``prompt``'s keys and values (``[1, heads, len(prompt), head_dim]`` per layer, copied)."""
        blocks = len(prompt) // BLOCK
        if self.max_bytes <= 0 or blocks == 0:
            return
        hashes = block_hashes(prompt, blocks)
        same = self._index.get((adapter, hashes[-1]))
        if same is not None and self._entries[same].tokens == tuple(prompt):  # kept already
            self._entries.move_to_end(same)
            return
        copies = [(keys.clone(), values.clone()) for keys, values in layers]
        nbytes = sum(keys.nbytes + values.nbytes for keys, values in copies)
        if nbytes > self.max_bytes:
            return
        entry_id, self._next_id = self._next_id, self._next_id + 1
        entry = CachedPrompt(tuple(prompt), copies, nbytes)
        for chained in hashes:
            entry.index_keys.append((adapter, chained))
            self._index[(adapter, chained)] = entry_id  # the newest entry answers for a shared prefix
        self._entries[entry_id] = entry
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        entry_id, entry = self._entries.popitem(last=False)
        self.bytes -= entry.nbytes
        for key in entry.index_keys:
            if self._index.get(key) == entry_id:
                del self._index[key]

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.bytes = 0
