"""The policy engine's scheduler: the request queue, admission into the running batch, the step loop.

Owned by ``policy_engine.PolicyEngine``, which queues requests and weight swaps here. One
thread owns the model and batches continuously: requests that arrive while rows are decoding
join the running batch at the next step (one prefill pass for the newcomers, whose KV cache is
then merged into the batch's, see ``kv_cache.py``; a prompt that starts like a recent one is
prefilled only from where they part, ``prefix_cache.py`` and ``prefill.py``), and finished rows leave it at once. One
forward pass per step decodes a token for every row (``sampling.py``), whose text and stop
conditions ``detokenize.py`` follows; each token goes to its request as it is sampled, so
streaming works inside a batch. Rows whose request constrains its output (a grammar) sample
from logits masked by ``grammar.py``, in the same batch as free rows, which are not touched.
Rows of different LoRA adapters share a batch and its forward passes (``multi_lora.py``).
New weights are applied only when no row is decoding (while a swap is pending no new row
joins), so every sequence is produced by exactly one policy version. A swap of some adapters'
weights only (``AdapterSwap``) waits for those adapters' rows alone: rows of the base model and of
the other adapters keep decoding and joining meanwhile, and it is applied between two steps
(``weight_swaps.py`` keeps the pending swap and says what it holds back).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from spanrl.trainer_bridge.torch_backend.engine.detokenize import Detokenizer
from spanrl.trainer_bridge.torch_backend.engine.grammar import Grammars, advance
from spanrl.trainer_bridge.torch_backend.engine.kv_cache import (
    AttentionMasks,
    Row,
    RunningBatch,
    cache_keyword,
    fail_rows,
    output_cache,
    requests_of,
)
from spanrl.trainer_bridge.torch_backend.engine.multi_lora import AdapterSwap, ServedAdapters
from spanrl.trainer_bridge.torch_backend.engine.prefill import (
    distinct_prompts,
    group_by_prefix,
    prefill_and_keep,
    prefill_inputs,
    store_prompts,
)
from spanrl.trainer_bridge.torch_backend.engine.prefix_cache import PrefixCache, PrefixHit
from spanrl.trainer_bridge.torch_backend.engine.requests import (
    EngineError,
    EngineOverloadedError,
    EngineStats,
    EngineStoppedError,
    GenerationRequest,
    TokenEvent,
    safe_call,
)
from spanrl.trainer_bridge.torch_backend.engine.sampling import (
    Sampler,
    TopLogprobs,
    row_top_logprobs,
    sampled_logprobs,
)
from spanrl.trainer_bridge.torch_backend.engine.shared_prefix import SharedPrefix, shared_length
from spanrl.trainer_bridge.torch_backend.engine.weight_swaps import ALL, PendingSwap, SwapSlot, load_swap

logger = logging.getLogger(__name__)

_WAKE = object()  # queued by a weight swap to wake an idle engine thread
class Scheduler:
    """Runs requests on ``model`` in shared batches from its own thread (``start``/``stop``).

    ``batch_wait_s`` and ``join_fraction`` tune when newcomers join a running batch
    (``_time_to_join``); ``version`` is the serving policy version, changed only by swaps;
    ``version_listeners`` are called (from the engine thread) with each new version.
    """

    def __init__(self, model: Any, detokenizer: Detokenizer, sampler: Sampler, masks: AttentionMasks, *,
                 pad_id: int, version: int, max_batch_size: int, batch_wait_s: float, grammars: Grammars,
                 max_queued: int = 1024, prefix_cache_bytes: int = 0, shared_prefix_attention: bool = False):
        self.model = model
        self.cache_argument = cache_keyword(model)
        self.shared_prefix_attention = shared_prefix_attention  # the model's attention is shared_prefix.py's
        self.grammars = grammars
        self.detokenizer = detokenizer
        self.sampler = sampler
        self.masks = masks
        self.device = sampler.device
        self.pad_id = pad_id
        self.version = version
        self.version_listeners: list[Callable[[int], None]] = []
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_queued = max_queued  # requests not decoding yet above this: EngineOverloadedError (a 503)
        # newcomers join a running batch once they are this share of it, or waited batch_wait_s
        # (_time_to_join); 0.25 measured best on the bench (0.125-0.5 within noise, 0 worse)
        self.join_fraction = 0.25
        self.stats = EngineStats()
        self._swaps = SwapSlot()  # the pending weight swap (weight_swaps.py)
        self.adapters: ServedAdapters | None = None  # per-agent LoRA adapters (multi_lora.py)
        # recent prompts' KV caches (prefix_cache.py); emptied whenever weights change
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._queue: queue.Queue[GenerationRequest | object | None] = queue.Queue()
        self._waiting: list[Row] = []
        self.thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ any thread

    def start(self) -> None:
        if self.thread is None:
            self._stopping = False
            self.thread = threading.Thread(target=self._run, name="spanrl-policy-engine", daemon=True)
            self.thread.start()

    def stop(self, timeout: float) -> None:
        self._stopping = True
        self._queue.put(None)
        if self.thread is not None:
            self.thread.join(timeout)
            self.thread = None
        self.grammars.close()

    def enqueue(self, request: GenerationRequest) -> None:
        if self.thread is None or self._stopping:
            raise EngineStoppedError("the policy engine is not running")
        # requests not decoding yet (those handed over, and those waiting to join a batch; read
        # without a lock: a bound, not an exact count)
        if self._queue.qsize() + len(self._waiting) >= self.max_queued:
            raise EngineOverloadedError(f"the policy engine has {self.max_queued} requests waiting; retry shortly")
        self._queue.put(request)

    @property
    def pending_swap(self) -> PendingSwap | None:
        return self._swaps.pending

    def swap_weights(self, state_dict: dict | AdapterSwap, version: int, timeout: float | None) -> None:
        """Queue a swap (superseding one not applied yet) and wait until the engine thread, or
        this thread when none runs, applied it; see ``PolicyEngine.swap_weights``."""
        swap = self._swaps.put(state_dict, version)
        if self.thread is None:
            self._apply_pending_swap()
        else:
            self._queue.put_nowait(_WAKE)  # wake an idle engine thread
        if not swap.done.wait(timeout):
            raise TimeoutError("the weight swap was not applied in time")
        if swap.outcome:
            raise swap.outcome[0]

    # ------------------------------------------------------------------ engine thread

    def _apply_pending_swap(self, expected: PendingSwap | None = None) -> None:
        """Apply the pending swap (with ``expected``: only if it is still that one)."""
        swap = self._swaps.take(expected)
        if swap is None:
            return
        try:
            if self.prefix_cache is not None:
                self.prefix_cache.clear()  # cached keys and values are the old weights'
            load_swap(swap, self.model, self.adapters)
            self.version = swap.version
            logger.info("policy weights swapped in: version %d", swap.version)
            for listener in self.version_listeners:
                safe_call(listener, swap.version)
        except BaseException as exc:  # reported to the caller of swap_weights
            swap.outcome.append(exc)
        finally:
            swap.done.set()

    def _run(self) -> None:
        torch.set_num_threads(torch.get_num_threads())  # this thread uses the process's setting
        with torch.inference_mode():  # no autograd bookkeeping: cheaper per operation than no_grad
            self._serve()

    def _serve(self) -> None:
        running: RunningBatch | None = None
        while not self._stopping:
            # never sleep on a pending swap: its wake-up may have been taken while rows ran
            self._collect(block=running is None and self.pending_swap is None)
            if running is None:
                self._apply_pending_swap()  # nothing is decoding: the only safe moment
            else:  # an adapters-only swap whose adapters no running row uses: now, the rows decoding on
                sparing = self._swaps.sparing(row.request.params.adapter for row in running.rows)
                if sparing is not None:
                    self._apply_pending_swap(expected=sparing)
            if self._stopping:
                break
            try:
                running = self._admit_waiting(running)
                if running is not None:
                    running = self._decode_step(running)
            except Exception as exc:  # never let one bad step kill the server
                logger.exception("generation failed")
                if running is not None:
                    fail_rows(running.rows, exc)
                running = None
        stopped = EngineStoppedError("the policy engine stopped")
        if running is not None:
            fail_rows(running.rows, stopped)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, GenerationRequest):
                item.fail(stopped)
        fail_rows(self._waiting, stopped)
        self._waiting = []

    def _collect(self, block: bool) -> None:
        """Move queued requests into ``_waiting``; with ``block`` and nothing waiting, sleep
        until something is queued (a request, a weight swap's wake-up or stop)."""
        if block and not self._waiting:
            self._enqueue(self._queue.get())
        while True:
            try:
                self._enqueue(self._queue.get_nowait())
            except queue.Empty:
                return

    def _enqueue(self, item: GenerationRequest | object | None) -> None:
        if item is None:
            self._stopping = True
            return
        if not isinstance(item, GenerationRequest):  # _WAKE
            return
        adapter = item.params.adapter
        if adapter is not None and (self.adapters is None or adapter not in self.adapters.slots):
            item.fail(EngineError(f"the policy engine serves no adapter {adapter!r}", "model"))
            return
        now = time.monotonic()
        matchers: list[Any] = [None] * item.params.n
        if item.params.grammar is not None:
            try:
                matchers = self.grammars.matchers(item.params.grammar, item.params.n)
            except Exception as exc:  # a grammar llguidance refuses fails its request, not the engine
                item.fail(exc if isinstance(exc, EngineError) else EngineError(f"output constraint: {exc}"))
                return
        for choice in range(item.params.n):
            generator = self.sampler.generator_for(item.params, choice)
            self._waiting.append(Row(request=item, choice=choice, generator=generator, queued_at=now,
                                     matcher=matchers[choice]))

    def _admit_waiting(self, running: RunningBatch | None) -> RunningBatch | None:
        """Continuous batching: waiting rows join the running batch now, at the next step,
        instead of waiting for the whole batch to finish. Nothing joins while a weight swap
        is pending (but rows of adapters an adapter-only swap leaves alone): the running rows
        finish on the old weights, then the swap is applied."""
        held = self._swaps.held()
        if not self._waiting or (held is not None and ALL in held):
            return running
        if running is not None and not running.joinable:
            return running  # a cache that cannot be re-packed: new rows wait for the next batch
        if running is not None and not self._time_to_join(len(running.rows)):
            return running
        room = self.max_batch_size - (len(running.rows) if running is not None else 0)
        rows = self._take_rows(room, held or frozenset())
        if not rows:
            return running
        joining = self._prefill(rows)
        if running is None or joining is None:
            return running or joining
        return running.merge(joining)

    def _time_to_join(self, running_rows: int) -> bool:
        """Each admission costs a prefill pass, as much as one or two decode steps of the batch:
        while a batch runs, newcomers gather until they are a share of it (``join_fraction``) or
        the oldest has waited ``batch_wait_s``, so one pass admits several of them."""
        if len(self._waiting) >= self.join_fraction * running_rows:
            return True
        return time.monotonic() - self._waiting[0].queued_at >= self.batch_wait_s

    def _take_rows(self, room: int, held: frozenset[object]) -> list[Row]:
        """The oldest waiting rows that fit in ``room``, never splitting a request's choices,
        passing over the requests of ``held`` adapters (a pending swap's; they keep their place).
        Requests cancelled while they waited finish here, without a forward pass."""
        taken: list[Row] = []
        kept: list[Row] = []
        index = 0
        while index < len(self._waiting):
            size = self._waiting[index].request.params.n  # a request's choices are contiguous
            rows = self._waiting[index:index + size]
            if rows[0].request.params.adapter in held:
                kept.extend(rows)
            elif len(taken) + size > room:
                break
            else:
                taken.extend(rows)
            index += size
        self._waiting = kept + self._waiting[index:]
        live = []
        skipping = False
        for row in taken:  # a request's choices are contiguous, from choice 0: decided once per request
            if row.choice == 0:
                skipping = row.request.is_cancelled
                if skipping:
                    row.request.finish_unstarted(self.version)
            if not skipping:
                live.append(row)
        return live

    def _prefill(self, rows: list[Row]) -> RunningBatch | None:
        """Forward passes over the new rows' prompts (``_prefill_pass``: one for the rows whose
        prompts start with no cached prefix, one for those whose prompts do); samples their first
        token. None when they all finished at once, or when a pass failed (their requests get the
        error; the running batch is not touched)."""
        version = self.version
        self.stats.batches += 1
        for request in requests_of(rows):
            request.begin(version)
        try:
            batch = None
            for group, hits in group_by_prefix(rows, self.prefix_cache, self._keep_beginning):
                part = self._prefill_pass(group, hits)
                batch = part if batch is None else batch.merge(part)
        except Exception as exc:  # never let one bad request kill the server
            logger.exception("generation failed")
            fail_rows(rows, exc)
            return None
        return batch.without_finished() if batch is not None else None

    def _keep_beginning(self, tokens: list[int], adapter: str | None) -> bool:
        if self.adapters is not None:
            self.adapters.set_rows([adapter])
        return self.prefix_cache is not None and prefill_and_keep(self.model, self.prefix_cache, tokens, adapter,
                                                                  self.device)

    def _prefill_pass(self, rows: list[Row], hits: dict[int, PrefixHit] | None) -> RunningBatch:
        """One forward pass over ``rows``' distinct prompts, left-padded, or (``hits``: each
        request's cached prefix) over what follows their cached prefixes; rows sharing a prompt
        get copies of its row. Stores the prompts' cache, samples."""
        distinct, index = distinct_prompts(rows)
        self._route(distinct)
        prefixes = None if hits is None else [hits[id(row.request)] for row in distinct]
        shared = shared_length(distinct) if self.shared_prefix_attention and hits is not None else 0
        inputs, attention = prefill_inputs([r.request.prompt_ids for r in distinct], prefixes, self.pad_id,
                                           self.masks, self.device, shared, self.cache_argument)
        output = self.model(**inputs, use_cache=True, logits_to_keep=1)
        cache, logits = output_cache(output), output.logits[:, -1, :]
        if len(distinct) < len(rows):
            copies = torch.tensor(index, dtype=torch.long, device=self.device)
            cache.batch_select_indices(copies)
            attention, logits = attention.index_select(0, copies), logits.index_select(0, copies)
        lengths = torch.tensor([len(r.request.prompt_ids) for r in rows], dtype=torch.long, device=self.device)
        batch = RunningBatch(rows, cache, attention, lengths)
        store_prompts(self.prefix_cache, batch)
        self._sample_step(batch, logits)
        return batch

    def _decode_step(self, batch: RunningBatch) -> RunningBatch | None:
        """One forward pass for every running row (its last sampled token), one new token each."""
        attention = batch.append_column()
        self._route(batch.rows)
        extra: dict[str, Any] = {self.cache_argument: batch.cache}
        if self.shared_prefix_attention and batch.shared_length and len(batch.rows) > 1:
            extra["shared_prefix"] = SharedPrefix.for_step(batch.shared_length, attention)
        output = self.model(input_ids=batch.next_ids.unsqueeze(1), attention_mask=self.masks.decode(attention),
                            position_ids=batch.positions.unsqueeze(1), use_cache=True, **extra)
        batch.cache = output_cache(output)
        batch.positions = batch.positions + 1
        self._sample_step(batch, output.logits[:, -1, :])
        return batch.without_finished()

    def _route(self, rows: list[Row]) -> None:
        """Each row's adapter for the next forward pass (one pass for every mix of adapters)."""
        if self.adapters is not None:
            self.adapters.set_rows([row.request.params.adapter for row in rows])

    def _sample_step(self, batch: RunningBatch, logits: torch.Tensor) -> None:
        """Sample one token per row from ``logits`` [rows, vocab] and hand it to its request."""
        self.stats.forward_passes += 1
        self.stats.max_rows_in_batch = max(self.stats.max_rows_in_batch, len(batch.rows))
        logits = logits.float()
        constrained = batch.sampling.constrained
        allowed = self.grammars.mask(logits, constrained, batch.prefetched_masks) if constrained else logits
        next_ids = self.sampler.sample(allowed, batch.sampling)
        chosen, top = sampled_logprobs(logits, next_ids, batch.sampling)  # of the raw logits: see grammar.py
        next_list = next_ids.tolist()
        for i, row in enumerate(batch.rows):
            if row.request.is_cancelled:
                self._finish(row, "stop")
                continue
            self._append_token(row, i, next_list[i], None if chosen is None else chosen[i], top)
        batch.next_ids = next_ids
        if constrained:  # the next step's masks, computed while its forward pass runs
            going_on = [row.matcher for row in batch.rows if row.matcher is not None and not row.finished]
            batch.prefetched_masks = self.grammars.prefetch(going_on) if going_on else None

    def _append_token(self, row: Row, index: int, token_id: int, logprob: float | None,
                      top: TopLogprobs | None) -> None:
        """Row ``index`` of the batch sampled ``token_id``: record it, stream it, maybe end the row."""
        request = row.request
        params = request.params
        row.ids.append(token_id)
        if row.matcher is not None:
            advance(row.matcher, token_id)
        self.stats.tokens_generated += 1
        top_list = None
        if params.logprobs and logprob is not None:  # not None whenever a row of the batch wants logprobs
            row.logprobs.append(logprob)
            if params.top_logprobs and top is not None:
                top_list = row_top_logprobs(top, index, params.top_logprobs)
                row.top_logprobs.append(top_list)
        reason = self.detokenizer.end_reason(row, token_id)
        delta = ""
        if self.detokenizer.reads_text(request, reason):
            delta, reason = self.detokenizer.advance(row, reason)
        if request.wants_tokens:
            request.emit_token(TokenEvent(row.choice, token_id, delta, logprob if params.logprobs else None,
                                          top_list, reason))
        if reason is not None:
            self._finish(row, reason)

    def _finish(self, row: Row, reason: str) -> None:
        row.finished = True
        row.finish_reason = reason
        row.request.finish_choice(row.choice_result())
