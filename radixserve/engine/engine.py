"""The engine loop: submit / add_request / abort / step / stats over the parts ``builder.py``
builds, shared by the offline API and the server."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.core.errors import InputError, LoRAError, LoRANotFound
from radixserve.core.radix_summary import RadixSummaryData, summarize
from radixserve.core.request import (
    POOLING_KINDS,
    POOLING_PARAMS,
    EngineRequest,
    FinishReason,
    Request,
    RequestState,
    Tenant,
    cache_namespace,
)
from radixserve.core.sampling_params import SamplingParams
from radixserve.core.step import ScheduledBatch
from radixserve.engine.builder import EngineParts, build_engine, make_device
from radixserve.engine.config import EngineConfig
from radixserve.engine.model_source import ModelSource
from radixserve.engine.output_processor import RequestOutputProcessor
from radixserve.engine.outputs import CacheFlushResult, EngineStats, SequenceDelta
from radixserve.engine.structured import GrammarWaitList
from radixserve.executor.device import StepHandle, StepResult
from radixserve.executor.distributed import DeviceLost, TensorParallelGroup
from radixserve.executor.grammar import GrammarService
from radixserve.executor.kv_tiers import TierTransfer
from radixserve.executor.lora import LoRAAdapter
from radixserve.executor.lora_loader import LoRARegistry
from radixserve.executor.sampler import TokenLogprobs
from radixserve.scheduler.scheduler import EngineOverloaded

__all__ = ["Engine", "EngineOverloaded"]  # EngineOverloaded: add_request's refusal

logger = logging.getLogger(__name__)

_SIMULATED_KV_PAGES = 1 << 16
_SIMULATED_MAX_MODEL_LEN = 8192
_IDLE_POLL_S = 0.002  # longest doze of an idle step while a batch wait is pending


@dataclass
class _Sequence:
    """Engine-side bookkeeping of one running sample."""

    request_id: str
    index: int
    stop_token_ids: frozenset[int]
    # prompt logprobs by position (entry p: prompt token p + 1), filled as chunks run and
    # sent once with the first output token; None when not asked for (or already sent)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # a pooling request: the kind; with "mean", the sum of the final hidden states of its
    # prompt positions 0 .. pool_tokens - 1 computed so far (float32)
    pooling: str | None = None
    pool_sum: np.ndarray | None = None
    pool_tokens: int = 0


def _queue_time(req: Request) -> float | None:
    """Seconds from arrival to first admission (None: never admitted)."""
    t = req.first_scheduled_time
    return None if t is None else t - req.arrival_time


class Engine:
    """Owns the model, the KV cache and the scheduler; turns requests into token streams.

    Invariants:
      * every sample added ends with exactly one finished ``SequenceDelta``: stop, length,
        abort, or error (an exception in a step fails that step's requests, not the engine);
      * after ``step`` returns, every KV page is free or held by a running request
        (``check_page_accounting``);
      * overlapped (``config.overlap``), each ``step`` launches step N and then processes
        step N-1, whose device work is done or nearly so; at most one step is in flight
        between calls. A token computed for a request after it ended is never emitted:
        serial and overlapped loops emit the same tokens.
    """

    def __init__(self, config: EngineConfig | None = None, detokenize: bool = True) -> None:
        """Build the engine's parts (``builder.build_engine``: model, tokenizer, KV cache
        and tiers, scheduler, runner, device, speculation) and start with nothing queued.
        ``detokenize=False``: deltas carry token ids only (empty text) and stop strings are
        not looked for — a frontend that detokenizes does both (the server does), with the
        same ``RequestOutputProcessor`` the engine uses otherwise."""
        parts = build_engine(config or EngineConfig(), detokenize)
        try:
            self._start(parts)
        except BaseException:
            if parts.kv_publisher is not None:  # (the one part holding a socket open)
                parts.kv_publisher.close()
            raise

    def _start(self, parts: EngineParts) -> None:
        """``__init__``'s work on the built parts."""
        config = parts.config
        self.config = parts.config
        self.detokenize = parts.detokenize
        self.source: ModelSource = parts.source
        self.fatal_error: str | None = None  # set when the engine can run no more steps
        # the model (None on a simulated device) and what it says of itself
        m = parts.loaded
        self.model, self.model_config, self.dtype = m.model, m.model_config, m.dtype
        self.torch_device, self.weight_bytes = m.torch_device, m.weight_bytes
        self.model_pooling, self.matryoshka_dimensions = m.model_pooling, m.matryoshka_dimensions
        self.tp: TensorParallelGroup | None = m.tp
        self._threads_before = m.threads_before
        self.tokenizer, self.inputs = m.tokenizer, parts.inputs
        self.vocab_size, self.max_model_len = m.vocab_size, m.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        # the KV cache's bookkeeping, the scheduler, the runner and what runs its steps
        self.pool, self.page_table = parts.pool, parts.page_table
        self.prefix_cache, self.kv_manager = parts.prefix_cache, parts.kv_manager
        self.scheduler, self.sampler, self.runner = parts.scheduler, parts.sampler, parts.runner
        self.kv_transfer: TierTransfer | None = parts.kv_transfer
        self.loras: LoRARegistry | None = parts.loras  # the LoRA adapters it serves
        self.kv_publisher = parts.kv_publisher  # the radix tree's KV events out (if on)
        self.overlap = config.overlap
        self.faults = parts.faults
        self.device = make_device(config, lambda step: self.runner.run(step), parts.faults)
        self.startup_line = parts.startup_line
        # speculative decoding: the parts, and the loop's counters (a speculative step runs
        # serially: with the overlapped loop, the step in flight is finished first, since
        # proposals need every token known; other steps still overlap)
        spec = parts.speculation
        self.proposer, self.draft = spec.proposer, spec.draft
        self.spec_control, self.spec_length = spec.control, spec.length
        self.spec_proposed = 0  # proposals verified
        self.spec_accepted = 0  # of which kept
        self.spec_rows = 0  # verify rows (a request verifying proposals in one step)
        self.spec_steps = 0  # steps that verified proposals
        self.spec_declined = 0  # steps that could have speculated and were told not to
        self._constrained: set[str] = set()  # samples with a grammar: none speculates then
        self._spec_limits: dict[str, int] = {}  # the limit each request had this step
        # the loop's own state
        self._in_flight: tuple[ScheduledBatch, StepHandle] | None = None
        self._backend_tokenizer = getattr(self.tokenizer, "backend_tokenizer", None)
        self._sequences: dict[str, _Sequence] = {}
        self._children: dict[str, list[str]] = {}
        self._pending: list[SequenceDelta] = []
        # detokenize: each generation request's text and stop strings (by request id)
        self._texts: dict[str, RequestOutputProcessor] = {}
        self.num_steps = 0
        # constrained requests wait here (WAITING_FOR_GRAMMAR) while their grammar compiles
        self.grammars = GrammarWaitList(
            lambda: GrammarService(self.tokenizer, self.vocab_size, list(self.eos_token_ids)),
            config.grammar_compile_timeout_s,
        )

    def persist_cache(self) -> int:
        """Write every full page the radix tree holds (pool and host tiers) to the disk
        tier and wait for the writes; returns the pages queued (0 without a disk tier)."""
        if self.kv_transfer is None or self.kv_transfer.disk is None:
            return 0
        assert self.prefix_cache is not None
        queued = self.prefix_cache.persist()
        self.kv_transfer.disk.drain()
        return queued

    def _propose(self, outputs: list[SequenceDelta]) -> dict[str, Any] | None:
        """Proposals for this step's decoding requests, or None when this step does not
        speculate (mode off, the policy says no at this batch size, a constrained request
        around)."""
        running = self.scheduler.running
        if self.proposer is None or not running or self._constrained:
            return None
        if not any(r.state is RequestState.DECODE for r in running):
            return None  # prompts only: nothing to decide
        cfg = self.config
        policy = cfg.spec_policy
        if self.spec_control is not None:
            if not self.spec_control.decide(len(running)):
                self.spec_declined += 1
                return None
        elif policy == "threshold" and len(running) > cfg.spec_crossover:
            self.spec_declined += 1
            return None
        if self._in_flight is not None:  # proposals need every token: finish that step
            outputs.extend(self._drain())  # (step() gives them their text, once)
            running = self.scheduler.running
        decoding = [
            r
            for r in running
            if r.state is RequestState.DECODE and r.num_tokens - r.num_computed_tokens == 1
        ]
        if not decoding:
            return None
        if self.draft is not None:  # slots now; the draft fills them once pages are grown
            slots = np.zeros(cfg.num_spec_tokens, dtype=np.int32)
            return {r.request_id: slots for r in decoding}
        if self.spec_length is None:
            limits = [cfg.num_spec_tokens] * len(decoding)
        else:
            n = len(decoding)
            limits = [self.spec_length.limit(r.request_id, n) for r in decoding]
            self._spec_limits = {r.request_id: k for r, k in zip(decoding, limits, strict=True)}
        drafts = self.proposer.propose(decoding, limits)
        return {r.request_id: d for r, d in zip(decoding, drafts, strict=True) if d.size}

    def _fill_drafts(self, batch: ScheduledBatch) -> None:
        """The draft model writes its proposals into the slots the scheduler made."""
        assert self.draft is not None and batch.num_spec is not None
        rows = np.flatnonzero(batch.num_spec)
        self.draft.fill([batch.requests[i] for i in rows.tolist()], batch.num_spec[rows].tolist())

    def close(self) -> None:
        """Finish the step in flight and stop the device's worker (if any)."""
        try:
            self.drain()
            self.device.close()
            self.grammars.close()
            if self.kv_transfer is not None:
                self.persist_cache()  # a restart of this model finds the tree's KV on disk
                self.kv_transfer.close()
                self.kv_transfer = None
        finally:
            if self.kv_publisher is not None:  # its port is free for the next engine
                self._publish_kv_events()
                self.kv_publisher.close()
                self.kv_publisher = None
        if self.tp is not None:
            self.tp.close()
            if self._threads_before is not None:  # the process may run other engines
                torch.set_num_threads(self._threads_before)
                self._threads_before = None

    # -- requests -------------------------------------------------------------------------
    @property
    def default_sampling(self) -> dict[str, Any]:
        """The sampling defaults unset fields take (``inputs.sampling_defaults``)."""
        return self.inputs.defaults

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """The model's sampling defaults, with ``overrides`` (not None) on top."""
        return self.inputs.sampling_params(**overrides)

    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.encode(prompt)

    def validate_prompt(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of ``prompt``; ``ValueError`` if it is empty, out of vocabulary or too
        long (``InputProcessor.prompt_ids``); ``params`` is checked against the vocabulary."""
        params.check_vocab(self.vocab_size)
        return self.inputs.prompt_ids(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
        tenant: Tenant | None = None,
        lora: str | None = None,
    ) -> list[int]:
        """Check and queue ``params.n`` samples of ``prompt`` (the offline entry point:
        ``validate_prompt``, then ``submit``); returns the prompt's token ids.

        Requests with different ``cache_salt`` never share cached KV, nor do different
        tenants' under ``prefix_cache_scope`` ``tenant`` (``core.request.cache_namespace``);
        lower ``priority`` values run first under the ``priority`` policy; ``tenant`` is who
        it is served for (the ``fair`` policy shares the engine between tenants); ``lora``
        names the LoRA adapter it runs on (``load_lora``; None: the base model); a request
        still unfinished ``timeout_s`` seconds from now fails with an error. Raises
        ``EngineOverloaded`` when the waiting queue is full."""
        self._check_open(request_id)
        token_ids = self.validate_prompt(prompt, params)
        request = EngineRequest(
            request_id, token_ids, params, cache_salt, priority, tenant, lora=lora
        )
        self.submit(request, timeout_s)
        return token_ids

    def add_pooling_request(
        self,
        request_id: str,
        prompt: str | list[int],
        pooling: str = "last",
        cache_salt: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
        tenant: Tenant | None = None,
    ) -> list[int]:
        """Check and queue a pooling request (an embedding) for ``tenant`` (as
        ``add_request``): the prompt is prefilled like any other, under the same token
        budget and in the same batches as generation, but nothing is sampled; its one
        finished delta carries ``embedding``, the final-norm hidden state of the last
        prompt token (``pooling="last"``) or the mean over all prompt tokens (``"mean"``),
        float32, not normalised. Returns the prompt's token ids.

        Prefix cache: ``last`` reuses a cached prefix (its last token is always computed);
        ``mean`` needs every token's hidden state and never reuses one. Both leave their
        prompt's KV in the cache when they end, like a finished generation."""
        self._check_open(request_id)
        if pooling not in POOLING_KINDS:
            raise InputError(
                f"pooling must be one of {', '.join(POOLING_KINDS)}, got {pooling!r}",
                param="pooling",
            )
        ids = self.inputs.encode(prompt) if isinstance(prompt, str) else list(prompt)
        ids = self.inputs.check_prompt(ids, 0)  # nothing is generated: the prompt may fill it
        request = EngineRequest(
            request_id, ids, POOLING_PARAMS, cache_salt, priority, tenant, pooling
        )
        self.submit(request, timeout_s)
        return ids

    def _check_open(self, request_id: str) -> None:
        """What only the engine knows about a new request: it is alive, the id is free."""
        if self.fatal_error is not None:
            raise RuntimeError(self.fatal_error)
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")

    def submit(self, request: EngineRequest, timeout_s: float | None = None) -> None:
        """Queue a request its entry point built and checked (``EngineRequest``'s
        invariants): nothing is validated again, only what only the engine can know (it
        is alive, the id is free, the model can do it, the queue has room:
        ``EngineOverloaded``). ``timeout_s``: it fails if still unfinished that long from
        now."""
        self._check_open(request.request_id)
        params, pooling, rid = request.params, request.pooling, request.request_id
        if self.config.simulated_device and pooling is not None:
            raise ValueError("pooling requests need a model (not a simulated device)")
        if self.config.simulated_device and params.grammar_key() is not None:
            raise ValueError("structured_output needs a model (not a simulated device)")
        adapter = None if request.lora is None else self.lora(request.lora)
        n = 1 if pooling is not None else params.n
        seq_ids = [rid] if n == 1 else [f"{rid}\x1f{i}" for i in range(n)]
        namespace = cache_namespace(
            request.cache_salt,
            request.tenant,
            self.config.prefix_cache_scope,
            None if adapter is None else adapter.key,
        )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        requests = [
            Request(
                sid,
                request.prompt_token_ids,
                params if pooling is not None else _sample_params(params, i),
                group_id=rid,
                cache_namespace=namespace,
                priority=request.priority,
                deadline=deadline,
                tenant=request.tenant,
                pooling=pooling,
                lora=adapter,
            )
            for i, sid in enumerate(seq_ids)
        ]
        grammar_key = None if pooling is not None else params.grammar_key()
        if self.proposer is not None and self.config.deterministic and params.temperature > 0:
            # a sampled request's draws follow how many tokens were proposed (a matter of
            # timing under the measured policy): it decodes without speculation, and no
            # step speculates while it runs
            self._constrained.update(seq_ids)
        if grammar_key is None:
            self.scheduler.add_group(requests)
        else:
            if self.proposer is not None:
                self._constrained.update(seq_ids)  # no speculation while a grammar runs
            self.grammars.add(requests, grammar_key)  # scheduled once compiled
        if pooling is not None:
            self._sequences[rid] = _Sequence(rid, 0, frozenset(), pooling=pooling)
            self._children[rid] = seq_ids
            return
        token_ids = request.prompt_token_ids
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
        )
        for i, sid in enumerate(seq_ids):
            self._sequences[sid] = _Sequence(
                rid,
                i,
                stop_ids,
                [None] * (len(token_ids) - 1) if params.prompt_logprobs is not None else None,
            )
        self._children[rid] = seq_ids
        if self.detokenize:
            self._texts[rid] = RequestOutputProcessor(
                self._backend_tokenizer, token_ids, params, params.n
            )

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort every sample of ``request_id`` (any state), or only sample ``index``; pages
        are freed at once and the final deltas come out of the next ``step``."""
        samples = self._children.get(request_id, [])
        if index is not None:
            samples = samples[index : index + 1]
        for sid in samples:
            req = self.scheduler.abort(sid)
            if req is None and (req := self.grammars.remove(sid)) is not None:
                req.finish(FinishReason.ABORT)
            if req is not None:
                self._pending.append(self._final(req))

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self._pending)
            or self._in_flight is not None
            or len(self.grammars) > 0
        )

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished + len(self.grammars)

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        """Schedule and launch one step; process the step before it (overlapped) or this
        one (serial). Returns the deltas of the processed step and of requests that ended
        meanwhile (aborts, failures)."""
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        outputs.extend(self._check_device())
        self.grammars.poll(self._admit_compiled, lambda r, m: outputs.append(self._fail(r, m)))
        proposals = self._propose(outputs) if self.proposer is not None else None
        batch = self.scheduler.schedule(proposals)
        if self.draft is not None and batch.has_spec:
            self._fill_drafts(batch)
        outputs.extend(self._final(req) for req in batch.failed)
        launched = None if batch.is_empty else self._launch(batch, outputs)
        self._return_freed_pages()  # off the critical path: the device has work now
        if self.overlap and not batch.has_spec:
            previous, self._in_flight = self._in_flight, launched
        else:
            previous = launched
        if previous is not None:
            accepted = self.spec_accepted
            outputs.extend(self._process(*previous))
            if self.spec_control is not None and launched is not None:
                self._record_step(launched[0], start, self.spec_accepted - accepted)
        elif launched is None:
            wake = self.scheduler.next_wakeup()
            if wake is not None and not outputs:  # batch wait: doze instead of spinning
                time.sleep(min(max(0.0, wake - time.monotonic()), _IDLE_POLL_S))
            elif not outputs and not self.scheduler.has_unfinished():
                self.grammars.wait(_IDLE_POLL_S)  # only compiles pending: doze on them
        self._publish_kv_events()
        return self._with_text(outputs)

    def _publish_kv_events(self) -> None:
        """Hand the radix tree's events since the last step to the publisher (queued: it
        sends them on a thread of its own)."""
        cache = self.prefix_cache
        if self.kv_publisher is not None and cache is not None and cache.events:
            self.kv_publisher.publish(cache.events.drain())

    def _record_step(self, batch: ScheduledBatch, start: float, accepted: int) -> None:
        """Tell the cost controller what a pure decode step (every row its last token, plus
        its proposals) cost and emitted; steps with prompt chunks say nothing about it. In
        the overlapped loop a plain step's time is one launch plus one process: the time
        per step in steady state."""
        assert self.spec_control is not None
        spec = batch.num_spec
        rows = batch.num_new_tokens if spec is None else batch.num_new_tokens - spec
        if not batch.requests or not bool((rows == 1).all()) or not bool(batch.sample.all()):
            return
        n = len(batch.requests)
        self.spec_control.record(
            n,
            batch.has_spec,
            time.perf_counter() - start,
            n + (accepted if batch.has_spec else 0),
            int(batch.num_new_tokens.sum()),
        )

    def _with_text(self, deltas: list[SequenceDelta]) -> list[SequenceDelta]:
        """With ``detokenize``: each delta with its text, through its request's output
        processor, the one place stop strings are found; a sample a stop string ended is
        finished here (its later deltas are dropped: exactly one finished delta each)."""
        if not self._texts:
            return deltas
        out: list[SequenceDelta] = []
        for delta in deltas:
            rid = delta.request_id
            texts = self._texts.get(rid)
            if texts is None:  # pooling, or the caller detokenizes
                out.append(delta)
                continue
            done, stopped_here = texts.process(delta)
            children = self._children.get(rid)
            if stopped_here and children is not None:  # (None: it ended in the step too)
                req = self.scheduler.get(children[delta.index])
                if req is not None:  # still running: it ends here, as a stop
                    self.scheduler.finish(req, FinishReason.STOP)
                    self._final(req)  # the bookkeeping; ``done`` is its finished delta
            if done is not None:
                out.append(done)
            if all(texts.done):
                del self._texts[rid]
        return out

    def _admit_compiled(self, requests: list[Request]) -> None:
        """Samples whose grammar compiled go to the scheduler (or fail if it is full)."""
        try:
            self.scheduler.add_group(requests)
        except Exception as exc:
            for req in requests:
                self._pending.append(self._fail(req, str(exc)))

    def check_device(self) -> list[SequenceDelta]:
        """Whether the tensor-parallel group is still whole (cheap: polls the local worker
        processes); if not, the engine stops and its requests' final deltas come back."""
        return self._with_text(self._check_device())

    def _check_device(self) -> list[SequenceDelta]:
        if self.tp is None or self.fatal_error is not None:
            return []
        try:
            self.tp.check()
        except DeviceLost as exc:
            return self._stop(f"the engine stopped: {exc}")
        return []

    def _stop(self, message: str) -> list[SequenceDelta]:
        """The device is lost: end every request with ``message``; later ones are refused."""
        self.fatal_error = message
        out: list[SequenceDelta] = []
        for sid in list(self._sequences):
            req = self.scheduler.get(sid)
            if req is not None:
                self.scheduler.finish(req, FinishReason.ERROR, message)
            elif (req := self.grammars.remove(sid)) is not None:
                req.finish(FinishReason.ERROR, message)
            if req is not None:
                out.append(self._final(req))
        return out

    def _fail(self, req: Request, message: str) -> SequenceDelta:
        """End a request the scheduler never saw (its grammar failed) with an error."""
        req.finish(FinishReason.ERROR, message)
        return self._final(req)

    def drain(self) -> list[SequenceDelta]:
        """Wait for the step in flight (overlapped loop) and process it."""
        return self._with_text(self._drain())

    def _drain(self) -> list[SequenceDelta]:
        if self._in_flight is None:
            return []
        previous, self._in_flight = self._in_flight, None
        return self._process(*previous)

    def _launch(
        self, batch: ScheduledBatch, outputs: list[SequenceDelta]
    ) -> tuple[ScheduledBatch, StepHandle] | None:
        """Build the step's inputs and hand them to the device; the scheduler advances its
        requests at once (tokens it samples are placeholders until processed)."""
        self.num_steps += 1
        try:
            step = self.runner.prepare(batch)
        except Exception as exc:  # fail this batch, keep the engine
            logger.exception(
                "preparing a step failed; failing its %d requests", len(batch.requests)
            )
            message = f"internal error while preparing the batch: {type(exc).__name__}: {exc}"
            for req in batch.requests:
                self.scheduler.finish(req, FinishReason.ERROR, message)
                outputs.append(self._final(req))
            return None
        handle = self.device.launch(step)
        self.scheduler.begin_step(batch, step.placeholders)
        return batch, handle

    def _return_freed_pages(self) -> None:
        """Pages freed by ended requests and radix evictions go back to the free list in
        one batch (they were already counted as free)."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
        self.pool.flush()

    def _process(self, batch: ScheduledBatch, handle: StepHandle) -> list[SequenceDelta]:
        """Wait for a launched step and apply it: tokens, stop conditions, outputs."""
        try:
            result = handle.result()
        except Exception as exc:  # fail this batch, keep the engine
            logger.exception("step failed; failing its %d requests", len(batch.requests))
            message = f"internal error while running the batch: {type(exc).__name__}: {exc}"
            failed = [self._final(req) for req in self.scheduler.fail_step(batch, message)]
            if isinstance(exc, DeviceLost):  # no step can run any more: fail everything
                failed.extend(self._stop(f"the engine stopped: {exc}"))
            return failed
        self.scheduler.observe_step(batch, result.seconds)
        outputs: list[SequenceDelta] = []
        for rid, (start, entries) in result.prompt_logprobs.items():
            seq = self._sequences.get(rid)
            if seq is not None and seq.prompt_logprobs is not None:
                seq.prompt_logprobs[start : start + len(entries)] = entries
        for rid, pooled in result.pooled.items():
            self._add_pooled(rid, *pooled)
        if batch.has_spec:
            return outputs + self._process_spec(batch, result)
        for req, index in self.scheduler.end_step(batch, result.tokens):
            if req.pooling is not None:
                outputs.append(self._end_pooling(req))
                continue
            token = int(req.token_ids[index])
            num_output = index + 1 - req.num_prompt_tokens
            outputs.append(
                self._on_token(req, token, num_output, result.logprobs.get(req.request_id))
            )
        return outputs

    def _process_spec(self, batch: ScheduledBatch, result: StepResult) -> list[SequenceDelta]:
        """Apply a verify step: each request's emitted tokens one at a time, as if decoded
        one per step, so a stop token or ``max_tokens`` ends it exactly there (and only KV
        before that token is ever cached). A stop string is found after the step, by the
        output processor, which drops the step's tokens after it (``_with_text``)."""
        assert batch.num_spec is not None
        self.spec_steps += 1
        for row, k in enumerate(batch.num_spec.tolist()):
            if k and row in result.spec_tokens and not batch.requests[row].is_finished:
                kept = int(result.spec_tokens[row].size) - 1
                self.spec_rows += 1
                self.spec_proposed += k
                self.spec_accepted += kept
                if self.spec_length is not None:
                    rid = batch.requests[row].request_id
                    self.spec_length.update(rid, self._spec_limits.get(rid, k), k, kept)
        self._spec_limits = {}
        outputs: list[SequenceDelta] = []
        for req, index in self.scheduler.end_step(batch, result.tokens, result.spec_tokens):
            if req.is_finished:
                continue  # it stopped at an earlier token of this run
            if req.pooling is not None:
                outputs.append(self._end_pooling(req))
                continue
            self.scheduler.reveal(req, index)
            row = batch.row_of(req.request_id)
            assert row is not None
            lps = result.spec_logprobs.get(req.request_id)
            lp = None if lps is None else lps[index - int(batch.totals[row])]
            num_output = index + 1 - req.num_prompt_tokens
            outputs.append(self._on_token(req, int(req.token_ids[index]), num_output, lp))
        return outputs

    def _add_pooled(self, request_id: str, start: int, num: int, vec: np.ndarray) -> None:
        """A step's part of a pooling request (``StepResult.pooled``). Mean pooling sums
        chunk by chunk; a chunk from position 0 starts over (a preempted request computes
        its prompt again: it never reuses a prefix), one that does not follow on from the
        sum marks it broken (None, with ``pool_tokens`` -1). In deterministic mode a chunk
        comes as its rows [num, hidden], added to the sum one at a time, in order: the sum is
        then the same wherever the prompt's chunks end."""
        seq = self._sequences.get(request_id)
        if seq is None or seq.pooling is None:
            return  # ended meanwhile
        if vec.ndim == 2:
            total = np.zeros(vec.shape[1], dtype=np.float32)
            if start != 0 and seq.pool_sum is not None and start == seq.pool_tokens:
                total = seq.pool_sum.copy()
            elif start != 0:
                seq.pool_sum, seq.pool_tokens = None, -1
                return
            for row in vec:
                total += row
            seq.pool_sum, seq.pool_tokens = total, start + num
            return
        if seq.pooling == "last" or start == 0:
            seq.pool_sum, seq.pool_tokens = vec, start + num
        elif seq.pool_sum is not None and start == seq.pool_tokens:
            seq.pool_sum = seq.pool_sum + vec
            seq.pool_tokens += num
        else:
            seq.pool_sum, seq.pool_tokens = None, -1

    def _end_pooling(self, req: Request) -> SequenceDelta:
        """A pooling request computed its last prompt token: it ends with its embedding."""
        seq = self._sequences[req.request_id]
        vec = seq.pool_sum
        if vec is None or seq.pool_tokens != req.num_prompt_tokens:
            message = (
                f"internal error: pooled {seq.pool_tokens} of {req.num_prompt_tokens} prompt tokens"
            )
            self.scheduler.finish(req, FinishReason.ERROR, message)
            return self._final(req)
        if seq.pooling == "mean":
            vec = vec / req.num_prompt_tokens
        self.scheduler.finish(req, FinishReason.STOP)
        delta = self._final(req)
        delta.embedding = np.asarray(vec, dtype=np.float32)
        return delta

    def _on_token(
        self, req: Request, token: int, num_output: int, logprobs: TokenLogprobs | None = None
    ) -> SequenceDelta:
        """``token`` is output number ``num_output`` of ``req`` (later ones may be in flight)."""
        seq = self._sequences[req.request_id]
        params = req.sampling_params
        reason: FinishReason | None = None
        grammar = req.grammar
        if grammar is not None and grammar.ends_at(num_output):  # type: ignore[attr-defined]
            if grammar.failed:  # type: ignore[attr-defined]
                message = f"the grammar refused token {token} (an internal error)"
                self.scheduler.finish(req, FinishReason.ERROR, message)
                return self._final(req)
            reason = FinishReason.STOP  # the output is complete: it took a stop token
        if reason is not None:
            pass
        elif token in seq.stop_token_ids and num_output > params.min_tokens - 1:
            reason = FinishReason.STOP
        elif num_output >= params.max_tokens:
            reason = FinishReason.LENGTH
        lps = [logprobs] if logprobs is not None else []
        prompt_lps = None
        if seq.prompt_logprobs is not None:
            # computed by this sample's own prefill; a sibling that shared it has none
            if all(e is not None for e in seq.prompt_logprobs):
                prompt_lps = seq.prompt_logprobs
            seq.prompt_logprobs = None
        if reason is None:
            return SequenceDelta(
                seq.request_id,
                seq.index,
                [token],
                "",
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                queue_time_s=_queue_time(req),
                logprobs=lps,
                prompt_logprobs=prompt_lps,
            )
        self.scheduler.finish(req, reason)
        delta = self._final(req)
        delta.token_ids = [token]
        delta.logprobs = lps
        delta.prompt_logprobs = prompt_lps
        return delta

    def _final(self, req: Request) -> SequenceDelta:
        seq = self._sequences.pop(req.request_id)
        self.sampler.forget(req.request_id)
        self._constrained.discard(req.request_id)
        if self.spec_length is not None:
            self.spec_length.forget(req.request_id)
        children = self._children.get(seq.request_id)
        if children is not None and all(c not in self._sequences for c in children):
            del self._children[seq.request_id]
        return SequenceDelta(
            seq.request_id,
            seq.index,
            [],
            "",
            finished=True,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            error=req.error,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            queue_time_s=_queue_time(req),
        )

    # -- checks ---------------------------------------------------------------------------
    def check_page_accounting(self) -> None:
        """Every page is free or held (by requests and/or the radix tree), with a refcount
        equal to its number of holders: free + private + tree-held = total."""
        self.pool.check()
        held = self.kv_manager.held_page_ids(self.scheduler.running)
        expected = np.bincount(held, minlength=self.pool.num_pages)
        assert np.array_equal(expected, self.pool.refcount), "page refcounts != holders"
        free = self.pool.num_free
        assert free + int(np.count_nonzero(expected)) == self.pool.num_pages, "pages unaccounted"
        if self.kv_transfer is not None:
            self.check_tier_accounting()

    def check_tier_accounting(self) -> None:
        """Per tier: the tree's pool pages split into evictable + protected, each host slot
        free or held by exactly one host-tier node, and (once queued writes are done) the
        disk tier's index equal to its files and within its limit."""
        assert self.prefix_cache is not None
        self.prefix_cache.check_tiers()
        if self.kv_transfer is not None and self.kv_transfer.disk is not None:
            self.kv_transfer.disk.drain()
            self.kv_transfer.disk.check()

    def check_idle(self) -> None:
        """At idle: no request left, accounting holds, and once the radix tree lets go of
        what it caches, every page is back in the free list."""
        assert not self.drain(), "outputs left in the step in flight"
        assert not self.scheduler.has_unfinished(), "requests left in the scheduler"
        assert not self._texts, f"output processors left for {sorted(self._texts)}"
        self.check_page_accounting()
        if self.prefix_cache is not None:
            assert self.prefix_cache.protected_pages == 0, "radix nodes still locked at idle"
            self.prefix_cache.reset()
            self._publish_kv_events()
            host = self.prefix_cache.host
            if host is not None:
                assert host.num_free == host.num_slots, "host-tier slots leaked at idle"
        assert self.pool.num_free == self.pool.num_pages, "pages leaked at idle"

    # -- what the engine reports --------------------------------------------------------
    def stats(self) -> EngineStats:
        """Counters for the serving layer's heartbeat and ``/metrics``."""
        s, cache, pool = self.scheduler, self.prefix_cache, self.pool
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_pages_total=pool.num_pages,
            kv_pages_free=pool.num_free,
            cache_hit_tokens=cache.hit_tokens if cache else 0,
            cache_queried_tokens=cache.queried_tokens if cache else 0,
            preemptions=s.stats.num_preemptions,
            steps=self.num_steps,
            kv_pages_evictable=cache.evictable_pages if cache else 0,
            kv_pages_protected=cache.protected_pages if cache else 0,
            radix_nodes=cache.num_nodes if cache else 0,
            spec_proposed_tokens=self.spec_proposed,
            spec_accepted_tokens=self.spec_accepted,
            spec_verify_rows=self.spec_rows,
            spec_steps=self.spec_steps,
            spec_declined_steps=self.spec_declined,
            **self._tier_stats(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, list[str]]:
        """The adapters of running and of waiting requests (none without LoRA)."""
        if self.loras is None:
            return {}
        s = self.scheduler

        def names(requests: Iterable[Request]) -> list[str]:
            return sorted({r.lora.name for r in requests if r.lora is not None})

        return {"running_loras": names(s.running), "waiting_loras": names(s.waiting)}

    def _tier_stats(self) -> dict[str, Any]:
        """The KV tiers' fields of ``EngineStats`` (none when the tiers are off)."""
        transfer, cache = self.kv_transfer, self.prefix_cache
        if transfer is None or cache is None or cache.host is None:
            return {}
        t, m, disk = cache.tiers, transfer.stats, transfer.disk
        return {
            "kv_host_pages_total": cache.host.num_slots,
            "kv_host_pages_used": cache.host.num_used,
            "kv_disk_bytes_used": disk.used_bytes if disk else 0,
            "kv_disk_records": disk.num_records if disk else 0,
            "cache_hit_tokens_host": t.host_hit_tokens,
            "cache_hit_tokens_disk": t.disk_hit_tokens,
            "kv_demoted_pages": t.demoted_pages,
            "kv_promoted_pages": t.promoted_pages,
            "kv_spilled_pages": t.spilled_pages,
            "kv_disk_promoted_pages": t.disk_promoted_pages,
            "kv_failed_promotions": t.failed_promotions,
            "kv_disk_read_failures": t.disk_read_failures,
            "kv_tier_bytes_moved": m.host_bytes_in
            + m.host_bytes_out
            + m.disk_bytes_in
            + m.disk_bytes_out,
            "kv_tier_move_seconds": m.host_seconds + m.disk_seconds,
        }

    def radix_summary(self, max_nodes: int = 256, max_depth: int = 8) -> RadixSummaryData:
        """A bounded summary of the prefix cache (empty without one); ``ValueError`` for
        bounds out of range."""
        if self.prefix_cache is None:
            return RadixSummaryData(page_size=self.pool.page_size)
        return summarize(self.prefix_cache, max_nodes=max_nodes, max_depth=max_depth)

    # -- LoRA adapters -------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Serve the PEFT adapter at ``path`` as model ``name`` from now on (``LoRAError``
        naming the problem if it cannot be served: nothing changes then). A name loaded
        again is replaced: requests in flight finish on the old weights."""
        if self.loras is None:
            raise LoRAError("LoRA adapters need a model (not a simulated device)")
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (``LoRANotFound`` if it is not loaded): new
        requests naming it are refused; those in flight hold its weights and finish."""
        if self.loras is None:
            raise LoRANotFound(name)
        self.loras.unload(name)

    def lora(self, name: str) -> LoRAAdapter:
        """Adapter ``name`` as requests get it (``LoRANotFound`` if it is not served)."""
        if self.loras is None:
            raise LoRANotFound(name)
        return self.loras.get(name)

    def lora_names(self) -> list[str]:
        """The adapters served, in load order."""
        return [] if self.loras is None else self.loras.names()

    def flush_cache(self) -> CacheFlushResult:
        """The debug flush: at idle, check the page accounting, then empty the radix tree
        and count the free pages (all of them, unless some leaked). Busy: nothing changes."""
        pool, cache = self.pool, self.prefix_cache
        nodes = cache.num_nodes if cache is not None else 0
        if self.has_unfinished():
            return CacheFlushResult(False, pool.num_pages, pool.num_free, nodes)
        error = None
        try:
            self.check_page_accounting()
            if cache is not None and cache.protected_pages:
                error = f"{cache.protected_pages} radix pages still locked at idle"
        except AssertionError as exc:
            error = f"page accounting: {exc}"
        if cache is not None:
            cache.reset()
            if cache.events is not None and cache.num_nodes == 0:
                cache.events.cleared()  # (after each page's removal: a point to resync at)
            self._publish_kv_events()
        pool.flush()
        return CacheFlushResult(True, pool.num_pages, pool.num_free, nodes, error)

    def cache_stats(self) -> dict[str, float]:
        """Prefix-cache statistics (zeros when the cache is disabled)."""
        c = self.prefix_cache
        return {
            "hit_tokens": c.hit_tokens if c else 0,
            "queried_tokens": c.queried_tokens if c else 0,
            "hit_rate": c.hit_rate if c else 0.0,
            "evictable_pages": c.evictable_pages if c else 0,
            "protected_pages": c.protected_pages if c else 0,
            "free_pages": self.pool.num_free,
        }


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index`` of n: a seeded request's samples draw from distinct derived seeds."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed * 1_000_003 + index) % 2**63)
