"""One DP rank: an inbox, the step loop, and results out.

    intake -> schedule (votes at attempt points) -> forward, placeholder or nothing
    -> sample -> account -> emit -> (sleep, when the group agreed there is no work)

Each request the rank holds has one record (`engine/request.py`), created at intake and
dropped with its one terminal output. The collectives a step takes are all in `step()`: the
scheduler's plan yields its votes and the engine answers them, then the lock-step check, then
the forward's MoE all-to-alls. Their sequence is decided only by the scheduler's group state
and the votes, so it is the same on every rank. Anything that goes wrong in a collective ends
every outstanding request with an ``error: ...`` result and raises; nothing hangs.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from dist_engine.attention.kv_cache import (
    NUM_RESERVED_BLOCKS,
    bytes_per_block,
    num_blocks_for_budget,
)
from dist_engine.autotune import TuneShapes
from dist_engine.backends import Backends, resolve_backends
from dist_engine.distributed.groups import DistContext, rank_device, resolve_backend, side_group
from dist_engine.distributed.plain_data import all_gather_json, broadcast_json
from dist_engine.distributed.step_sync import TorchVote, agree_settings, find_failed_ranks
from dist_engine.distributed.wake import LocalWake, StoreWake
from dist_engine.engine.config import EngineConfig, model_identity
from dist_engine.engine.decode_graphs import ReplayedDecode, capture_sizes, graphs_refusal
from dist_engine.engine.dtype import DtypeChoice, checkpoint_dtype, resolve_auto_dtype
from dist_engine.engine.eplb import ExpertBalancer, count_nodes, initial_placement, moe_layers
from dist_engine.engine.host_memory import retain_freed_memory
from dist_engine.engine.messages import (
    INBOX_MESSAGES,
    AbortRequest,
    AddRequest,
    InboxMessage,
    Regroup,
    SetSchedulable,
    Shutdown,
)
from dist_engine.engine.outputs import ErrorKind, RequestOutput
from dist_engine.engine.request import Request, resume_sequence
from dist_engine.engine.resize import (
    Member,
    check_fit,
    free_memory,
    is_resize,
    reshard_model,
    resize_bytes,
    target_placements,
)
from dist_engine.engine.runner import ModelRunner, dispatch_mode
from dist_engine.engine.stats import RankStats, StepCounters, rank_stats
from dist_engine.engine.structured import GrammarMasks
from dist_engine.errors import GroupFailedError, LockstepError
from dist_engine.layers.moe import ExpertParallelContext
from dist_engine.log import get_logger
from dist_engine.models.config import ModelConfig, read_hf_config
from dist_engine.models.decoder import MoECausalLM
from dist_engine.models.loader import load_model
from dist_engine.models.registry import load_config
from moe import DispatchMode, Unjoined
from scheduler import (
    AttemptPoint,
    GroupView,
    LocalVote,
    SamplingParams,
    Scheduler,
    SchedulerOutputs,
    Sequence,
    StepKind,
)

OutputCallback = Callable[[RequestOutput], None]
# Given the failed group's context, leaves it and returns the re-formed group's (None: there
# will be none); blocks until then. Set by whoever hosts the engine (launcher/clients.py).
Rejoin = Callable[[DistContext | None], "DistContext | None"]
_SLEEP_POLL_S = 60.0
# The dispatch mode a step runs, as the lock-step check compares it (the last: no forward).
_MODE_CODES = {mode: code for code, mode in enumerate([*DispatchMode, None])}


@dataclass(frozen=True, slots=True)
class StepTrace:
    step: int
    kind: StepKind
    point: AttemptPoint
    group: GroupView | None  # vote 1, when taken
    any_scheduled: bool | None  # vote 2, when taken
    num_seqs: int
    num_tokens: int
    forward_s: float
    sync_s: float  # time inside vote and lock-step collectives
    step_s: float
    slept_s: float
    num_decode_seqs: int = 0  # a mixed step's decode tokens (their sequences) on this rank
    eplb: str = ""  # what EPLB did after the forward (ExpertBalancer.after_forward)


def check_max_model_len(max_model_len: int | None, model_config: ModelConfig) -> None:
    """A set max_model_len beyond the model's positions is a config error."""
    if max_model_len is not None and max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"scheduler.max_model_len ({max_model_len}) exceeds the model's "
            f"max_position_embeddings ({model_config.max_position_embeddings}); leave it unset "
            f"to use the model's"
        )


class Regrouping(Exception):
    """The group agreed to leave its process groups at this step and re-form (`Regroup`)."""


