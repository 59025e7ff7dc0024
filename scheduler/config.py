"""Scheduler settings: one frozen dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from scheduler.vote import SYNC_POLICIES

PREEMPTION_ORDERS = ("lcfs", "fcfs")
# Mixed steps' prompt tokens per step while any rank decodes, unless set. In a group, one rank's
# prompt chunks stretch every rank's step, and this is the TTFT / ITL point chosen for that
# (docs/design.md, "Mixed steps"). A rank alone stretches only its own decoders: there fewer,
# larger chunks gave more throughput and a shorter TTFT for a longer ITL p99, still well
# below vLLM's (docs/benchmark_notes.md, "On the AVX-512 host: float32 and bf16 at DP=1, DP=2,
# and one rank's prompt chunks").
MIXED_PROMPT_TOKENS_GROUP = 256
# A multiple of GROUP: context parallelism's chunk alignment, met by GROUP, holds for it too.
MIXED_PROMPT_TOKENS_ALONE = 4 * MIXED_PROMPT_TOKENS_GROUP
# The deadline policy's D (prefill_deadline_steps) unless set. In a group of more than
# PREFILL_DEADLINE_SMALL_GROUP ranks a vote is a collective and each arrival's prompt chunk
# stretches every rank's step, so a ready prompt may sit out up to 2 decode steps, votes come at
# most that often, and prompts arriving on several ranks meanwhile share one step
# (docs/design.md, "The deadline policy"); with 0 a real DP=4 group had a longer ITL at half
# load and fell behind its arrivals at 90% in one round of three. A rank alone, or a pair,
# starts a ready prompt at its next step (0), as vLLM's and SGLang's schedulers take waiting
# prompts at every step: a real pair at half and 90% load got 0.5-0.6x the TTFT p50 of 2 at the
# same throughput and ITL (docs/benchmark_notes.md, "The deadline at two and four ranks").
PREFILL_DEADLINE_STEPS_GROUP = 2
PREFILL_DEADLINE_STEPS_SMALL = 0
PREFILL_DEADLINE_SMALL_GROUP = 2  # the most ranks a group may have for PREFILL_DEADLINE_STEPS_SMALL
# The contenders the sync benchmarks compare: vote (prefill-only steps, the reference), and the
# two other policies with prefill-only ("+separate") or mixed ("+mixed", the default) steps.
POLICY_VARIANTS = (
    "vote",
    "every_step+separate",
    "every_step+mixed",
    "deadline+separate",
    "deadline+mixed",
)

# Settings every DP rank must share: a difference would put the ranks' attempt points, step
# kinds or block arithmetic out of step, which shows up as a hang inside a collective.
GROUP_AGREED_FIELDS = (
    "block_size",
    "prefill_attempt_interval",
    "prefill_any_attempt_interval",
    "sync_policy",
    "prefill_deadline_steps",
    "max_model_len",
)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # None: the engine takes the model's max_position_embeddings, capped by what the KV pool
    # holds (a Scheduler needs it resolved).
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int = 1024  # KV blocks in the pool, including the reserved block 0
    num_state_slots: int = 0  # per-sequence state slots incl. reserved slot 0; 0 = no state pool
    chunked_prefill: bool = True
    # Recompute (False) keeps every request's result; True fails the victim fast instead.
    stop_preempted_request: bool = False
    preemption_order: str = "lcfs"
    prefill_attempt_interval: int = 70
    prefill_any_attempt_interval: int = 100
    prefill_watermark: float = 0.9
    prefill_max_sum_seqlen_k: int | None = None  # None: no limit on the step's sum of K lengths
    enable_prefix_caching: bool = False
    lookahead_tokens: int = 0
    cp_size: int = 1
    # deadline (the default: a ready prompt waits at most prefill_deadline_steps, so its TTFT
    # p99 is far below vote's, with fewer votes than every_step; docs/design.md, and the figures
    # in docs/benchmark_notes.md, "Step policies") | vote (the reference) | every_step
    sync_policy: str = "deadline"
    # deadline policy: the most decode steps a ready head of waiting (schedulable, under the
    # watermark, admissible now) sits out before the group prefills; 0 votes at every step and
    # prefills at the first a head is ready. None: PREFILL_DEADLINE_STEPS_GROUP, or
    # PREFILL_DEADLINE_STEPS_SMALL where the engine runs as a group of at most
    # PREFILL_DEADLINE_SMALL_GROUP ranks (`for_group`).
    prefill_deadline_steps: int | None = None
    # Mixed steps: a prefill step also carries one decode token for every running sequence, so
    # prompts never pause decoding; while any rank of the group decodes, a rank's prompt chunks
    # in one step total at most mixed_prompt_tokens (the head always gets its minimum chunk),
    # which bounds how much a prefill step stretches the decoders' token gap. None: on under
    # deadline and every_step, off under vote (the reference's protocol, kept exact).
    mixed_steps: bool | None = None
    # None: MIXED_PROMPT_TOKENS_GROUP, or MIXED_PROMPT_TOKENS_ALONE where the engine runs as a
    # group of one rank (`for_group`).
    mixed_prompt_tokens: int | None = None
    vocab_size: int | None = None  # when set, prompts with out-of-range ids are failed

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "prefill_attempt_interval",
            "prefill_any_attempt_interval",
            "cp_size",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        if self.prefill_deadline_steps is not None:
            _require_int("prefill_deadline_steps", self.prefill_deadline_steps, minimum=0)
        _require_int("num_blocks", self.num_blocks, minimum=2)
        _require_int("lookahead_tokens", self.lookahead_tokens, minimum=0)
        _require_int("num_state_slots", self.num_state_slots, minimum=0)
        if self.num_state_slots == 1:
            raise ValueError("num_state_slots=1 leaves no usable slot (slot 0 is reserved)")
        for name in (
            "max_model_len",
            "prefill_max_sum_seqlen_k",
            "vocab_size",
            "mixed_prompt_tokens",
        ):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), minimum=1)
        for name in ("chunked_prefill", "stop_preempted_request", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.prefill_watermark, (int, float)) or not (
            0.0 < self.prefill_watermark <= 1.0
        ):
            raise ValueError(f"prefill_watermark must be in (0, 1], got {self.prefill_watermark!r}")
        SYNC_POLICIES.check("sync_policy", self.sync_policy)
        if self.mixed_steps is not None and not isinstance(self.mixed_steps, bool):
            raise ValueError(f"mixed_steps must be true, false or null, got {self.mixed_steps!r}")
        if self.mixed_steps and self.sync_policy == "vote":
            raise ValueError(
                "mixed_steps needs sync_policy deadline or every_step: vote is the reference's "
                "protocol, whose prefill steps carry prompts only"
            )
        _require_choice("preemption_order", self.preemption_order, PREEMPTION_ORDERS)
        if (
            self.max_model_len is not None
            and not self.chunked_prefill
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"without chunked_prefill a prompt must fit one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if (
            self.prefill_max_sum_seqlen_k is not None
            and self.max_model_len is not None
            and self.prefill_max_sum_seqlen_k < self.max_model_len
        ):
            # A prompt longer than the limit could never be admitted and would block the queue.
            raise ValueError(
                f"prefill_max_sum_seqlen_k ({self.prefill_max_sum_seqlen_k}) must be >= "
                f"max_model_len ({self.max_model_len}) or None"
            )
        if self.mixed_prompt_cap % self.cp_align:
            raise ValueError(
                f"with cp_size={self.cp_size}, mixed_prompt_tokens ({self.mixed_prompt_cap}) "
                f"must be a multiple of {self.cp_align}"
            )
        if self.max_num_batched_tokens % self.cp_align:
            # Chunks are charged in whole units: an unaligned budget could leave a prompt that
            # fits the budget unable to fit it once aligned.
            raise ValueError(
                f"with cp_size={self.cp_size}, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be a multiple of {self.cp_align}"
            )

    @property
    def cp_align(self) -> int:
        """Chunk lengths are multiples of this: context parallelism splits each chunk zigzag."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    @property
    def mixed(self) -> bool:
        """Whether prefill steps also decode (``mixed_steps`` resolved against the policy)."""
        if self.mixed_steps is None:
            return self.sync_policy != "vote"
        return self.mixed_steps

    @property
    def mixed_prompt_cap(self) -> int:
        """Mixed steps: a rank's prompt tokens per step while any rank decodes."""
        if self.mixed_prompt_tokens is None:
            return MIXED_PROMPT_TOKENS_GROUP
        return self.mixed_prompt_tokens

    @property
    def deadline_steps(self) -> int:
        """The deadline policy's D (``prefill_deadline_steps`` resolved)."""
        if self.prefill_deadline_steps is None:
            return PREFILL_DEADLINE_STEPS_GROUP
        return self.prefill_deadline_steps

    def for_group(self, num_ranks: int) -> SchedulerConfig:
        """This config for a group of ``num_ranks`` DP ranks: for one rank, an unset
        ``mixed_prompt_tokens`` becomes MIXED_PROMPT_TOKENS_ALONE (aligned wherever the unset
        config passed its check, since ALONE is a multiple of GROUP); for up to
        PREFILL_DEADLINE_SMALL_GROUP ranks an unset ``prefill_deadline_steps`` becomes
        PREFILL_DEADLINE_STEPS_SMALL. A group that later shrinks keeps what it started with:
        every rank resolved the same."""
        config = self
        if num_ranks == 1 and config.mixed_prompt_tokens is None:
            config = replace(config, mixed_prompt_tokens=MIXED_PROMPT_TOKENS_ALONE)
        if num_ranks <= PREFILL_DEADLINE_SMALL_GROUP and config.prefill_deadline_steps is None:
            config = replace(config, prefill_deadline_steps=PREFILL_DEADLINE_STEPS_SMALL)
        return config

    @property
    def min_chunk_tokens(self) -> int:
        return max(self.lookahead_tokens, 1)

    def group_agreed(self) -> dict[str, object]:
        """The settings every rank of a DP group must share (compared at start-up)."""
        return {name: getattr(self, name) for name in GROUP_AGREED_FIELDS}

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def policy_variant(config: SchedulerConfig, variant: str) -> SchedulerConfig:
    """``config`` under one of ``POLICY_VARIANTS`` (``vote``, or ``<policy>+mixed|separate``)."""
    if variant not in POLICY_VARIANTS:
        raise ValueError(f"unknown policy variant {variant!r}; known: {list(POLICY_VARIANTS)}")
    policy, _, steps = variant.partition("+")
    return replace(config, sync_policy=policy, mixed_steps=steps == "mixed" if steps else None)


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _require_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
