"""The embedded policy's generation engine: batched sampling with a KV cache, weight swaps.

Called by ``policy_server.py`` (the OpenAI-compatible HTTP front end), by the training loop
(``swap_weights`` after each update) and by benches. One scheduler thread owns the model and
batches continuously: requests that arrive while rows are decoding join the running batch at
the next step (one prefill pass for the newcomers, whose KV cache is then merged into the
batch's, left-padded), and finished rows leave it at once. One forward pass per step decodes
a token for every row, each row with its own sampling parameters, seed and stop conditions.
Tokens are handed to each request's callback as they are sampled, so streaming works inside
a batch. New weights are applied only when no row is decoding (while a swap is pending no
new row joins), so every sequence is produced by exactly one policy version.

Logprobs are ``log_softmax`` of the model's raw logits (temperature 1, no top-k/top-p) at the
sampled token: they equal a forward pass of the same model over prompt + response, which is
what the trainer's importance ratio needs, whatever temperature the request sampled with.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from spanrl.trainer_bridge.torch_backend.engine.requests import (
    ChoiceResult,
    EngineError,
    EngineLimits,
    EngineStats,
    EngineStoppedError,
    GenerationRequest,
    GenerationResult,
    PromptTooLongError,
    SamplingParams,
    TokenEvent,
    check_request,
    safe_call,
)
from spanrl.trainer_bridge.torch_backend.server.chat_format import encode_chat, encode_text

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    """One sequence being decoded (one choice of one request)."""

    request: GenerationRequest
    choice: int
    generator: torch.Generator | None
    queued_at: float = 0.0  # time.monotonic() when it started waiting
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    emitted_chars: int = 0
    text: str = ""
    finished: bool = False
    finish_reason: str = "length"


class _Running:
    """The rows decoding together: their KV cache and per-row tensors (index i is ``rows[i]``).

    Rows are left-padded: each row's tokens are the last columns of ``attention`` (1 = a real
    token) and of the cache. Rows leave (``without_finished``) and join (``merge``) between
    steps; columns that are padding for every row are cut off, so the cache stays as wide as
    its longest row, not as long as the batch has been running. ``joinable`` is False for a
    cache this class cannot re-pack (sliding-window layers): such a batch takes no new rows.
    """

    def __init__(self, rows: list[_Row], cache, attention: torch.Tensor, positions: torch.Tensor):
        self.rows = rows
        self.cache = cache  # a transformers DynamicCache, tensors [rows, heads, columns, head_dim]
        self.joinable = _cache_is_joinable(cache)
        self.attention = attention  # [rows, columns]
        self.positions = positions  # [rows]: position id of each row's next input token
        self.next_ids: torch.Tensor | None = None  # [rows]: each row's last sampled token
        self._refresh_params()

    def _refresh_params(self) -> None:
        """Per-row sampling tensors and flags, rebuilt only when rows join or leave."""
        device = self.attention.device
        params = [r.request.params for r in self.rows]
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=device)
        self.want_logprobs = any(p.logprobs for p in params)
        self.want_top = max(p.top_logprobs for p in params)
        greedy = [p.temperature == 0 for p in params]
        self.greedy = torch.tensor(greedy, device=device)
        self.all_greedy, self.any_greedy = all(greedy), any(greedy)
        truncating = [i for i, p in enumerate(params) if not greedy[i] and (p.top_k > 0 or p.top_p < 1.0)]
        self.truncating = torch.tensor(truncating, dtype=torch.long, device=device) if truncating else None
        shared = [i for i, r in enumerate(self.rows) if not greedy[i] and r.generator is None]
        self.only_shared = len(shared) == len(self.rows)  # the usual case: one draw for all rows
        self.shared = torch.tensor(shared, dtype=torch.long, device=device) if shared else None
        self.seeded = [(i, r.generator) for i, r in enumerate(self.rows) if not greedy[i] and r.generator is not None]

    def without_finished(self) -> _Running | None:
        """This batch without its finished rows (None when none is left)."""
        keep = [i for i, row in enumerate(self.rows) if not row.finished]
        if len(keep) == len(self.rows):
            return self
        if not keep:
            return None
        index = torch.tensor(keep, device=self.attention.device)
        self.rows = [self.rows[i] for i in keep]
        self.attention = self.attention.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.next_ids = self.next_ids.index_select(0, index)
        self.cache.batch_select_indices(index)
        if self.joinable:
            self._cut_unused_columns()
        self._refresh_params()
        return self

    def _cut_unused_columns(self) -> None:
        used = self.attention.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first:
            self.attention = self.attention[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def merge(self, other: _Running) -> _Running:
        """This batch followed by ``other``'s rows, both left-padded to the wider one's columns."""
        mine, theirs = self.attention.shape[1], other.attention.shape[1]
        width = max(mine, theirs)
        for layer, joining in zip(self.cache.layers, other.cache.layers):
            layer.keys = torch.cat([_left_pad(layer.keys, width, 2), _left_pad(joining.keys, width, 2)])
            layer.values = torch.cat([_left_pad(layer.values, width, 2), _left_pad(joining.values, width, 2)])
        self.attention = torch.cat([_left_pad(self.attention, width, 1), _left_pad(other.attention, width, 1)])
        self.positions = torch.cat([self.positions, other.positions])
        self.next_ids = torch.cat([self.next_ids, other.next_ids])
        self.rows = self.rows + other.rows
        self._refresh_params()
        return self


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tensor`` with zeros prepended along ``dim`` up to ``width`` (masked columns)."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _cache_is_joinable(cache) -> bool:
    """Whether rows of two batches can be merged: every layer a plain, full-attention cache
    of ``keys``/``values`` tensors (a sliding window is not re-packed by this engine)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    return all(not getattr(layer, "is_sliding", False) and isinstance(getattr(layer, "keys", None), torch.Tensor)
               for layer in layers)