class DPEngine:
    def __init__(
        self,
        config: EngineConfig,
        dist_ctx: DistContext | None = None,
        *,
        model: MoECausalLM | None = None,
        on_output: OutputCallback | None = None,
        trace_limit: int = 1_000_000,
        join_as: tuple[int, int] | None = None,
    ) -> None:
        """join_as: (rank, group size) of a rank built before its group exists (a replacement
        for a failed rank): it loads everything, takes no collective, and runs only once
        `join_group` has taken it into the re-formed group.

        `rank` is this engine's DP rank for good (its outputs, stats and logs name it);
        `group_rank` and `group_size` are its place in the group it runs in, the same until
        a group shrinks onto its survivors (engine/resize.py)."""
        # A hub model's snapshot is the driver's directory; on another host, this host's copy.
        self.config = config = config.with_local_model()
        self.dist = dist_ctx
        if join_as is not None and dist_ctx is not None:
            raise ValueError("join_as is for a rank without a group yet")
        self.rank, self.group_size = join_as or (
            (dist_ctx.rank, dist_ctx.world_size) if dist_ctx else (0, 1)
        )
        if self.group_size != config.parallel.dp_size:
            raise ValueError(
                f"parallel.dp_size is {config.parallel.dp_size} but the group has "
                f"{self.group_size} rank(s)"
            )
        self.group_rank = self.rank
        self.group_dp_ranks = list(range(self.group_size))  # DP rank of each group rank
        self.log = get_logger(self.rank)
        self.model_config = load_config(config.model)
        config, self.dtype_choice = self._resolve_dtype(config, dist_ctx)
        self.config = config
        sched_config = dataclasses.replace(
            config.scheduler, vocab_size=self.model_config.vocab_size
        ).for_group(config.parallel.dp_size)
        check_max_model_len(sched_config.max_model_len, self.model_config)
        device = dist_ctx.device if dist_ctx else None
        if join_as is not None:
            device = rank_device(resolve_backend(config.parallel.backend), self.rank)
        if device is None or device.type == "cpu":
            retained = retain_freed_memory()
            self.log.debug("host malloc keeps freed memory: %s", retained)
        # Before the first collective: resolving the backends builds the CPU kernels where
        # they may be used, which takes tens of seconds the first time on a machine, and peers
        # waiting inside a collective for a rank that compiles would run into its timeout.
        self.backends: Backends = resolve_backends(
            config.backend_settings,
            config.torch_dtype,
            device,
            self.rank,
            shapes=self._tune_shapes(sched_config),
            attention_kind=self.model_config.attention_kind,
        )
        graphs = self._cuda_graphs(device)  # before the load: `on` where it cannot run fails
        self.vote: TorchVote | None = None
        if dist_ctx is not None:
            # Before anything expensive: a rank with other settings would desynchronise the
            # group's attempt points and hang in a collective later.
            agree_settings(dist_ctx.vote_group, config.group_agreed(model_identity(config.model)))
            self.vote = TorchVote(dist_ctx.vote_group, dist_ctx.shared_memory)
        if model is not None:
            # A model loaded by an earlier engine of this group (benchmarks and tests reuse one)
            # takes this engine's low-latency capacity: it was sized for the earlier settings,
            # and a decode step of more sequences than that would fail its dispatch.
            for layer in moe_layers(model):
                layer.ll_max_tokens_per_rank = self.config.ll_capacity
        self.model = model if model is not None else self._load_model(device, sched_config)
        self.balancer = self._make_balancer() if config.moe.enable_eplb else None
        sched_config = self._size_kv_pool(sched_config)
        sched_config = self._resolve_max_model_len(sched_config)
        self.model.attach_kv_cache(
            self.model.new_kv_cache(sched_config.num_blocks, sched_config.block_size, device)
        )
        self.runner = ModelRunner(
            self.model,
            sched_config.block_size,
            device or "cpu",
            max_model_len=sched_config.max_model_len,
            max_num_seqs=sched_config.max_num_seqs,
            decode_batch_sizes=capture_sizes(sched_config.max_num_seqs) if graphs else None,
        )
        if graphs:
            self.runner.decode_step = ReplayedDecode(self.runner.decode_logits, graphs, self.log)
        self.runner.sampler.native = self.backends.sampler.decode == "native"
        self.scheduler = Scheduler(sched_config, vote=self.vote)
        self.wake = self._wake_for(dist_ctx)
        self.on_output = on_output
        # Called around each step's outputs (begin, end), so a reader can take them as one
        # batch (launcher/clients.py, OutputBuffer); None: not told.
        self.output_burst: tuple[Callable[[], None], Callable[[], None]] | None = None
        # Set by the engine's host where a failed group may be re-formed around this rank
        # (Ray, `on_rank_failure: heal`): the loop then abandons the failed step, keeps its
        # requests and KV, and goes on in the new group (`_rejoin_after`).
        self.rejoin: Rejoin | None = None
        self.on_joined: Callable[[], None] | None = None  # called once it joined a new group
        self._in_flight: SchedulerOutputs | None = None  # the step whose forward is running
        self.left_because: str | None = None  # why it left its group, while it waits for one
        self.trace: collections.deque[StepTrace] = collections.deque(maxlen=trace_limit)
        self.step_counters = StepCounters()  # outlives the trace's limit; read by stats()
        self._inbox: collections.deque[InboxMessage] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._requests: dict[str, Request] = {}  # every request this rank holds, by id
        self._grammars = GrammarMasks(
            config.tokenizer or config.model,
            self.model_config.vocab_size,
            tuple(self.model_config.eos_token_ids),
        )
        # Seeds for requests without one: drawn in arrival order, so a rerun samples alike.
        self._seeds = (
            random.Random(f"lockstep:{config.seed}:{self.rank}")
            if config.seed is not None
            else None
        )
        self._votes = self.vote if self.vote is not None else LocalVote()
        self._shutting_down = False  # this rank asks the group to stop (in its next vote)
        self._regroup = False  # this rank asks the group to re-form (in its next vote)
        self._sleep_epoch = 0  # the wake epoch the group last agreed to sleep on
        self.stopped = False
        self._stop_reason = ""
        self._stop_kind = ErrorKind.ENGINE_STOPPED
        self.sleeping = False
        self.error: BaseException | None = None

    def _resolve_dtype(
        self, config: EngineConfig, dist_ctx: DistContext | None
    ) -> tuple[EngineConfig, DtypeChoice]:
        """`dtype: auto` -> the dtype this rank runs (engine/dtype.py); the group agrees on it
        with the other settings, before anything is loaded."""
        if config.dtype != "auto":
            return config, DtypeChoice(config.dtype, "set")
        choice = resolve_auto_dtype(
            checkpoint_dtype(read_hf_config(config.model)),
            dist_ctx.device if dist_ctx else None,
            self.model_config.hidden_size,
            self.model_config.moe_intermediate_size or self.model_config.hidden_size,
            config.scheduler.max_num_seqs,
        )
        self.log.info("dtype auto: %s", choice.describe())
        return config.with_overrides(dtype=choice.dtype), choice

    def describe_compute(self) -> str:
        """The backends this rank resolved and its dtype, for the run summary."""
        return f"{self.backends.describe()}; dtype {self.dtype_choice.describe()}"

    def _tune_shapes(self, sched_config) -> TuneShapes:
        """What `auto` backends are timed on: this rank's model and steps (autotune.py)."""
        return TuneShapes.for_model(
            self.model_config,
            self.config.dtype,
            self.group_size,
            decode_tokens=sched_config.max_num_seqs,
            prefill_tokens=sched_config.max_num_batched_tokens,
            block_size=sched_config.block_size,
        )

    def _resolve_max_model_len(self, sched_config):
        """An unset max_model_len is the model's max_position_embeddings, capped by what the
        pool holds; a set one that the pool cannot hold is kept, with a warning (such prompts
        end with prompt_length_exceeded, naming the pool). Every rank must end up with the same
        value: agreed like the other settings."""
        pool_tokens = (sched_config.num_blocks - NUM_RESERVED_BLOCKS) * sched_config.block_size
        limit = sched_config.max_model_len
        if limit is None:
            limit = min(self.model_config.max_position_embeddings, pool_tokens)
            sched_config = dataclasses.replace(sched_config, max_model_len=limit)
            self.log.info("max_model_len %d (the model's %d, the pool's %d tokens)", limit,
                          self.model_config.max_position_embeddings, pool_tokens)  # fmt: skip
        elif limit > pool_tokens:
            self.log.warning(
                "scheduler.max_model_len %d exceeds what the KV pool holds (%d blocks of %d = "
                "%d tokens): longer requests cannot run",
                limit,
                sched_config.num_blocks - NUM_RESERVED_BLOCKS,
                sched_config.block_size,
                pool_tokens,
            )
        if self.dist is not None:
            agree_settings(self.dist.vote_group, {"scheduler.max_model_len (resolved)": limit})
        return sched_config

    def _size_kv_pool(self, sched_config):
        """The pool's block count (from `kv_cache_bytes` when set), logged with its size."""
        spec, dtype, block_size = self.model.kv_spec, self.model.dtype, sched_config.block_size
        if self.config.kv_cache_bytes is not None:
            sched_config = dataclasses.replace(
                sched_config,
                num_blocks=num_blocks_for_budget(
                    spec, block_size, dtype, self.config.kv_cache_bytes
                ),
            )
        per_block = bytes_per_block(spec, block_size, dtype)
        self.log.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB; %s",
            sched_config.num_blocks,
            block_size,
            sched_config.num_blocks * per_block / 2**20,
            spec.describe(dtype),
        )
        return sched_config

    def _new_namespace(self) -> str:
        """A store namespace that is new for this engine and the same on every rank: a group
        may start several engines in turn, and stale wake keys must not leak between them."""
        assert self.dist is not None
        generation = None
        if self.group_rank == 0:
            generation = self.dist.store.add("lockstep/engine_generation", 1)
        generation = broadcast_json(generation, src=0, group=self.dist.vote_group)
        return f"lockstep/engine{generation}"

    def _wake_for(self, ctx: DistContext | None) -> StoreWake | LocalWake:
        """How a post wakes the group: through the group's store, so every rank's sleep sees
        it; for a group of one, a condition variable in this process. The store's costs a
        round trip or two per post (a DP=1 group under Ray or torchrun has a store too)."""
        if ctx is None or ctx.world_size == 1:
            return LocalWake()
        return StoreWake(ctx.store, self._new_namespace(), ctx.connect_store)

    def _load_model(self, device: object, sched_config) -> MoECausalLM:
        num_experts = self.model_config.num_experts
        group = None
        if self.group_size > 1:  # a rank built before its group gets the group's at the join
            group = self.dist.moe_exchange if self.dist else Unjoined(self.rank, self.group_size)
        context = ExpertParallelContext(
            placement=initial_placement(self.config.moe, num_experts, self.group_size),
            rank=self.rank,
            group=group,
            ll_max_tokens_per_rank=self.config.ll_capacity,
        )
        return load_model(
            self.config.model,
            dtype=self.config.torch_dtype,
            device=device,
            ep_context=context,
            backends=self.backends,
            max_decode_tokens=sched_config.max_num_seqs,
        )

    def _cuda_graphs(self, device) -> str | None:
        """The `cuda_graphs` mode decode steps run in ("on" | "auto"), or None for the eager
        forward; ValueError for `on` where graphs cannot run (decode_graphs.graphs_refusal)."""
        mode = self.config.cuda_graphs
        if mode == "off":
            return None
        refusal = graphs_refusal(device, self.group_size, self.config.moe.enable_eplb)
        if refusal is None:
            return mode
        if mode == "on":
            raise ValueError(f"cuda_graphs is 'on', but {refusal}; set it to auto or off")
        self.log.info("cuda_graphs auto: off (%s)", refusal)
        return None

    def _make_balancer(self) -> ExpertBalancer:
        """EPLB on this rank (engine/eplb.py); collective (the nodes the group spans, the
        expert source)."""
        group = self.dist.vote_group if self.dist is not None else None
        return ExpertBalancer(
            self.config.moe,
            self.model,
            self.config.model,
            self.group_rank,
            self.group_size,
            group,
            self.log,
            num_nodes=count_nodes(group, self.group_rank, self.group_size),
            transfer_group=self._transfer_group(self.dist),
        )

    def _transfer_group(self, ctx: DistContext | None) -> dist.ProcessGroup | None:
        """EPLB's group for peer transfers (collective), where peers may send experts."""
        if ctx is None or ctx.world_size == 1 or self.config.moe.eplb_expert_source == "checkpoint":
            return None
        # A namespace of its own: engines that a group starts in turn each make one.
        return side_group(ctx, f"{self._new_namespace()}/eplb_transfer")

    # -- called from any thread -------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        stream: bool = False,
        schedulable: bool = True,
        seed: int | None = None,
        resumed_token_ids: list[int] | tuple[int, ...] = (),
        sample_group: str | None = None,
        wake: bool = True,
    ) -> None:
        """Queue a request. ``wake=False`` leaves waking the group to the caller, who posts
        several and then calls `wake_up` once (each wake is a store round trip or two in a
        group). ``schedulable=False`` holds it (and, since nobody overtakes the
        head of the queue, those behind it) until ``set_schedulable``: a request whose inputs
        are still being prepared.

        Resuming a request another group had started (launcher/healing.py): ``seed`` is the
        seed it drew with when its params give none, and ``resumed_token_ids`` the output
        tokens it had committed; it continues after them as a fault-free run would
        (`resume_sequence`), reporting only the tokens after them as new.

        ``sample_group``: the key shared by the samples of one `n` request, which the front
        end sends as requests of their own; the rank computes their prompt once and they
        share its KV blocks (scheduler/samples.py)."""
        seq = Sequence(
            request_id,
            prompt_token_ids,
            sampling_params,
            eos_token_id=self.model_config.eos_token_ids,
            schedulable=schedulable,
            sample_group=sample_group,
        )
        if resumed_token_ids:
            resume_sequence(seq, resumed_token_ids)
        self._post(AddRequest(seq, stream, seed), wake)

    def set_schedulable(self, request_id: str, schedulable: bool = True) -> None:
        self._post(SetSchedulable(request_id, schedulable))

    def abort(self, request_id: str, reason: str | None = None) -> None:
        self._post(AbortRequest(request_id, reason))

    def shutdown(self) -> None:
        """Ask the group to stop; every rank leaves its loop at the same step."""
        self._post(Shutdown())

    def regroup(self) -> None:
        """Ask the group to leave its process groups at the same step and wait, with its
        requests and KV, to be re-formed (`join_group`); only where it may be (`rejoin`)."""
        self._post(Regroup())

    def stats(self, error: str | None = None) -> RankStats:
        """Queues, KV pool and step/vote counters, as of now (engine/stats.py)."""
        return rank_stats(self, error)

    def wake_up(self) -> None:
        """Wake the group for what was posted with ``wake=False``."""
        if not self.stopped:
            self._bump()

    def _post(self, item: InboxMessage, wake: bool = True) -> None:
        if not isinstance(item, INBOX_MESSAGES):
            raise TypeError(f"not an inbox message: {item!r}; expected one of {INBOX_MESSAGES}")
        # Inbox first, epoch second: the order the wake protocol's argument relies on.
        with self._inbox_lock:
            self._inbox.append(item)
        if self.stopped:
            # Nobody will take it in: answer here. (The loop drains once more after setting
            # `stopped`, so an item posted just before is answered there.)
            self._reject_inbox()
            return
        if wake:
            self._bump()

    def _bump(self) -> None:
        try:
            self.wake.bump()
        except Exception:
            # A failed group's store may be gone with its rank 0. A rank that will go on in a
            # re-formed group takes its inbox at its next step there; else the caller learns.
            if self.rejoin is None:
                raise

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        """Step until the group shuts down. Raises after failing every outstanding request if
        a collective fails or the ranks diverge, unless the group is re-formed around this
        rank (`rejoin`): then it goes on there with its requests."""
        while True:
            try:
                while not self.stopped:
                    self.step()
                return
            except BaseException as error:
                shared = self.dist.shared_memory if self.dist is not None else None
                if shared is not None and not isinstance(error, Regrouping):
                    # Peers blocked in a shared-memory vote or all-to-all learn of it at once.
                    shared.abort()
                failure = error
            try:
                if self._rejoin_after(failure):
                    continue
            except BaseException as join_error:  # the new group could not be joined
                failure = join_error
            self._fail_outstanding(failure)
            if self.error is failure:
                raise failure
            raise self.error from failure

    def _rejoin_after(self, error: BaseException) -> bool:
        """After a failed collective: abandon the step it was in (no token of it is committed
        or emitted here; its KV writes past the committed tokens are rewritten later), keep
        every request and its KV, wait for the group to be re-formed (`rejoin`) and join it.
        False where this rank cannot go on (no rejoin, an interrupt, no new group)."""
        if self.rejoin is None or self.stopped:
            return False
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            return False
        abandoned = self._in_flight
        if abandoned is not None:
            self.scheduler.abandon(abandoned)
            self._in_flight = None
        self._regroup = False
        first_line = (str(error).strip().splitlines() or [repr(error)])[0]
        if isinstance(error, Regrouping):
            self.log.info(
                "the group leaves its process groups at step %d to re-form, keeping %d "
                "request(s) and their KV",
                self.scheduler.step_index, self.scheduler.num_unfinished,
            )  # fmt: skip
        else:
            self.log.error(
                "the group failed at step %d (%s: %s); %s, keeping %d request(s) and their "
                "KV, waiting for the group to be re-formed",
                self.scheduler.step_index, type(error).__name__, first_line,
                "abandoned that step" if abandoned is not None else "between steps",
                self.scheduler.num_unfinished,
            )  # fmt: skip
        self.left_because = f"{type(error).__name__}: {first_line}"
        try:
            ctx = self.rejoin(self.dist)
        finally:
            self.left_because = None
        if ctx is None:
            return False
        self.join_group(ctx)
        if self.on_joined is not None:
            self.on_joined()
        return True

    def join_group(self, ctx: DistContext) -> None:
        """Take this rank into a group re-formed after a failure (new processes for the
        failed ranks, new process groups, a new store): a surviving rank from its loop, a
        replacement (`join_as`) before its first step. Collective: every rank of the new group
        calls it once, and they then agree on the settings and on where the step policy starts
        (the highest step index among them), as a new group's ranks would.

        The group may have another size than the one this rank left (engine/resize.py): shrunk
        onto the survivors of a failure no replacement could be started for, or grown back to
        `parallel.dp_size`. Every rank then moves its experts to the new placement before the
        group's first step, reading from the checkpoint only those it lacks."""
        old_vote = self.vote
        with self._inbox_lock:  # asked of the group just left: the group re-forms now
            kept = [item for item in self._inbox if not isinstance(item, Regroup)]
            self._inbox = collections.deque(kept)
        self._regroup = False
        layers = moe_layers(self.model)
        me = Member(
            self.rank,
            self.group_rank,
            self.group_size,
            kept=old_vote is not None,
            maps=[layer.placement.phy2log.tolist() for layer in layers],
        )
        members = [Member(**each) for each in all_gather_json(me.as_json(), ctx.vote_group)]
        if is_resize(members, ctx.world_size):
            self._resize(ctx, members)
        else:
            for layer in layers:
                layer.join(ctx.moe_exchange)
        self.group_rank, self.group_size = ctx.rank, ctx.world_size
        self.group_dp_ranks = [member.dp_rank for member in members]
        self.dist = ctx
        self.vote = TorchVote(ctx.vote_group, ctx.shared_memory)
        if old_vote is not None:
            self.vote.num_calls = old_vote.num_calls
        self.scheduler.vote = self.vote
        self._votes = self.vote
        agree_settings(
            ctx.vote_group,
            {
                **self.config.group_agreed(model_identity(self.config.model)),
                "scheduler.max_model_len (resolved)": self.scheduler.config.max_model_len,
            },
        )
        step_index = -self.vote.allreduce_min([-self.scheduler.step_index])[0]
        self.scheduler.restart_policy(step_index)
        if self.balancer is not None:  # the kept ranks' placement, on every rank
            # A replacement (`join_as`) had no group, so no vote, before this join.
            self.balancer.join(
                ctx.vote_group,
                replacement=old_vote is None,
                transfer_group=self._transfer_group(ctx),
                rank=ctx.rank,
                num_ranks=ctx.world_size,
            )
        self.wake = self._wake_for(ctx)
        self._sleep_epoch = 0
        self.log.info(
            "joined the re-formed group at step %d as rank %d of %d (DP ranks %s)",
            step_index, ctx.rank, ctx.world_size, self.group_dp_ranks,
        )  # fmt: skip

    def _resize(self, ctx: DistContext, members: list[Member]) -> None:
        """Move the experts to the placement of a group of another size (collective: the
        placement and the memory check are the group's)."""
        start = time.perf_counter()
        layers = moe_layers(self.model)
        targets = target_placements(
            members,
            self.config.moe,
            self.model_config.num_experts,
            self.config.parallel.dp_size,
            len(layers),
        )
        experts = layers[0].experts
        expert_bytes = (experts.w13[0].numel() + experts.w2[0].numel()) * experts.w13.element_size()
        needed = resize_bytes(
            layers[0].placement.slots_per_rank,
            targets[0].slots_per_rank,
            expert_bytes,
            len(layers),
        )
        sizes = all_gather_json([needed, free_memory(experts.w13.device)], ctx.vote_group)
        check_fit(
            [need for need, _ in sizes],
            [free for _, free in sizes],
            [member.dp_rank for member in members],
        )
        group = ctx.moe_exchange if ctx.world_size > 1 else None
        num_read = reshard_model(self.model, self.config.model, targets, ctx.rank, group)
        self.log.warning(
            "the group re-forms with %d rank(s) (DP ranks %s), this rank as %d: %d expert "
            "slot(s) per layer, %d expert(s) read from the checkpoint over %d layer(s), %.0f ms",
            ctx.world_size, [m.dp_rank for m in members], ctx.rank, targets[0].slots_per_rank,
            num_read, len(layers), 1e3 * (time.perf_counter() - start),
        )  # fmt: skip

    def step(self) -> StepTrace:
        start = time.perf_counter()
        seen_epoch = self.wake.seen_epoch  # read before draining: see distributed/wake.py
        self._intake()
        sched = self.scheduler
        outputs = self._schedule(
            sched.plan(wake_epoch=seen_epoch, shutdown=self._shutting_down, regroup=self._regroup)
        )
        self._in_flight = outputs  # until its tokens are committed: undone if a collective fails
        self._emit_all(outputs.ignored_seqs)
        view = outputs.group
        kind = outputs.kind
        if self.config.check_lockstep and self.vote is not None:
            self.vote.check_lockstep(outputs.step_index, kind, _MODE_CODES[dispatch_mode(kind)])
        if view is not None and view.shutdown:
            self._in_flight = None
            self._stop("engine shut down", ErrorKind.ENGINE_STOPPED)
            return self._record(outputs, kind, start, 0.0, 0.0)
        if view is not None and view.regroup:  # every rank leaves here: `_rejoin_after`
            raise Regrouping(f"the group agreed to re-form at step {outputs.step_index}")
        forward_start = time.perf_counter()
        tokens, failures = self.runner.execute(outputs, self._requests)
        forward_s = time.perf_counter() - forward_start
        for seq, reason in failures:  # one request's fault ends that request, not the group
            self.log.warning("request %s failed: %s", seq.request_id, reason)
            self._end_with_error(seq.request_id, reason, ErrorKind.REQUEST_FAILED)
        self._in_flight = None
        finished = sched.process_outputs(outputs, tokens)
        self._advance_grammars(outputs.scheduled_seqs)
        begin, end = self.output_burst or (None, None)
        if begin is not None:
            begin()
        try:
            self._emit_stream(outputs.scheduled_seqs)
            self._emit_all(finished)
        finally:
            if end is not None:
                end()
        eplb = ""
        if self.balancer is not None and not outputs.known_empty:
            # After the outputs are out, so a rebalance decision never delays this step's
            # tokens; every rank ran this forward, so every rank takes EPLB's collectives here.
            eplb = self.balancer.after_forward(outputs.step_index, self._votes)
        slept_s = 0.0
        if view is not None and view.none_work:
            slept_s = self._maybe_sleep(view)
        return self._record(outputs, kind, start, forward_s, slept_s, eplb)

    def _schedule(self, plan) -> SchedulerOutputs:
        """Run the scheduler's plan for this step, answering each vote it yields with a
        MIN-allreduce over the group: vote 1 at an attempt point, vote 2 after a decision to
        prefill. Every rank takes these same collectives in the same order."""
        try:
            vector = next(plan)
            while True:
                try:
                    group_min = self._votes.allreduce_min(vector)
                except BaseException as error:
                    # Into the plan, which puts back what it assembled, and out again.
                    plan.throw(error)
                    raise
                vector = plan.send(group_min)
        except StopIteration as done:
            return done.value

    def _intake(self) -> None:
        with self._inbox_lock:
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            match item:
                case AddRequest(seq, stream, seed):
                    self._admit(seq, stream, seed)
                case SetSchedulable(request_id, schedulable):
                    if self.scheduler.get_sequence(request_id) is not None:
                        self.scheduler.set_schedulable(request_id, schedulable)
                case AbortRequest(request_id, reason):
                    self._end_with_error(request_id, reason, ErrorKind.REQUEST_FAILED)
                case Shutdown():
                    self._shutting_down = True
                case Regroup():
                    self._regroup = self.rejoin is not None
                case _:  # _post refuses anything else; this guards the loop's own state
                    raise TypeError(f"unknown inbox message {item!r}")

    def _admit(self, seq: Sequence, stream: bool, seed: int | None) -> None:
        """A new request: its record, then the scheduler's queue. ``seed``: the caller's for
        a request whose params give none; None: drawn here."""
        if seq.request_id in self._requests:
            self._reject(seq, f"request id {seq.request_id!r} is already in use")
            return
        if seed is None and self._seeds is not None:
            seed = self._seeds.getrandbits(63)
        try:
            request = Request.admit(seq, stream, seed)
            if seq.sampling_params.grammar is not None:
                request.matcher = self._grammars.matcher(seq.sampling_params.grammar)
                # A resumed request's committed tokens came out of this grammar already: the
                # matcher takes them first, so its next mask is the one after them.
                self._start_grammar(request, seq.output_token_ids)
        except ValueError as error:
            self._reject(seq, f"sampling settings rejected: {error}")
            return
        self._requests[seq.request_id] = request
        try:
            self.scheduler.add_sequence(seq)
        except ValueError as error:
            del self._requests[seq.request_id]
            self._reject(seq, str(error))

    def _start_grammar(self, request: Request, committed: list[int]) -> None:
        """Start (or resume) a request's grammar over its committed output tokens: from the
        first, or, with `grammar_after`, from just after the marker's first occurrence; until
        the marker comes, no mask (`next_mask` None) and nothing consumed."""
        marker = request.seq.sampling_params.grammar_after
        # While waiting, num_matched counts the tokens already searched for the marker.
        start = _grammar_start(committed, marker, request.num_matched)
        if start is None:
            request.num_matched = len(committed)
            return
        if len(committed) > start:
            request.matcher.consume_tokens(committed[start:])
        request.num_matched = len(committed)
        request.next_mask = self._grammars.next_mask(request.matcher)

    def _advance_grammars(self, seqs: list[Sequence]) -> None:
        """Each grammar-bound request consumes the tokens this step committed, and its mask
        for the next one starts on a worker thread while the next step is scheduled and run."""
        for seq in seqs:
            request = self._requests.get(seq.request_id)
            if request is None or request.matcher is None or seq.is_finished:
                continue
            committed = seq.output_token_ids
            if request.next_mask is None:  # waiting for grammar_after's marker
                self._start_grammar(request, committed)
                continue
            if len(committed) > request.num_matched:
                request.matcher.consume_tokens(committed[request.num_matched :])
                request.num_matched = len(committed)
                request.next_mask = self._grammars.next_mask(request.matcher)

    def _end_with_error(self, request_id: str, reason: str | None, kind: ErrorKind) -> None:
        """End a request the rank holds: aborted (``reason`` None) or failed with ``reason``
        of ``kind``; its terminal output goes out at once."""
        ended = self.scheduler.abort(request_id, reason)
        if ended is not None:
            if reason is not None:
                self._requests[request_id].error_kind = kind
            self._emit(ended)

    def _maybe_sleep(self, view: GroupView) -> float:
        """The group agreed nobody has work. Sleep if no rank saw a newer wake epoch than the
        one last agreed; else agree on the newest and look again next step."""
        if view.max_wake_epoch != self._sleep_epoch:
            self._sleep_epoch = view.max_wake_epoch
            return 0.0
        if self.group_rank == 0:
            self.wake.forget_through(self._sleep_epoch)
        start = time.perf_counter()
        self.sleeping = True
        try:
            while not self.wake.wait_beyond(self._sleep_epoch, _SLEEP_POLL_S):
                pass
        finally:
            self.sleeping = False
        return time.perf_counter() - start

    def _record(
        self,
        outputs: SchedulerOutputs,
        kind: StepKind,
        start: float,
        forward_s: float,
        slept_s: float,
        eplb: str = "",
    ) -> StepTrace:
        trace = StepTrace(
            step=outputs.step_index,
            kind=kind,
            point=outputs.point,
            group=outputs.group,
            any_scheduled=outputs.any_scheduled,
            num_seqs=outputs.num_seqs,
            num_tokens=outputs.num_batched_tokens,
            num_decode_seqs=outputs.num_decode_seqs,
            forward_s=forward_s,
            sync_s=self.vote.take_seconds() if self.vote is not None else 0.0,
            step_s=time.perf_counter() - start - slept_s,
            slept_s=slept_s,
            eplb=eplb,
        )
        self.trace.append(trace)
        self.step_counters.record(trace)
        return trace

    # -- results ----------------------------------------------------------------------------
    def _emit(self, seq: Sequence) -> None:
        """Report a finished sequence: its one terminal result (with any unstreamed tokens),
        and drop its record."""
        request = self._requests.pop(seq.request_id, None)
        if request is None:  # ended at arrival, before it had a record
            self._deliver(RequestOutput.of(seq, self.rank, 0))
            return
        self._deliver(request.terminal(self.rank))

    def _emit_all(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._emit(seq)

    def _emit_stream(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            request = self._requests.get(seq.request_id)
            if request is not None and request.stream:
                delta = request.delta(self.rank)
                if delta is not None:
                    self._deliver(delta)

    def _deliver(self, output: RequestOutput) -> None:
        if self.on_output is not None:
            self.on_output(output)

    def _reject(
        self, seq: Sequence, reason: str, kind: ErrorKind = ErrorKind.INVALID_REQUEST
    ) -> None:
        """Answer a request the scheduler never took (its id may belong to a live request)."""
        self._deliver(
            RequestOutput.failed(
                seq.request_id, seq.prompt_token_ids, reason, self.rank, seq.arrival_time, kind
            )
        )

    # -- endings ----------------------------------------------------------------------------
    def _stop(self, reason: str, kind: ErrorKind) -> None:
        """End every request this rank holds or has been sent, then stop taking any."""
        self._intake()
        for request_id in self.scheduler.unfinished_request_ids():
            self._end_with_error(request_id, reason, kind)
        self._stop_reason = reason
        self._stop_kind = kind
        if self.balancer is not None:
            self.balancer.close()
        self.stopped = True
        self._reject_inbox()
        self._grammars.shutdown()

    def _reject_inbox(self) -> None:
        with self._inbox_lock:
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            if isinstance(item, AddRequest):
                self._reject(item.seq, f"engine stopped: {self._stop_reason}", self._stop_kind)

    def _fail_outstanding(self, error: BaseException) -> None:
        if isinstance(error, (LockstepError, KeyboardInterrupt, SystemExit)):
            self.error = error
        else:
            self.error = self._describe_failure(error)
        self.log.error("stopping: %s", self.error)
        self._stop(str(self.error), ErrorKind.GROUP_FAILED)

    def _describe_failure(self, error: BaseException) -> GroupFailedError:
        if self.dist is None:
            return GroupFailedError(f"rank 0 failed: {error}", [])
        failed = find_failed_ranks(
            self.dist.store,
            self.group_rank,
            self.group_size,
            tag=f"step{self.scheduler.step_index}",
        )
        if failed is not None:
            failed = [self.group_dp_ranks[rank] for rank in failed]
        if failed is None:
            first = self.group_dp_ranks[0]
            names, failed = f"rank {first} (it hosts the rendezvous store, which is gone)", [first]
        elif failed:
            names = ", ".join(f"rank {r}" for r in failed) + " stopped answering"
        else:
            names = "no rank is missing"
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        return GroupFailedError(
            f"DP group failed at step {self.scheduler.step_index} as seen from rank "
            f"{self.rank}: {names} ({type(error).__name__}: {first_line})",
            failed,
        )


def _grammar_start(committed: list[int], marker: tuple[int, ...], searched: int) -> int | None:
    """Where a grammar starts in the committed output: 0 without a marker, just after the
    marker's first occurrence with one, None while it has not come. Occurrences ending within
    the first ``searched`` tokens were looked for before."""
    if not marker:
        return 0
    width = len(marker)
    for end in range(max(width, searched + 1), len(committed) + 1):
        if tuple(committed[end - width : end]) == marker:
            return end
    return None
