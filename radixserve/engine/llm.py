"""The offline Python API: ``LLM.generate`` / ``LLM.chat`` / ``LLM.stream`` / ``LLM.embed``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from radixserve.core.errors import InputError
from radixserve.core.request import POOLING_KINDS, POOLING_PARAMS, EngineRequest
from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta, l2_normalize

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    """Runs prompts to completion with continuous batching.

    ``LLM(model=None)`` loads the embedded default model; any ``EngineConfig`` field can be
    passed as a keyword (``dtype``, ``kv_cache_memory_gb``, ``page_size`` ...).
    Invariant: every call returns one ``RequestOutput`` per prompt, in input order.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``sampling_params=None`` samples with: the model's generation_config.json
        defaults (``generation_config="auto"``), or the neutral ones (``"neutral"``)."""
        return self.engine.default_sampling_params()

    # -- generate -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (in input order). ``lora``: the LoRA adapter the
        prompts run on (``load_lora`` or ``lora_modules``), one for all or one per prompt
        (None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        loras = _lora_list(lora, len(prompt_list))
        for name in {a for a in loras if a is not None}:
            self.engine.lora(name)  # (LoRANotFound before anything is queued)
        # Validate everything before anything reaches the engine.
        token_ids = [
            self.engine.validate_prompt(p, sp)
            for p, sp in zip(prompt_list, params_list, strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, ids, params, adapter in zip(
            prompt_list, token_ids, params_list, loras, strict=True
        ):
            rid = f"offline-{next(self._ids)}"
            self.engine.submit(EngineRequest(rid, ids, params, lora=adapter))  # (checked above)
            results[rid] = RequestOutput(
                request_id=rid,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(ids),
                outputs=[CompletionOutput(i, "", [], None) for i in range(params.n)],
            )
            order.append(rid)
        remaining = len(order)
        bar = tqdm(total=remaining, desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while remaining:
                for delta in self.engine.step():
                    out = results[delta.request_id]
                    completion = out.outputs[delta.index]
                    completion.text += delta.text
                    completion.token_ids.extend(delta.token_ids)
                    completion.logprobs.extend(delta.logprobs)
                    if delta.prompt_logprobs is not None and out.prompt_logprobs is None:
                        out.prompt_logprobs = [None, *delta.prompt_logprobs]
                    if delta.finished:
                        completion.finish_reason = delta.finish_reason
                        completion.error = delta.error
                        out.num_cached_tokens = max(out.num_cached_tokens, delta.num_cached_tokens)
                        if all(o.finish_reason is not None for o in out.outputs):
                            remaining -= 1
                            bar.update(1)
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        finally:
            bar.close()
        return [results[rid] for rid in order]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str = "last",
        normalize: bool = True,
    ) -> list[np.ndarray]:
        """One embedding per prompt, in input order: the final-norm hidden state pooled
        (``Engine.add_pooling_request``: ``last`` token or ``mean``), L2-normalised unless
        ``normalize=False``; float32 arrays of the model's hidden size. Every prompt is
        checked before any is queued; a failed one raises ``RuntimeError``."""
        prompt_list = _as_prompt_list(prompts)
        if pooling not in POOLING_KINDS:
            raise InputError(
                f"pooling must be one of {', '.join(POOLING_KINDS)}, got {pooling!r}",
                param="pooling",
            )
        token_ids = [
            self.engine.inputs.check_prompt(
                self.engine.inputs.encode(p) if isinstance(p, str) else list(p), 0
            )
            for p in prompt_list
        ]
        order = [f"embed-{next(self._ids)}" for _ in token_ids]
        results: dict[str, np.ndarray] = {}
        try:
            for rid, ids in zip(order, token_ids, strict=True):
                self.engine.submit(EngineRequest(rid, ids, POOLING_PARAMS, pooling=pooling))
            while len(results) < len(order):
                for delta in self.engine.step():
                    if not delta.finished:
                        continue
                    if delta.embedding is None:
                        raise RuntimeError(delta.error or "the pooling request failed")
                    vec = delta.embedding
                    results[delta.request_id] = l2_normalize(vec) if normalize else vec
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        return [results[rid] for rid in order]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if _is_conversation(messages) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora=lora)

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in folder ``path`` as ``name`` (``Engine.load_lora``)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (``Engine.unload_lora``)."""
        self.engine.unload_lora(name)

    def apply_chat_template(
        self, messages: Messages, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation through the model's chat template (the server's
        path too: ``engine.inputs``)."""
        return self.engine.inputs.chat_ids(messages, add_generation_prompt=add_generation_prompt)

    # -- streaming ------------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt | Messages,
        sampling_params: SamplingParams | None = None,
        chat: bool = False,
        lora: str | None = None,
    ) -> Iterator[str]:
        """Yield text deltas of one completion as they are generated (n must be 1)."""
        for delta in self.stream_deltas(prompt, sampling_params, chat, lora):
            if delta.text:
                yield delta.text

    def stream_deltas(
        self,
        prompt: Prompt | Messages,
        sampling_params: SamplingParams | None = None,
        chat: bool = False,
        lora: str | None = None,
    ) -> Iterator[SequenceDelta]:
        """Like ``stream``, but yields the engine's deltas (new token ids, text, finish)."""
        params = sampling_params or self.get_default_sampling_params()
        if params.n != 1:
            raise ValueError("stream() draws one sample; use n=1")
        ids = self.apply_chat_template(prompt) if chat else prompt  # type: ignore[arg-type]
        ids = self.engine.validate_prompt(ids, params)  # type: ignore[arg-type]
        rid = f"stream-{next(self._ids)}"
        self.engine.submit(EngineRequest(rid, ids, params, lora=lora))
        finished = False
        try:
            while not finished:
                for delta in self.engine.step():
                    if delta.finished:
                        if delta.finish_reason == "error":
                            raise RuntimeError(delta.error or "generation failed")
                        finished = True
                    yield delta
        finally:
            if not finished:
                self.engine.abort(rid)
                while self.engine.has_unfinished():
                    self.engine.step()

    def _params_list(
        self, params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params


def _is_conversation(messages: Any) -> bool:
    return isinstance(messages, list) and (not messages or isinstance(messages[0], dict))


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty")
    if all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not isinstance(p, str | list):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p)}")
    return prompts


def _lora_list(lora: str | Sequence[str | None] | None, count: int) -> list[str | None]:
    """One adapter name (or None) per prompt."""
    if lora is None or isinstance(lora, str):
        return [lora] * count
    names = list(lora)
    if len(names) != count:
        raise ValueError(f"lora: {len(names)} adapters for {count} prompts")
    return names
