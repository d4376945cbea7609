"""The embedded policy's generation engine: batched sampling with a KV cache, weight swaps.

Called by the OpenAI-compatible HTTP app (``server/app.py``, directly or through ``link.py``
from its own process), by the training loop (``swap_weights`` after each update) and by
benches. ``PolicyEngine`` is the public face: construction, start/stop, submit/generate,
weight swaps, ``describe`` and version listeners. The work is done by one scheduler thread
(``scheduler.py``) that batches continuously, over the running batch's KV cache
(``kv_cache.py``), per-row sampling (``sampling.py``) and detokenisation (``detokenize.py``);
requests and results are the torch-free types of ``requests.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spanrl.trainer_bridge.torch_backend.config import DEFAULT_PREFIX_CACHE_MB
from spanrl.trainer_bridge.torch_backend.devices import resolve_device, resolve_dtype
from spanrl.trainer_bridge.torch_backend.engine.detokenize import Detokenizer, end_of_sequence_ids
from spanrl.trainer_bridge.torch_backend.engine.grammar import Grammars
from spanrl.trainer_bridge.torch_backend.engine.kv_cache import AttentionMasks
from spanrl.trainer_bridge.torch_backend.engine.multi_lora import AdapterSwap, AdapterWeights, ServedAdapters
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
    WeightsVersionError,
    check_request,
)
from spanrl.trainer_bridge.torch_backend.engine.sampling import Sampler
from spanrl.trainer_bridge.torch_backend.engine.scheduler import Scheduler
from spanrl.trainer_bridge.torch_backend.engine.shared_prefix import use_shared_prefix_attention
from spanrl.trainer_bridge.torch_backend.engine.weight_swaps import PendingSwap
from spanrl.trainer_bridge.torch_backend.server.chat_format import encode_chat, encode_text

if TYPE_CHECKING:
    from spanrl.trainer_bridge.torch_backend.config import EngineConfig


class PolicyEngine:
    """Owns a causal LM and its tokenizer; generates for many requests in shared batches.

    Build with ``PolicyEngine.from_pretrained(model_dir)``, ``PolicyEngine.from_config(model_dir,
    EngineConfig(...))`` or ``PolicyEngine(model, tokenizer)``. Call ``start()`` (the server
    does) before ``submit``/``generate``; ``stop()`` at the end.
    """

    def __init__(self, model: Any, tokenizer: Any, model_name: str = "policy", version: int = 0,
                 max_batch_size: int = 64, max_n: int = 64, batch_wait_s: float = 0.02,
                 max_queued_requests: int = 1024, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 shared_prefix_attention: bool = True):
        self.model = model.eval()
        # decode steps read a prompt beginning every row shares once (engine/shared_prefix.py)
        shared_attention = shared_prefix_attention and use_shared_prefix_attention(model)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_n = max_n
        self.device = next(model.parameters()).device
        config = model.config
        self.context_length = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        self.limits = EngineLimits(int(config.vocab_size), self.context_length, min(max_n, max_batch_size))
        self._detokenizer = Detokenizer(tokenizer, end_of_sequence_ids(model, tokenizer))
        self._masks = AttentionMasks(model)
        self._scheduler = Scheduler(
            model, self._detokenizer, Sampler(self.device), self._masks,
            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            version=version, max_batch_size=max_batch_size, batch_wait_s=batch_wait_s,
            grammars=Grammars(tokenizer, self._detokenizer), max_queued=max_queued_requests,
            prefix_cache_bytes=int(prefix_cache_mb * 2**20), shared_prefix_attention=shared_attention)
        self.stats: EngineStats = self._scheduler.stats
        self._directory_load = threading.Lock()  # one HTTP weight load at a time: its version check holds

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str | None = None,
                        dtype: str | None = None, model_name: str | None = None,
                        version: int = 0, max_batch_size: int = 64, batch_wait_s: float = 0.02,
                        max_queued_requests: int = 1024,
                        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB) -> PolicyEngine:
        """Load a Hugging Face model directory; ``device``/``dtype`` as ``devices.py`` reads them."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = resolve_device(device)
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=resolve_dtype(dtype, dev))
        model.to(dev)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        name = model_name or Path(str(model_dir)).resolve().name
        return cls(model, tokenizer, model_name=name, version=version, max_batch_size=max_batch_size,
                   batch_wait_s=batch_wait_s, max_queued_requests=max_queued_requests,
                   prefix_cache_mb=prefix_cache_mb)

    @classmethod
    def from_config(cls, model_dir: str | Path, config: EngineConfig, model_name: str | None = None,
                    version: int = 0) -> PolicyEngine:
        """``from_pretrained`` with an ``EngineConfig``'s settings; its ``threads`` (when > 0)
        sets torch's intra-op threads for the whole process, as ``spanrl serve --threads`` does."""
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        return cls.from_pretrained(model_dir, device=config.device, dtype=config.dtype, model_name=model_name,
                                   version=version, max_batch_size=config.max_batch_size,
                                   batch_wait_s=config.batch_wait_ms / 1000.0,
                                   prefix_cache_mb=config.prefix_cache_mb)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> PolicyEngine:
        self._scheduler.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still queued or decoding fail with ``EngineStoppedError``."""
        self._scheduler.stop(timeout)

    @property
    def is_running(self) -> bool:
        return self._scheduler.thread is not None

    # ------------------------------------------------------------------ state and settings

    @property
    def version(self) -> int:
        """The serving policy version (changed by weight swaps)."""
        return self._scheduler.version

    @property
    def max_batch_size(self) -> int:
        return self._scheduler.max_batch_size

    @property
    def batch_wait_s(self) -> float:
        """The longest a newcomer waits before it joins a running batch (see ``scheduler.py``)."""
        return self._scheduler.batch_wait_s

    @batch_wait_s.setter
    def batch_wait_s(self, seconds: float) -> None:
        self._scheduler.batch_wait_s = seconds

    @property
    def eos_ids(self) -> set[int]:
        """The token ids that end a sequence (replaceable: tests forbid the end of sequence)."""
        return self._detokenizer.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self._detokenizer.eos_ids = ids

    @property
    def own_masks(self) -> bool:
        """Whether the engine builds the model's 4D attention masks (off: transformers builds
        them from the 2D mask, as tests compare)."""
        return self._masks.own

    @own_masks.setter
    def own_masks(self, own: bool) -> None:
        self._masks.own = own

    @property
    def pending_swap(self) -> PendingSwap | None:
        """A weight swap waiting for the engine to be idle, or None."""
        return self._scheduler.pending_swap

    def describe(self) -> dict:
        """The serving version, the model's name, its adapters and the counters (``GET /spanrl/v1/policy``)."""
        return {"version": self.version, "model": self.model_name, "adapters": dict(self.adapters),
                "stats": asdict(self.stats)}

    @property
    def adapters(self) -> dict[str, tuple[str, ...]]:
        """The LoRA adapters served beside the base model: name -> the agents it serves."""
        served = self._scheduler.adapters
        return dict(served.agents) if served is not None else {}

    def add_version_listener(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(version)`` from the engine thread each time new weights are swapped in."""
        self._scheduler.version_listeners.append(callback)

    # ------------------------------------------------------------------ requests

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a chat, with the generation prompt (``<|im_start|>assistant\\n``)."""
        return encode_chat(self.tokenizer, messages)

    def encode_text(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

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
        """Queue a request made by ``new_request``; ``EngineStoppedError`` when not running."""
        self._scheduler.enqueue(request)

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 timeout: float | None = None) -> GenerationResult:
        """Blocking ``submit`` + wait."""
        return self.submit(prompt_ids, params or SamplingParams()).wait(timeout)

    # ------------------------------------------------------------------ weights

    def swap_weights(self, state_dict: dict, version: int, timeout: float | None = 600.0) -> None:
        """Load ``state_dict`` into the serving model and set the policy version, atomically.

        Applied by the engine thread between batches (immediately when idle): no sequence ever
        sees two weight sets. Blocks until applied, so the caller may change its tensors after.
        A PEFT state dict must be merged first (``TorchTrainer.policy_state_dict()``).
        A second call before the first was applied supersedes it: only the newest weights
        are loaded, and the earlier caller gets ``EngineError`` ("superseded by version N")
        at once instead of waiting.
        """
        self._scheduler.swap_weights(state_dict, version, timeout)

    def attach_adapters(self, weights: AdapterWeights, agents: dict[str, tuple[str, ...]]) -> None:
        """Serve these LoRA adapters beside the base model, all at once (``multi_lora.py``); before
        ``start``. A request picks one by ``SamplingParams.adapter``."""
        if self.is_running:
            raise RuntimeError("attach the adapters before the engine starts")
        self._scheduler.adapters = ServedAdapters.attach(self.model, weights, agents)

    def swap_adapters(self, weights: AdapterWeights, version: int, timeout: float | None = 600.0) -> None:
        """The adapters' new weights and the new policy version, applied as ``swap_weights`` is
        (between batches; the base weights unchanged)."""
        self._scheduler.swap_weights(AdapterSwap(weights), version, timeout)

    def load_weights_from_dir(self, model_dir: str | Path, version: int) -> None:
        """Read an HF model directory's weights and swap them in (``POST /spanrl/v1/weights``).

        ``version`` must be above the serving version and any swap still pending
        (``WeightsVersionError`` otherwise): an older directory never replaces newer weights."""
        from transformers import AutoModelForCausalLM

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise EngineError(f"{str(path)!r} is not a Hugging Face model directory (no config.json)", "path")
        with self._directory_load:
            pending = self.pending_swap
            newest = max(self.version, pending.version if pending is not None else self.version)
            if int(version) <= newest:
                raise WeightsVersionError(f"version {version} is not above the serving version {newest}",
                                          "version")
            loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=next(self.model.parameters()).dtype)
            self.swap_weights(loaded.state_dict(), version)


__all__ = ["PolicyEngine", "SamplingParams", "GenerationResult", "ChoiceResult", "TokenEvent",
           "EngineError", "PromptTooLongError", "EngineStoppedError"]
