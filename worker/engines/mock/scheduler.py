"""Continuous batching for one dp rank of the mock engine. Pure: no clock, no asyncio.

Shaped like vLLM's v1 scheduler, reduced to what the timing model and the router can observe:

- Every sequence has ``num_tokens`` (prompt + generated) and ``computed`` (tokens whose KV exists).
  A step gives each scheduled sequence ``num_tokens - computed`` tokens, capped by the step's token
  budget (``max_num_batched_tokens``), so long prompts are prefilled in chunks; a sequence that has
  caught up samples one token at the end of the step, so a decoding sequence costs 1 token a step.
- Running sequences are served first, in arrival order; then waiting ones are admitted while
  ``max_num_seqs`` and the budget allow. Admission looks the prefix up in the block pool: the hit
  (whole blocks) is not computed again and is reported as ``cached_tokens``. As in vLLM, a hit
  never covers the last prompt token: the step that samples the first token must compute one.
- When the pool cannot grow a running sequence, the newest running sequence is preempted
  (its blocks released; it re-enters the waiting queue at the front and is recomputed).

The driver calls :meth:`Scheduler.schedule`, waits ``Batch.duration_ms`` (timing model), then
calls :meth:`Scheduler.complete` to advance the batch and collect sampled tokens.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from controlplane.protocol.hashing import block_hash, chain_hash
from worker.engines.mock.blocks import BlockPool, ChainEntry, SeqBlocks
from worker.engines.mock.timing import TimingModel


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


def output_token(index: int) -> int:
    """The mock's deterministic generated text: ``a b c ... z a b ...`` (byte token ids)."""
    return ord("a") + index % 26


@dataclass(eq=False, slots=True)
class Seq:
    """One request inside a rank; ``remote_prefill``: its prompt KV comes from a prefill worker."""

    request_id: str
    prompt_len: int
    max_tokens: int
    tokens: list[int]
    remote_prefill: bool = False
    state: SeqState = SeqState.WAITING
    computed: int = 0
    generated: int = 0
    cached_tokens: int = 0
    admitted: bool = False
    expected_hit_tokens: int = 0  # prefix hit seen at arrival (load estimate only)
    chain: list[ChainEntry] = field(default_factory=list)
    blocks: SeqBlocks = field(default_factory=SeqBlocks)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decoding(self) -> bool:
        """Caught up but for the last sampled token (a remote-prefilled prompt counts too)."""
        return self.generated > 0 or self.remote_prefill

    def pending_prefill_tokens(self) -> int:
        if self.decoding and self.state is SeqState.RUNNING:
            return 0
        base = self.computed if self.admitted else max(self.computed, self.expected_hit_tokens)
        return max(self.num_tokens - base, 0)


@dataclass(frozen=True, slots=True)
class Scheduled:
    seq: Seq
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Batch:
    items: list[Scheduled]
    uncached_tokens: int
    decoding: int
    duration_ms: float

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass(frozen=True, slots=True)
class Output:
    seq: Seq
    token: int
    finished: bool


@dataclass(frozen=True, slots=True)
class RankLoadSnapshot:
    active_decode_blocks: int
    active_prefill_tokens: int
    kv_used_blocks: int
    running: int
    waiting: int