def _fail_rows(rows: list[_Row], error: BaseException) -> None:
    for request in {id(r.request): r.request for r in rows}.values():
        request._complete(error)


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(names)}")
    return names[dtype]


class PolicyEngine:
    """Owns a causal LM and its tokenizer; generates for many requests in shared batches.

    Build with ``PolicyEngine.from_pretrained(model_dir)`` or ``PolicyEngine(model, tokenizer)``.
    Call ``start()`` (the server does) before ``submit``/``generate``; ``stop()`` at the end.
    """

    def __init__(self, model, tokenizer, model_name: str = "policy", version: int = 0,
                 max_batch_size: int = 64, max_n: int = 64, batch_wait_s: float = 0.02):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.version = version
        self.max_batch_size = max_batch_size
        # newcomers join a running batch once they are this share of it, or waited batch_wait_s
        # (_time_to_join); 0.25 measured best on the bench (0.125-0.5 within noise, 0 worse)
        self.batch_wait_s = batch_wait_s
        self.join_fraction = 0.25
        self.max_n = max_n
        self.device = next(model.parameters()).device
        config = model.config
        self.context_length = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = self._eos_ids(model, tokenizer)
        # our own 4D masks where attention takes one: transformers builds a padded batch's mask
        # in Python each pass (~0.1-0.3 ms at 16 rows; nothing at 1 row). sdpa takes a boolean
        # mask (True: attend; a quarter of a float mask's memory), eager an additive one
        attention_kind = getattr(config, "_attn_implementation", None)
        self._own_masks = attention_kind in ("sdpa", "eager")
        self._additive_masks = attention_kind == "eager"
        self._mask_dtype = next(model.parameters()).dtype
        self.limits = EngineLimits(int(config.vocab_size), self.context_length, min(max_n, max_batch_size))
        self._version_listeners: list[Callable[[int], None]] = []
        self.stats = EngineStats()
        self._queue: queue.Queue[GenerationRequest | None] = queue.Queue()
        self._waiting: list[_Row] = []
        self._pending_swap: tuple[dict, int, threading.Event, list] | None = None
        self._swap_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._default_generator = torch.Generator(device=self.device)
        self._default_generator.manual_seed(int(time.time_ns()) & 0xFFFFFFFF)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str | None = None,
                        dtype: str | None = None, model_name: str | None = None,
                        version: int = 0, max_batch_size: int = 64,
                        batch_wait_s: float = 0.02) -> PolicyEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = resolve_device(device)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=resolve_dtype(dtype, dev))
        model.to(dev)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        name = model_name or Path(str(model_dir)).resolve().name
        return cls(model, tokenizer, model_name=name, version=version, max_batch_size=max_batch_size,
                   batch_wait_s=batch_wait_s)

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        return ids

    # ------------------------------------------------------------------ public API

    def start(self) -> PolicyEngine:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="spanrl-policy-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a chat, with the generation prompt (``<|im_start|>assistant\\n``)."""
        return encode_chat(self.tokenizer, messages)

    def encode_text(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def describe(self) -> dict:
        """The serving version, the model's name and the counters (``GET /spanrl/v1/policy``)."""
        return {"version": self.version, "model": self.model_name, "stats": asdict(self.stats)}

    def add_version_listener(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(version)`` from the engine thread each time new weights are swapped in."""
        self._version_listeners.append(callback)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_token: Callable[[TokenEvent], None] | None = None,
               on_start: Callable[[int], None] | None = None,
               on_done: Callable[[], None] | None = None,
               text_deltas: bool = True) -> GenerationRequest:
        """Queue a request; raises ``EngineError`` for bad params or a prompt that does not fit.

        ``on_start(policy_version)`` is called when its batch starts; ``on_token`` for each
        sampled token, ``on_done()`` once it finished or failed, all from the engine thread.
        ``text_deltas=False``: token events carry no text (it is decoded once at the end).
        """
        request = self.new_request(prompt_ids, params, on_token, on_start, on_done, text_deltas)
        self.enqueue(request)
        return request

    def new_request(self, prompt_ids: list[int], params: SamplingParams,
                    on_token: Callable[[TokenEvent], None] | None = None,
                    on_start: Callable[[int], None] | None = None,
                    on_done: Callable[[], None] | None = None,
                    text_deltas: bool = True) -> GenerationRequest:
        """``submit``'s first half: the checked request, not queued yet (a caller that must
        file it somewhere before any callback can run queues it with ``enqueue``)."""
        max_new_tokens = check_request(prompt_ids, params, self.limits)
        return GenerationRequest(list(prompt_ids), params, max_new_tokens, on_token, on_start, on_done,
                                 text_deltas)

    def enqueue(self, request: GenerationRequest) -> None:
        if self._thread is None or self._stopping:
            raise EngineStoppedError("the policy engine is not running")
        self._queue.put(request)

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 timeout: float | None = None) -> GenerationResult:
        """Blocking ``submit`` + wait."""
        return self.submit(prompt_ids, params or SamplingParams()).wait(timeout)

    def swap_weights(self, state_dict: dict, version: int, timeout: float | None = 600.0) -> None:
        """Load ``state_dict`` into the serving model and set the policy version, atomically.

        Applied by the engine thread between batches (immediately when idle): no sequence ever
        sees two weight sets. Blocks until applied, so the caller may change its tensors after.
        A PEFT state dict must be merged first (``TorchTrainer.policy_state_dict()``).
        A second call before the first was applied supersedes it: only the newest weights
        are loaded, and the earlier caller gets ``EngineError`` ("superseded by version N")
        at once instead of waiting.
        """
        done = threading.Event()
        outcome: list = []
        with self._swap_lock:
            superseded, self._pending_swap = self._pending_swap, (state_dict, int(version), done, outcome)
        if superseded is not None:
            _, old_version, old_done, old_outcome = superseded
            old_outcome.append(EngineError(
                f"the weight swap to version {old_version} was superseded by version {int(version)} "
                f"before it was applied"))
            old_done.set()
        if self._thread is None:
            self._apply_pending_swap()
        else:
            self._queue.put_nowait(_WAKE)  # wake an idle engine thread
        if not done.wait(timeout):
            raise TimeoutError("the weight swap was not applied in time")
        if outcome and isinstance(outcome[0], BaseException):
            raise outcome[0]

    def load_weights_from_dir(self, model_dir: str | Path, version: int) -> None:
        """Read an HF model directory's weights and swap them in (``POST /spanrl/v1/weights``)."""
        from transformers import AutoModelForCausalLM

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise EngineError(f"{str(path)!r} is not a Hugging Face model directory (no config.json)", "path")
        loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=next(self.model.parameters()).dtype)
        self.swap_weights(loaded.state_dict(), version)

    # ------------------------------------------------------------------ engine thread

    def _apply_pending_swap(self) -> None:
        with self._swap_lock:
            pending, self._pending_swap = self._pending_swap, None
        if pending is None:
            return
        state_dict, version, done, outcome = pending
        try:
            with torch.no_grad():
                missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
            missing = [k for k in missing if not k.endswith("lm_head.weight")]
            if missing or unexpected:
                raise EngineError(f"the new weights do not match the model: missing {missing[:3]}, "
                                  f"unexpected {list(unexpected)[:3]}")
            self.version = version
            logger.info("policy weights swapped in: version %d", version)
            for listener in self._version_listeners:
                safe_call(listener, version)
        except BaseException as exc:  # reported to the caller of swap_weights
            outcome.append(exc)
        finally:
            done.set()

    def _run(self) -> None:
        torch.set_num_threads(torch.get_num_threads())  # this thread uses the process's setting
        with torch.inference_mode():  # no autograd bookkeeping: cheaper per operation than no_grad
            self._serve()

    def _serve(self) -> None:
        running: _Running | None = None
        while not self._stopping:
            idle = running is None
            # never sleep on a pending swap: its wake-up may have been taken while rows ran
            self._collect(block=idle and self._pending_swap is None)
            if idle:
                self._apply_pending_swap()  # nothing is decoding: the only safe moment
            if self._stopping:
                break
            try:
                running = self._admit_waiting(running)
                if running is not None:
                    running = self._decode_step(running)
            except Exception as exc:  # never let one bad step kill the server
                logger.exception("generation failed")
                if running is not None:
                    _fail_rows(running.rows, exc)
                running = None
        stopped = EngineStoppedError("the policy engine stopped")
        if running is not None:
            _fail_rows(running.rows, stopped)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, GenerationRequest):
                item._complete(stopped)
        _fail_rows(self._waiting, stopped)
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

    def _enqueue(self, item) -> None:
        if item is None:
            self._stopping = True
            return
        if item is _WAKE:
            return
        request: GenerationRequest = item
        for choice in range(request.params.n):
            generator = None
            if request.params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(int(request.params.seed) + choice)
            row = _Row(request=request, choice=choice, generator=generator, queued_at=time.monotonic())
            request._rows.append(row)
            self._waiting.append(row)

    def _admit_waiting(self, running: _Running | None) -> _Running | None:
        """Continuous batching: waiting rows join the running batch now, at the next step,
        instead of waiting for the whole batch to finish. Nothing joins while a weight swap
        is pending: the running rows finish on the old weights, then the swap is applied."""
        if not self._waiting or self._pending_swap is not None:
            return running
        if running is not None and not running.joinable:
            return running  # a cache that cannot be re-packed: new rows wait for the next batch
        if running is not None and not self._time_to_join(len(running.rows)):
            return running
        room = self.max_batch_size - (len(running.rows) if running is not None else 0)
        rows = self._take_rows(room)
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

    def _take_rows(self, room: int) -> list[_Row]:
        """The oldest waiting rows that fit in ``room``, never splitting a request's choices.
        Requests cancelled while they waited finish here, without a forward pass."""
        taken = 0
        while taken < len(self._waiting):
            size = self._waiting[taken].request.params.n
            if taken + size > room:
                break
            taken += size
        rows, self._waiting = self._waiting[:taken], self._waiting[taken:]
        live = []
        for row in rows:
            if row.request.cancelled:
                if row.request.policy_version is None:
                    row.request.policy_version = self.version
                self._finish(row, "stop")
            else:
                live.append(row)
        return live

    def _prefill(self, rows: list[_Row]) -> _Running | None:
        """One forward pass over the new rows' left-padded prompts; samples their first token.
        None when they all finished at once, or when the pass failed (their requests get the
        error; the running batch is not touched)."""
        version = self.version
        self.stats.batches += 1
        for request in {id(r.request): r.request for r in rows}.values():
            request.policy_version = version
            if request.on_start is not None:
                safe_call(request.on_start, version)
        try:
            lengths = [len(r.request.prompt_ids) for r in rows]
            width = max(lengths)
            input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            attention = torch.zeros((len(rows), width), dtype=torch.long)
            for i, row in enumerate(rows):
                input_ids[i, width - lengths[i]:] = torch.tensor(row.request.prompt_ids, dtype=torch.long)
                attention[i, width - lengths[i]:] = 1
            input_ids, attention = input_ids.to(self.device), attention.to(self.device)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            output = self.model(input_ids=input_ids, attention_mask=self._prefill_mask(attention),
                                position_ids=positions,
                                use_cache=True, logits_to_keep=1)
            batch = _Running(rows, output.past_key_values, attention,
                             torch.tensor(lengths, dtype=torch.long, device=self.device))
            self._sample_step(batch, output.logits[:, -1, :])
        except Exception as exc:  # never let one bad request kill the server
            logger.exception("generation failed")
            _fail_rows(rows, exc)
            return None
        return batch.without_finished()

    def _decode_step(self, batch: _Running) -> _Running | None:
        """One forward pass for every running row (its last sampled token), one new token each."""
        batch.attention = torch.cat([batch.attention, batch.attention.new_ones((len(batch.rows), 1))], dim=1)
        output = self.model(input_ids=batch.next_ids.unsqueeze(1), attention_mask=self._decode_mask(batch.attention),
                            position_ids=batch.positions.unsqueeze(1), past_key_values=batch.cache,
                            use_cache=True)
        batch.cache = output.past_key_values
        batch.positions = batch.positions + 1
        self._sample_step(batch, output.logits[:, -1, :])
        return batch.without_finished()

    def _decode_mask(self, attention: torch.Tensor) -> torch.Tensor:
        """What one decode step attends to, every row's real columns ([rows, 1, 1, columns]), or
        the 2D mask when the model builds its own."""
        if not self._own_masks:
            return attention
        return self._as_model_mask(attention.bool()[:, None, None, :])

    def _prefill_mask(self, attention: torch.Tensor) -> torch.Tensor:
        """Causal and left-padding mask of a prefill pass ([rows, 1, columns, columns]). A
        padding query may see every column (its output is never used): with older torch a
        query that sees none gives NaN, which would reach real rows through the values."""
        if not self._own_masks:
            return attention
        width = attention.shape[1]
        real = attention.bool()
        causal = torch.ones((width, width), dtype=torch.bool, device=attention.device).tril()
        allowed = (causal.unsqueeze(0) & real.unsqueeze(1)) | ~real.unsqueeze(2)
        return self._as_model_mask(allowed.unsqueeze(1))

    def _as_model_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        if not self._additive_masks:
            return allowed
        mask = torch.zeros(allowed.shape, dtype=self._mask_dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(self._mask_dtype).min)

    def _sample_step(self, batch: _Running, logits: torch.Tensor) -> None:
        """Sample one token per row from ``logits`` [rows, vocab] and hand it to its request."""
        self.stats.forward_passes += 1
        self.stats.max_rows_in_batch = max(self.stats.max_rows_in_batch, len(batch.rows))
        logits = logits.float()
        next_ids = self._sample(logits, batch)
        chosen = top = None
        if batch.want_logprobs:  # skipped when no row asked: a log_softmax over the vocabulary per step
            logprobs = torch.log_softmax(logits, dim=-1)
            chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
            if batch.want_top:
                top_values, top_indices = logprobs.topk(batch.want_top, dim=-1)
                top = (top_values.tolist(), top_indices.tolist())
        next_list = next_ids.tolist()
        for i, row in enumerate(batch.rows):
            if row.request.cancelled:
                self._finish(row, "stop")
                continue
            self._append_token(row, next_list[i], None if chosen is None else chosen[i],
                               None if top is None else (top[0][i], top[1][i]))
        batch.next_ids = next_ids

    def _sample(self, logits: torch.Tensor, batch: _Running) -> torch.Tensor:
        """One token per row: greedy at temperature 0, else from softmax(logits / T) truncated by
        the row's top-k / top-p. Always sampled in vocabulary order, so a seeded row draws the
        same token whatever else shares its batch; the sort is paid only by truncating rows."""
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        scaled = logits / batch.temperature.clamp(min=1e-5).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        if batch.truncating is not None:
            which = batch.truncating
            sorted_logits, sorted_index = scaled[which].sort(dim=-1, descending=True)
            rank = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
            k = batch.top_k[which].unsqueeze(1)
            remove = (k > 0) & (rank >= k)
            sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            before = sorted_probs.cumsum(-1) - sorted_probs  # probability mass ranked above each token
            remove |= (before >= batch.top_p[which].unsqueeze(1)) & (rank > 0)
            sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            probs[which] = torch.zeros_like(sorted_probs).scatter(1, sorted_index, sorted_probs)
        if batch.only_shared:  # the usual case: one draw for the whole batch
            return _draw(probs, self._default_generator)
        picks = torch.zeros(len(batch.rows), dtype=torch.long, device=scaled.device)
        if batch.shared is not None:
            picks[batch.shared] = _draw(probs[batch.shared], self._default_generator)
        for i, generator in batch.seeded:
            picks[i] = _draw(probs[i:i + 1], generator)[0]
        if batch.any_greedy:
            picks = torch.where(batch.greedy, logits.argmax(dim=-1), picks)
        return picks

    def _append_token(self, row: _Row, token_id: int, logprob: float, top) -> None:
        params = row.request.params
        row.ids.append(token_id)
        self.stats.tokens_generated += 1
        top_list = None
        if params.logprobs:
            row.logprobs.append(logprob)
            if params.top_logprobs and top is not None:
                top_list = [(int(t), float(v)) for v, t in zip(top[0][: params.top_logprobs],
                                                             top[1][: params.top_logprobs])]
                row.top_logprobs.append(top_list)
        reason = None
        if token_id in self.eos_ids:
            reason = "stop"
        if reason is None and len(row.ids) >= row.request.max_new_tokens:
            reason = "length"
        if not (params.stop or row.request.text_deltas or reason is not None):
            # nobody reads text before the end: skip the per-token decode
            if row.request.on_token is not None:
                safe_call(row.request.on_token, TokenEvent(
                    row.choice, token_id, "", logprob if params.logprobs else None, top_list, None))
            return
        text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
        if params.stop:
            hits = [text.find(s, max(0, row.emitted_chars - len(s))) for s in params.stop]
            hits = [h for h in hits if h >= 0]
            if hits:
                text = text[: min(hits)]
                reason = "stop"
        row.text = text
        if reason is None:
            holdback = max((len(s) - 1 for s in params.stop), default=0)
            printable = len(text) - holdback
            while printable > row.emitted_chars and text[printable - 1] == "\ufffd":
                printable -= 1  # an unfinished UTF-8 sequence: wait for its next byte
        else:
            printable = len(text)
        delta = text[row.emitted_chars:printable] if printable > row.emitted_chars else ""
        row.emitted_chars = max(row.emitted_chars, printable)
        if row.request.on_token is not None:
            safe_call(row.request.on_token,
                       TokenEvent(row.choice, token_id, delta, logprob if params.logprobs else None, top_list,
                                  reason))
        if reason is not None:
            self._finish(row, reason)

    def _finish(self, row: _Row, reason: str) -> None:
        row.finished = True
        row.finish_reason = reason
        request = row.request
        request._rows_left -= 1
        if request._rows_left == 0:
            choices = []
            for r in sorted(request._rows, key=lambda r: r.choice):
                choices.append(ChoiceResult(
                    index=r.choice, token_ids=list(r.ids), text=r.text, finish_reason=r.finish_reason,
                    logprobs=list(r.logprobs) if request.params.logprobs else None,
                    top_logprobs=list(r.top_logprobs) if request.params.top_logprobs else None))
            request.result = GenerationResult(request.prompt_ids, choices, int(request.policy_version or 0))
            request._complete()


_WAKE = object()


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [rows, vocab]: the first whose cumulative probability
    exceeds a uniform draw (scaled to the row's total, so rounding never overshoots). One
    random number per row, in vocabulary order: on CPU ~10x cheaper than torch.multinomial
    for a batch, and a zero-probability (truncated) token is never picked."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def log_softmax_of_sampled(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[ids]`` over the last axis; shared with tests and the trainer."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


__all__ = ["PolicyEngine", "SamplingParams", "GenerationResult", "ChoiceResult", "TokenEvent",
           "EngineError", "PromptTooLongError", "EngineStoppedError"]
