"""KV-cache layers with spare columns, so a decode step writes its new column in place.

transformers' ``DynamicLayer`` appends a step's keys and values with ``torch.cat``: every decode
step copies the whole cache of every layer, a cost that grows with the context (16 rows of the
``small`` preset at a 600-token context: 40 % of a decode step). A ``GrowingLayer`` keeps its keys
and values as views of larger buffers and writes each step's column after the last; it copies only
when the buffers are full (then into buffers half as large again as needed), so a step's cost no
longer grows with what was cached before it.

The running batch (``kv_cache.py``) changes the cache between steps: rows leave
(``batch_select_indices``), padding columns every row has left behind are cut from the front
(``drop_leading_columns``) and newcomers' rows join (``merge_rows``). Each keeps the spare room,
and the buffers keep their rows when rows leave: the batch fills the leavers' places with its last
rows (``kv_cache.fill_from_the_end``), which moves only those rows, and newcomers are written into
the free rows after the last, which copies only theirs (16 rows over ~900 columns, preset
``small``: a whole copy was ~25 ms, a third of the engine's time with 16 closed-loop clients).
``keys`` / ``values`` are what transformers reads; anything that sets them to other tensors makes
the next ``update`` copy them into fresh buffers, so code that treats this as a ``DynamicLayer``
stays correct.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

MIN_SPARE_COLUMNS = 32


def spare_columns(used: int) -> int:
    """Room left after ``used`` columns when buffers are (re)made: half as many again, at least 32."""
    return max(MIN_SPARE_COLUMNS, used // 2)


class GrowingLayer(DynamicLayer):
    """A full-attention layer's cache ``[rows, heads, columns, head_dim]`` in buffers with room
    after the last column and, once rows left, free rows after the last; ``keys`` / ``values``
    are views of rows ``:rows`` and columns ``start:end``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.is_initialized = True
        self.device = keys.device
        # the tensors themselves, with no room yet: the first step copies them (as a DynamicLayer
        # would), and newcomers merged into a running batch before any step are never copied twice
        self._key_buffer, self._value_buffer = keys, values
        self._rows, self._start, self._end = keys.shape[0], 0, keys.shape[-2]
        self._refresh_views()

    @classmethod
    def left_padded(cls, rows: list[tuple[torch.Tensor, torch.Tensor]], columns: int, room: int) -> GrowingLayer:
        """A layer of ``rows``' keys and values (``[1, heads, tokens, head_dim]`` each, at most
        ``columns`` tokens) in its rows' last columns, zeros before them (masked columns), in
        buffers with ``room`` spare columns: one copy of each, where ``__init__`` and a first
        ``update`` would make two."""
        keys, values = rows[0]
        shape = (len(rows), keys.shape[1], columns + room, keys.shape[-1])
        layer = cls(keys.new_zeros(shape), values.new_zeros(shape))
        for index, (row_keys, row_values) in enumerate(rows):
            tokens = row_keys.shape[-2]
            layer._key_buffer[index, :, columns - tokens:columns] = row_keys[0]
            layer._value_buffer[index, :, columns - tokens:columns] = row_values[0]
        layer._end = columns
        layer._refresh_views()
        return layer

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, room: int, row_room: int = 0) -> None:
        """Copy ``keys`` / ``values`` into new buffers with ``room`` spare columns after them
        (and ``row_room`` free rows)."""
        rows, used = keys.shape[0], keys.shape[-2]
        shape = (rows + row_room, *keys.shape[1:-2], used + room, keys.shape[-1])
        self._key_buffer, self._value_buffer = keys.new_empty(shape), values.new_empty(shape)
        self._key_buffer[:rows, ..., :used, :] = keys
        self._value_buffer[:rows, ..., :used, :] = values
        self._rows, self._start, self._end = rows, 0, used
        self._refresh_views()

    def _refresh_views(self) -> None:
        self._keys_view = self._key_buffer[:self._rows, ..., self._start:self._end, :]
        self._values_view = self._value_buffer[:self._rows, ..., self._start:self._end, :]
        self.keys, self.values = self._keys_view, self._values_view

    def _free_rows(self) -> int:
        return self._key_buffer.shape[0] - self._rows

    def _held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values transformers sees: this layer's views, or tensors someone set."""
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        return keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new columns after the cached ones; returns all of them (views)."""
        added = key_states.shape[-2]
        keys, values = self._held()
        if keys is not self._keys_view:  # someone set other tensors: take them as they are
            self._adopt(keys, values, added + spare_columns(keys.shape[-2]))
        elif self._end + added > self._key_buffer.shape[-2]:
            self._adopt(keys, values, added + spare_columns(self._end - self._start), self._free_rows())
        self._key_buffer[:self._rows, ..., self._end:self._end + added, :] = key_states
        self._value_buffer[:self._rows, ..., self._end:self._end + added, :] = value_states
        self._end += added
        self._refresh_views()
        return self._keys_view, self._values_view

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices``, in that order: in place when every row that moves comes
        from after the kept rows' count (``kv_cache.fill_from_the_end``'s order: only the movers
        are copied, the buffers keep their rows), else one copy of the used columns into new
        buffers with room."""
        keys, values = self._held()
        order = indices.tolist()
        kept = len(order)
        moves = [(place, row) for place, row in enumerate(order) if row != place]
        if keys is self._keys_view and len(set(order)) == kept and all(row >= kept for _, row in moves):
            if moves:
                places = torch.tensor([place for place, _ in moves], device=keys.device)
                rows = torch.tensor([row for _, row in moves], device=keys.device)
                columns = slice(self._start, self._end)
                self._key_buffer[places, ..., columns, :] = self._key_buffer[rows, ..., columns, :]
                self._value_buffer[places, ..., columns, :] = self._value_buffer[rows, ..., columns, :]
            self._rows = kept
            self._refresh_views()
            return
        self._adopt(keys.index_select(0, indices), values.index_select(0, indices), spare_columns(keys.shape[-2]))

    def drop_leading_columns(self, count: int) -> None:
        """Forget the first ``count`` columns (padding for every row) without copying."""
        self._start += count
        self._refresh_views()

    def merge_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """These rows followed by ``keys`` / ``values``'s, both left-padded with zeros to the
        wider one's columns (masked columns, zero so that they add nothing to the attention).
        In place when the buffers have the free rows, and the columns before the first for
        newcomers wider than these rows; else into new buffers."""
        own_keys, own_values = self._held()
        joining, mine, theirs = keys.shape[0], own_keys.shape[-2], keys.shape[-2]
        width = max(mine, theirs)
        if own_keys is self._keys_view and joining <= self._free_rows() and width <= self._end:
            self._merge_in_place(keys, values, width)
            return
        own = own_keys.shape[0]
        shape = (own + joining, *keys.shape[1:-2], width + spare_columns(width), keys.shape[-1])
        key_buffer, value_buffer = keys.new_zeros(shape), values.new_zeros(shape)
        key_buffer[:own, ..., width - mine:width, :] = own_keys
        value_buffer[:own, ..., width - mine:width, :] = own_values
        key_buffer[own:, ..., width - theirs:width, :] = keys
        value_buffer[own:, ..., width - theirs:width, :] = values
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self._rows, self._start, self._end = own + joining, 0, width
        self._refresh_views()

    def _merge_in_place(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        """``merge_rows`` into the free rows after the last: columns ``end - width:end``, the
        columns gained on the left zeroed for these rows, the newcomers' padding zeroed."""
        start, end, own = self._end - width, self._end, self._rows
        rows = slice(own, own + keys.shape[0])
        if start < self._start:  # the newcomers are wider: uncover columns cut earlier
            self._key_buffer[:own, ..., start:self._start, :] = 0
            self._value_buffer[:own, ..., start:self._start, :] = 0
        padding = end - keys.shape[-2]
        self._key_buffer[rows, ..., start:padding, :] = 0
        self._value_buffer[rows, ..., start:padding, :] = 0
        self._key_buffer[rows, ..., padding:end, :] = keys
        self._value_buffer[rows, ..., padding:end, :] = values
        self._rows, self._start = own + keys.shape[0], start
        self._refresh_views()


def growing_layers(cache: Any) -> None:
    """Replace the plain full-attention layers of a transformers cache with ``GrowingLayer``s
    holding the same tensors (other kinds of layer are left as they are)."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.keys is not None and layer.values is not None:
            cache.layers[index] = GrowingLayer(layer.keys, layer.values)