class Scheduler:
    def __init__(
        self,
        *,
        pool: BlockPool,
        timing: TimingModel,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        token_source: Callable[[int], int] = output_token,
    ) -> None:
        self.pool = pool
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.token_source = token_source
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.preemptions = 0

    # -- requests --------------------------------------------------------------------------

    def add(
        self, request_id: str, prompt: Sequence[int], *, max_tokens: int,
        remote_prefill: bool = False,
    ) -> Seq:
        """Queue a request. Raises ValueError if it could never fit in the pool."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        bs = self.pool.block_size
        if -(-(len(prompt) + max_tokens) // bs) > self.pool.num_blocks:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} needs more than the "
                f"{self.pool.num_blocks} KV blocks of this engine"
            )
        seq = Seq(request_id, len(prompt), max_tokens, list(prompt),
                        remote_prefill=remote_prefill)
        self._extend_chain(seq, len(prompt))
        seq.expected_hit_tokens = self._hit_blocks(seq) * bs
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Seq) -> None:
        """Drop a request wherever it is (client gone); its blocks go back to the pool."""
        if seq.state is SeqState.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        elif seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        else:
            return
        self.pool.release(seq.blocks)
        seq.state = SeqState.ABORTED

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def load(self) -> RankLoadSnapshot:
        prefill = sum(s.pending_prefill_tokens() for s in self.running)
        prefill += sum(s.pending_prefill_tokens() for s in self.waiting)
        used = self.pool.used_blocks
        return RankLoadSnapshot(
            active_decode_blocks=used, active_prefill_tokens=prefill, kv_used_blocks=used,
            running=len(self.running), waiting=len(self.waiting),
        )

    # -- steps -----------------------------------------------------------------------------

    def schedule(self) -> Batch:
        """Choose this step's work and allocate its blocks (the pool records KV events)."""
        budget = self.max_num_batched_tokens
        items: list[Scheduled] = []
        uncached = 0
        decoding = 0

        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.computed, budget)
            while not self._grow(seq, seq.computed + n):
                # Make room by preempting the newest running sequence, this one last.
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.state is not SeqState.RUNNING:
                break  # it was the newest: nothing after it
            items.append(Scheduled(seq, n))
            budget -= n
            if seq.decoding and n == 1:
                decoding += 1
            else:
                uncached += n
            i += 1

        while (
            not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0
        ):
            seq = self.waiting[0]
            hit = self._hit_blocks(seq)
            start = hit * self.pool.block_size
            if seq.remote_prefill and not seq.admitted:
                # The prompt's KV arrives from the prefill worker: only its last token is computed
                # here (costing a decode step), as the input of the first sampled token.
                start = max(start, seq.prompt_len - 1)
            n = min(seq.num_tokens - start, budget)
            if not self._grow(seq, start + n):
                break  # allocate changes nothing when it fails; wait for blocks to free up
            self.waiting.popleft()
            if not seq.admitted:
                seq.cached_tokens = hit * self.pool.block_size
                seq.admitted = True
            seq.computed = start
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            items.append(Scheduled(seq, n))
            budget -= n
            if seq.decoding and n == 1:
                decoding += 1
            else:
                uncached += n

        duration = 0.0
        if items:
            duration = self.timing.step_ms(
                uncached_tokens=uncached, decoding=decoding, kv_usage=self.pool.usage
            )
        return Batch(items, uncached, decoding, duration)

    def complete(self, batch: Batch) -> list[Output]:
        """Advance every sequence of ``batch``; sample where caught up; finish and release."""
        outputs: list[Output] = []
        for item in batch.items:
            seq = item.seq
            if seq.state is not SeqState.RUNNING:
                continue  # aborted during the step
            seq.computed += item.num_tokens
            if seq.computed < seq.num_tokens:
                continue  # a prefill chunk
            token = self.token_source(seq.generated)
            seq.tokens.append(token)
            seq.generated += 1
            finished = seq.generated >= seq.max_tokens
            if finished:
                self.running.remove(seq)
                self.pool.release(seq.blocks)
                seq.state = SeqState.FINISHED
            outputs.append(Output(seq, token, finished))
        return outputs

    # -- helpers ---------------------------------------------------------------------------

    def _hit_blocks(self, seq: Seq) -> int:
        # Never the whole sequence: the last token is computed to sample from (vLLM's rule).
        return self.pool.match(seq.chain, limit=(seq.num_tokens - 1) // self.pool.block_size)

    def _extend_chain(self, seq: Seq, num_tokens: int) -> None:
        bs = self.pool.block_size
        chain = seq.chain
        while len(chain) < num_tokens // bs:
            i = len(chain)
            b = block_hash(seq.tokens[i * bs : (i + 1) * bs])
            chain.append((chain_hash(chain[-1][0] if chain else None, b), b))

    def _grow(self, seq: Seq, num_tokens: int) -> bool:
        self._extend_chain(seq, num_tokens)
        return self.pool.allocate(seq.blocks, seq.chain, num_tokens)

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.computed = 0
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
