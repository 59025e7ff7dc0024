"""The offline API: ``LLM(...).generate(prompts, params)`` over a DP group of engines, shaped
like vLLM's.

    with LLM(DIR, data_parallel_size=2, launcher="ray", dtype="float32") as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=32))
        outputs[0].outputs[0].text          # vLLM's shape
        outputs[0].text, outputs[0].output_token_ids, outputs[0].dp_rank   # Lockstep's

``model`` is a checkpoint directory or a Hugging Face hub id (``"org/name"``, with
``revision=``), resolved through the hub's cache before any rank starts. Prompts are token-id
lists, or strings when the tokenizer directory (the model's, or the `tokenizer` setting) has
a tokenizer (the server's kind, launcher/server/tokenization.py). Each output carries vLLM's
``request_id``, ``prompt``, ``prompt_token_ids``, ``outputs`` (one `CompletionOutput` per
sample, ``SamplingParams.n`` of them, index order) and ``finished``, and Lockstep's own
``output_token_ids``, ``text``, ``finish_reason``, ``dp_rank``, ``detail`` and timings, which
describe the first sample. The front end applies ``n`` and ``stop`` strings as the server
does (launcher/samples.py): each sample is a rank request of its own (with a seed derived
from the request's, or the job's `DriverSeeds` draw), all on one rank, which computes their
prompt once and shares its KV blocks among them (scheduler/samples.py), and a sample whose
text reaches a stop string is aborted on its rank and ends with finish reason "stop", its
text cut before the stop string (after it with ``include_stop_str_in_output``) and its token
ids through the token that completed it, so text and tokens are the server's for the same
request. A sample ended by a stop string carries no ``finish_time`` or ``token_times`` (its
rank never finished it). ``generate(prompts)`` with no sampling params samples
with the model's defaults (launcher/generation_config.py), as vLLM does; a given
``SamplingParams`` is used as it is (``SamplingParams()`` is greedy), except that every
request stops at the model's EOS ids (config.json's, generation_config.json's and the
tokenizer's eos_token, as vLLM stops) unless it sets ``ignore_eos``. If a rank dies or stops
answering, the group heals (``on_rank_failure: heal``, the default, under Ray): it is
replaced by a new one and every unfinished request goes on there, ending with the tokens a
fault-free run gives (launcher/healing.py). Where it cannot heal (``fail``, the recovery
budget spent, a local or torchrun group), ``generate`` raises ``LockstepError`` naming the
rank; the error's ``outputs`` hold every request's result, the unfinished ones failed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.engine import check_max_model_len
from dist_engine.engine.eplb import check_slots
from dist_engine.engine.outputs import (
    CompletionOutput,
    ErrorKind,
    Logprob,
    RequestOutput,
    TokenLogprob,
)
from dist_engine.engine.stats import ExpertStats, group_expert_stats
from dist_engine.errors import GroupFailedError, LockstepError
from dist_engine.log import get_logger
from dist_engine.models.loader import check_checkpoint
from launcher.clients import (
    Client,
    LocalClient,
    RankFailure,
    Submission,
    group_max_model_len,
    reading_outputs,
)
from launcher.flags import VLLM_KEYWORDS
from launcher.generation_config import GenerationDefaults, load_generation_defaults, with_eos_ids
from launcher.healing import (
    DriverSeeds,
    GroupFault,
    RecoveryBudget,
    ResumeLedger,
    describe_reform,
    is_group_failure,
)
from launcher.routing import Router
from launcher.samples import (
    Piece,
    SampleText,
    grammar_tokenizer,
    rank_params,
    truncated,
    truncation,
    with_bad_words,
    with_grammar,
)
from launcher.server.protocol import chat_messages
from launcher.server.tokenization import ModelTokenizer, check_tokenizer_dir
from scheduler import SamplingParams

log = get_logger()
_POLL_S = 0.02


@dataclass(frozen=True)
class Completion(RequestOutput):
    """One prompt's result: vLLM's view of it (``prompt``, and ``outputs``: one
    `CompletionOutput` per sample, index 0 to n - 1), and, in the `RequestOutput` fields and
    ``text``, Lockstep's view of its first sample (``request_id`` is the prompt's)."""

    text: str | None = None
    prompt: str | None = None  # the prompt as given, when it was text (vLLM's `prompt`)
    outputs: list[CompletionOutput] = field(default_factory=list)  # vLLM's: one per sample


@dataclass(frozen=True)
class _Sample:
    """One of a prompt's `n` samples: a request of its own on a rank."""

    request_id: str  # the prompt's for n = 1, else "<prompt's>-<index>"
    params: SamplingParams  # as a rank takes them (`rank_params`): n = 1, no stop strings
    seed: int | None  # fixed here when the params give none (`DriverSeeds`)


@dataclass(frozen=True)
class _Prompt:
    """One prompt of a `generate` call, tokenized and named, before it is routed."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams  # as given (with the EOS ids): its n, stop strings, logprobs
    dp_rank: int | None  # pinned by the caller, or None
    text: str | None  # the prompt as given, when it was text
    samples: tuple[_Sample, ...]


# A sample as `_run` ends it: its terminal output as the front end keeps it (tokens through a
# stop string, finish reason "stop" once one matched), and its text.
_Ended = tuple[RequestOutput, SampleText]


class _GroupFailure(Exception):
    """Raised by `LLM._run` after every request ended, when ranks failed: rank -> reason
    (rank -1: a failure not tied to one rank)."""

    def __init__(self, failed: dict[int, str]) -> None:
        super().__init__(_describe(failed))
        self.ranks = {rank for rank in failed if rank >= 0}
        self.reason = _describe(failed)


def _describe(failed: dict[int, str]) -> str:
    return "; ".join(reason for _, reason in sorted(failed.items()))


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        config: EngineConfig | str | Path | None = None,
        data_parallel_size: int | None = None,
        dp_size: int | None = None,
        launcher: str | None = None,
        dtype: str | None = None,
        routing: str = "round_robin",
        enable_expert_parallel: bool | None = None,
        **overrides: Any,
    ) -> None:
        """``model`` (a checkpoint directory or a hub id) or ``config`` (an EngineConfig or a
        YAML path), then any config key by name (``max_model_len=4096``, ``revision="v1"``:
        a hub id's branch, tag or commit); vLLM's names are taken too:
        ``data_parallel_size`` (``dp_size``), ``kv_cache_memory_bytes`` (``kv_cache_bytes``),
        ``enable_expert_parallel=True`` (expert parallelism is always on). ``seed=N`` (a config
        key like the others) seeds the requests that give none; None: random."""
        if enable_expert_parallel is False:
            raise ValueError(
                "enable_expert_parallel=False: Lockstep always spreads the experts over the DP "
                "ranks (wide expert parallelism); leave it out or pass True"
            )
        if enable_expert_parallel:
            log.info("enable_expert_parallel: expert parallelism is always on; nothing changes")
        self.config = _build_config(
            model, config, _dp_size(data_parallel_size, dp_size), launcher, dtype, overrides
        )
        launcher_name = self.config.parallel.launcher
        if launcher_name != "torchrun" and started_by_torchrun():
            raise ValueError(
                f"this process was started by torchrun, but parallel.launcher is "
                f"{launcher_name!r}: every torchrun process would start a whole group of its "
                f"own; set launcher: torchrun (one rank per process), or run without torchrun"
            )
        # Before any rank starts: a hub id becomes its snapshot directory pinned to a commit
        # (the ranks get that directory), and a bad model is one clear line here, not a remote
        # traceback from every rank after the launcher came up.
        self.config = self.config.with_local_model()
        model_config = self._model_config = check_checkpoint(self.config.model)
        check_max_model_len(self.config.scheduler.max_model_len, model_config)
        check_slots(self.config.moe, model_config.num_experts, self.config.parallel.dp_size)
        if self.config.tokenizer is not None:
            check_tokenizer_dir(self.config.tokenizer, "tokenizer")
        self.tokenizer = _load_tokenizer(self.config.tokenizer or self.config.model)
        self.generation_defaults: GenerationDefaults = load_generation_defaults(
            self.config.generation_config, self.config.model
        )
        # What ends every request that does not ignore EOS, besides config.json's ids (the
        # engine's own): the generation config's and the tokenizer's, as the server stops.
        self.eos_token_ids = self.generation_defaults.eos_token_ids | (
            self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset()
        )
        check_gpu_memory_utilization(self.config)
        check_cuda_graphs(self.config)
        self.client: Client
        with group_loading(self.config):
            if launcher_name == "ray":
                from launcher.ray_launcher import RayClient

                self.client = RayClient(self.config)
            elif launcher_name == "torchrun":
                from launcher.torchrun_launcher import TorchrunClient

                self.client = TorchrunClient(self.config)
            else:
                self.client = LocalClient(self.config)
        try:
            check_gpu_memory_utilization(self.config, self.client)
        except ValueError:
            self.client.shutdown()
            raise
        log.info("%s", self.generation_defaults.describe())
        self.router = Router(self.client.num_ranks, routing)
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        self.closed = False
        # A torchrun rank whose LLM is never shut down (no `with`, no shutdown()) would keep its
        # process groups into interpreter finalization, where gloo's threads can abort the
        # process after a successful job (see TorchrunClient.shutdown); shut it down at exit,
        # before finalization, instead. The finalizer holds the client, not this object.
        self._at_exit = weakref.finalize(self, self.client.shutdown) if self._torchrun else None

    # -- generation -------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate(prompts)`` samples with when given no params (vLLM's name): the
        model's generation_config.json values for temperature, top_p and top_k (vLLM's
        defaults, temperature 1.0, where it has none), its EOS ids as stop ids, 16 tokens."""
        return self.generation_defaults.sampling_params()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        dp_rank: int | Sequence[int | None] | None = None,
        use_tqdm: bool = True,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        lora_request: Any = None,
        priority: int | Sequence[int] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """Run every prompt to its end; results in input order. ``sampling_params``: one for
        all, one per prompt, or None for `get_default_sampling_params()`.

        vLLM's keywords: ``tokenization_kwargs`` takes ``add_special_tokens`` (for text
        prompts; default True), ``truncate_prompt_tokens`` and ``truncation_side`` (as the
        server's fields); ``lora_request``, ``priority`` and ``mm_processor_kwargs`` are
        accepted at their neutral values (None, 0) only: there are no adapters, priority
        policy or multi-modal inputs here, and a request must not have them ignored.

        A rank that fails is healed over (`on_rank_failure: heal`): the results are those of a
        fault-free run. Where it is not, raises `LockstepError` naming it once every request
        has its one terminal result: the error's `outputs` hold all of them in input order,
        the finished ones as they finished and the others failed with the reason.
        """
        _check_neutral(lora_request, priority, mm_processor_kwargs)
        finals = dict(
            self._as_completed(
                prompts, sampling_params, dp_rank, use_tqdm, tokenization_kwargs, deferred=True
            )
        )
        return [finals[i] for i in range(len(finals))]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        dp_rank: int | Sequence[int | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: Any = None,
        priority: int | Sequence[int] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """vLLM's `LLM.chat`: one conversation (a list of messages, each with a ``role`` and a
        string or text-part ``content``) or a list of them, each rendered by the model's chat
        template and generated as `generate` does; the prompt is what the server's
        /v1/chat/completions makes of the same messages, so the tokens are the same.
        ``chat_template_kwargs`` reach the template (e.g. ``enable_thinking``);
        ``tokenization_kwargs`` truncate the rendered prompt as `generate`'s do; ``tools``
        reach the template (vLLM's offline chat does not read calls from the reply: the text is
        returned); ``continue_final_message`` continues the last (assistant) message instead
        of opening a new one. ValueError without a tokenizer or a chat template, or for a
        message that is not one."""
        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer; this model has none")
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.render_chat(
                chat_messages(conversation),
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
                **({"tools": tools} if tools else {}),
            )
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(
            prompts,
            sampling_params,
            dp_rank,
            use_tqdm,
            tokenization_kwargs=tokenization_kwargs,
            lora_request=lora_request,
            priority=priority,
            mm_processor_kwargs=mm_processor_kwargs,
        )

    def get_tokenizer(self) -> ModelTokenizer | None:
        """vLLM's: the tokenizer prompts are encoded and outputs decoded with (`llm.tokenizer`;
        `encode`, `decode`, `token_to_id`, `render_chat`), or None for a model without one."""
        return self.tokenizer

    def generate_as_completed(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        dp_rank: int | Sequence[int | None] | None = None,
        use_tqdm: bool = False,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        deferred: bool = False,
    ) -> Iterator[tuple[int, Completion]]:
        """Yield `(prompt index, result)` for every prompt as it finishes (each exactly once;
        a prompt with n > 1 once all its samples have). With ``deferred`` a result may come
        up to a quarter of a second after its request ended: each rank gathers finished
        requests and hands them over together while it still has others (as for `generate`;
        under Ray that saves a round trip per finishing step, ~8-10% of a 2-core host's tok/s).

        A rank that fails is healed over as `generate` says. Where it is not, the requests it
        held are yielded failed (reason naming the rank), the other ranks' requests still end
        on their own (or fail within the collective timeout plus a margin), and then
        `LockstepError` is raised as `generate` describes. Under
        torchrun this process's share comes first, the other ranks' results after the
        exchange.
        """
        return self._as_completed(
            prompts, sampling_params, dp_rank, use_tqdm, tokenization_kwargs, deferred=deferred
        )

    def _as_completed(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        dp_rank: int | Sequence[int | None] | None,
        use_tqdm: bool,
        tokenization_kwargs: dict[str, Any] | None,
        *,
        deferred: bool,
    ) -> Iterator[tuple[int, Completion]]:
        """`generate_as_completed`; ``deferred``: the caller reads the results only once all
        have come (`generate`), so a rank may hold finished ones back to send them together
        (`Submission.deferred`)."""
        requests = self._prepare(prompts, sampling_params, dp_rank, tokenization_kwargs)
        finals: dict[int, Completion] = {}
        ended: dict[int, dict[int, _Ended]] = {}  # prompt index -> sample index -> its end
        total = len(requests)
        if self._torchrun:  # each process serves its share; only rank 0 shows progress
            use_tqdm = use_tqdm and self.client.rank == 0
            total = sum(1 for index, request in enumerate(requests) if self._serves(index, request))
        failure: _GroupFailure | None = None
        with tqdm(total=total, disable=not use_tqdm, desc="generate") as progress:
            try:
                for index, sample, output, text in self._run(
                    requests, stream=False, deferred=deferred
                ):
                    samples = ended.setdefault(index, {})
                    samples[sample] = (_whole(output, text), text)
                    if len(samples) < len(requests[index].samples):
                        continue
                    finals[index] = self._completion(requests[index], sorted(samples.items()))
                    progress.update(1)
                    yield index, finals[index]
            except _GroupFailure as raised:
                failure = raised
        if self._torchrun:
            mine = set(finals)
            try:
                merged = self.client.exchange(_exchanged(requests, ended))
            except LockstepError as error:
                failure = failure or _GroupFailure({-1: str(error)})
                merged = {}
            position = 0  # of the prompt's first sample among all prompts' samples, in order
            for index, prompt in enumerate(requests):
                first, position = position, position + len(prompt.samples)
                if index in mine:
                    continue
                samples = {}
                for sample, named in enumerate(prompt.samples):
                    output = merged.get(first + sample)
                    if output is None:  # a rank that never delivered its share
                        reason = failure.reason if failure else "no result"
                        output = self._failed_output(prompt, named.request_id, reason)
                    samples[sample] = self._replayed(prompt, output)
                finals[index] = self._completion(prompt, sorted(samples.items()))
                yield index, finals[index]
        if failure is not None:
            self.shutdown()
            raise GroupFailedError(
                f"the DP group failed: {failure.reason}",
                sorted(failure.ranks),
                [finals[i] for i in range(len(requests))],
            )

    def generate_stream(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        dp_rank: int | Sequence[int | None] | None = None,
    ) -> Iterator[Completion]:
        """Yield each sample's new tokens as they come; its last item has ``finished``. An
        item is one sample's state: its ``outputs`` hold that one `CompletionOutput`, with
        the sample's ``index`` (0 for n = 1), its token ids so far (through the stop string
        that ended it), and its text once it finished; the top-level fields describe that
        sample too, under the prompt's ``request_id``.
        A rank failure is healed over as `generate` says (a stream goes on with no token missing
        or repeated); where it is not, it ends its requests with a failed last item, then
        raises LockstepError."""
        if self._torchrun:
            raise ValueError("generate_stream is not available under torchrun; use generate")
        requests = self._prepare(prompts, sampling_params, dp_rank)
        try:
            for index, sample, output, text in self._run(requests, stream=True):
                yield self._completion(requests[index], [(sample, (output, text))])
        except _GroupFailure as failure:
            self.shutdown()
            raise GroupFailedError(
                f"the DP group failed: {failure.reason}", sorted(failure.ranks)
            ) from None

    def _serves(self, index: int, prompt: _Prompt) -> bool:
        """Under torchrun: whether this process's rank serves prompt ``index``."""
        pin = prompt.dp_rank
        return (pin if pin is not None else index % self.client.num_ranks) == self.client.rank

    @property
    def moe_exchange(self) -> str:
        """How the group's MoE all-to-alls (and, with shared memory, votes) travel:
        "shared memory" (ranks on one host, `parallel.moe_exchange: auto`), the process
        group's backend ("gloo", "nccl"), or "none" for a single rank."""
        return self.client.moe_exchange

    @property
    def backends(self) -> str:
        """Which implementation runs attention, the experts and the norms (per regime where
        they differ), as the ranks resolved `attention_backend`, `expert_backend` and
        `norm_backend` at start-up."""
        return self.client.backends

    def expert_stats(self) -> ExpertStats:
        """Expert load balancing (EPLB): `balancedness` (per MoE layer, mean / max tokens per
        rank over the last window measured), `num_rebalances`, and the last rebalance's
        steps, balancedness before and after, time and bytes moved (`ExpertStats`);
        `enabled=False` without `enable_eplb`. Under torchrun only this process's rank
        reports, so the bytes are its own."""
        return group_expert_stats(self.client.stats())

    @property
    def _torchrun(self) -> bool:
        return self.config.parallel.launcher == "torchrun"

    def _prepare(
        self, prompts, sampling_params, dp_rank, tokenization_kwargs=None
    ) -> list[_Prompt]:
        if self.closed:
            raise LockstepError("this LLM is shut down; start a new one")
        add_special_tokens, cut = self._tokenization(tokenization_kwargs)
        prompts = _prompt_list(prompts)
        count = len(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [
            with_eos_ids(p, self.eos_token_ids)
            for p in _per_prompt(sampling_params, count, "sampling_params")
        ]
        pins = _per_prompt(dp_rank, count, "dp_rank")
        # Checked before anything is routed: under torchrun an out-of-range pin would be served
        # by no rank, and a late error would leave earlier requests counted by the router.
        for pin in pins:
            if pin is not None and (
                not isinstance(pin, int)
                or isinstance(pin, bool)
                or not 0 <= pin < self.client.num_ranks
            ):
                raise ValueError(f"dp_rank must be in [0, {self.client.num_ranks}), got {pin!r}")
        # vLLM's prompt dicts may carry a cache_salt; the rank reads it from the params.
        params = [
            replace(p, cache_salt=salt) if (salt := _cache_salt(prompt)) is not None else p
            for p, prompt in zip(params, prompts, strict=True)
        ]
        params = [with_bad_words(p, self.tokenizer) for p in params]
        if any(p.structured_outputs is not None for p in params):
            params = [with_grammar(p, self._grammar_checker) for p in params]
        for param in params:
            if param.stop and self.tokenizer is None:
                raise ValueError(
                    f"stop={list(param.stop)!r}: stop strings are matched on the decoded text "
                    f"and need a tokenizer, but {self.config.tokenizer or self.config.model} "
                    "has no tokenizer.json (set `tokenizer`, or give token ids in stop_token_ids)"
                )
        # Every sample's seed, in order, whichever rank serves it (under torchrun every process
        # draws them all alike).
        return [
            self._named(
                truncated(self._tokens(prompt, add_special_tokens), cut), param, pin, prompt
            )
            for prompt, param, pin in zip(map(_unwrapped, prompts), params, pins, strict=True)
        ]

    def _tokenization(self, kwargs: dict[str, Any] | None) -> tuple[bool, tuple[int, str] | None]:
        """vLLM's `tokenization_kwargs`: (add_special_tokens, the truncation to apply)."""
        kwargs = dict(kwargs or {})
        known = {"add_special_tokens", "truncate_prompt_tokens", "truncation_side"}
        if set(kwargs) - known:
            raise ValueError(
                f"tokenization_kwargs {sorted(set(kwargs) - known)} are not supported here "
                f"(supported: {sorted(known)})"
            )
        add_special_tokens = kwargs.get("add_special_tokens", True)
        if not isinstance(add_special_tokens, bool):
            raise ValueError(f"add_special_tokens must be a bool, got {add_special_tokens!r}")
        count, side = kwargs.get("truncate_prompt_tokens"), kwargs.get("truncation_side")
        if count is None and side is None:
            return add_special_tokens, None
        return add_special_tokens, truncation(count, side, self._max_model_len)

    @cached_property
    def _max_model_len(self) -> int:
        return group_max_model_len(self.client, self.config)

    def _named(
        self, token_ids: list[int], params: SamplingParams, pin: int | None, given: Any
    ) -> _Prompt:
        """A prompt with its name and its `n` samples: each a rank request of its own, with its
        own seed (`rank_params`; `DriverSeeds` for an unseeded one)."""
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        samples = []
        for index in range(params.n):
            sample_params = rank_params(params, index)
            samples.append(
                _Sample(
                    request_id if params.n == 1 else f"{request_id}-{index}",
                    sample_params,
                    self._driver_seeds.seed_for(sample_params),
                )
            )
        text = given if isinstance(given, str) else None
        return _Prompt(request_id, token_ids, params, pin, text, tuple(samples))

    @cached_property
    def _grammar_checker(self) -> Any:
        """The tokenizer llguidance compiles `structured_outputs` against, as the server's."""
        return grammar_tokenizer(self.config.tokenizer or self.config.model, self._model_config)

    @cached_property
    def _driver_seeds(self) -> DriverSeeds:
        return DriverSeeds(self.config.seed)

    @cached_property
    def _recoveries(self) -> RecoveryBudget:
        return RecoveryBudget(self.config.parallel.max_recoveries_per_hour)

    def _run(
        self, requests: list[_Prompt], *, stream: bool, deferred: bool = False
    ) -> Iterator[tuple[int, int, RequestOutput, SampleText]]:
        """`_run_reading`, as the one reader of the group's outputs (`claim_outputs`): a second
        call while this one runs (another thread, an unfinished stream, a server over this
        LLM's group) is refused before it submits anything."""
        with reading_outputs(self.client, "LLM.generate"):
            yield from self._run_reading(requests, stream=stream, deferred=deferred)

    def _run_reading(
        self, requests: list[_Prompt], *, stream: bool, deferred: bool = False
    ) -> Iterator[tuple[int, int, RequestOutput, SampleText]]:
        """Submit every prompt's samples, then yield (prompt index, sample index, output, its
        text) until every sample has its terminal output: only those (as the front end keeps
        them, `_kept`), or, with ``stream``, every output.

        A sample with stop strings is streamed from its rank whatever the caller asked: its
        text is followed token by token (`SampleText`, as the server follows it), and once a
        stop string matched, its rank request is aborted (its blocks are freed at the rank's
        next step) and the sample ends here with finish reason "stop", its tokens through the
        one that completed the stop string. The abort's own terminal output is dropped like
        any output of a request no longer pending, and a heal does not resubmit it.

        A failed group is healed while it may be (`_may_heal`): the client re-forms it and
        every unfinished request is resubmitted (`_recover`), so the caller sees each request
        end once, with a fault-free run's tokens. Otherwise a failed rank's requests are
        yielded failed at once; the others get the collective timeout plus a margin to end on
        their own, and _GroupFailure is raised at the end."""
        ledger = ResumeLedger(self.config.parallel.poison_failure_threshold)
        where: dict[str, tuple[int, int]] = {}  # sample request id -> (prompt, sample) index
        texts: dict[str, SampleText] = {}
        submissions: list[Submission] = []
        for index, prompt in enumerate(requests):
            pin = prompt.dp_rank
            if self._torchrun:
                if not self._serves(index, prompt):
                    continue
                pin = self.client.rank
            cost = len(prompt.token_ids) + prompt.params.max_tokens
            streamed = stream or bool(prompt.params.stop)
            # A prompt's samples go to one rank, under one group key, so that it computes the
            # prompt once and they share its KV blocks (scheduler/samples.py).
            group = prompt.request_id if len(prompt.samples) > 1 else None
            for number, sample in enumerate(prompt.samples):
                rank = self.router.assign(sample.request_id, cost, pin)
                pin = rank
                where[sample.request_id] = (index, number)
                texts[sample.request_id] = SampleText.of(prompt.params, self.tokenizer)
                submissions.append(
                    ledger.add(sample.request_id, prompt.token_ids, sample.params, sample.seed,
                               streamed, rank, group, deferred=deferred and not streamed)
                )  # fmt: skip
        pending = set(where)
        failed: dict[int, str] = {}  # rank -> why (-1: the group as a whole)
        deadline = None  # once a rank failed: when the others' requests are failed too
        fault = self._submit(submissions)
        while pending:
            if fault is None and self.client.grow_ready():
                fault = self._grow()
            if fault is not None:
                ended, fault = self._recover(fault, ledger, failed)
                for output in ended:  # poison requests, ended alone
                    request_id = output.request_id
                    pending.discard(request_id)
                    self.router.finished(request_id)
                    text = texts[request_id]
                    yield *where[request_id], _kept(output, text, text.take(output)), text
                if -1 in failed:  # no group is left to end the others
                    deadline = time.monotonic()
                continue
            doomed = [r for r in pending if self.router.rank_of(r) in failed]
            if deadline is not None and time.monotonic() >= deadline:
                doomed = list(pending)  # the healthy ranks did not end them in time either
            for request_id in sorted(doomed, key=where.__getitem__):
                rank = self.router.rank_of(request_id)
                reason = failed.get(rank) or _describe(failed)
                pending.discard(request_id)
                self.router.finished(request_id)
                prompt = requests[where[request_id][0]]
                output = self._failed_output(prompt, request_id, reason, rank)
                yield *where[request_id], output, SampleText.of(prompt.params, self.tokenizer)
            if not pending:
                break
            if failed and deadline is None:
                deadline = time.monotonic() + self._failure_grace_s
            generation = self.client.generation
            try:
                outputs = self.client.poll(_POLL_S, generation=generation)
            except RankFailure as failure:
                if failure.generation == self.client.generation:
                    fault = GroupFault(str(failure), failure.rank)
                continue
            for output in outputs:
                request_id = output.request_id
                if request_id not in pending:
                    continue
                if is_group_failure(output) and self._may_heal():
                    # Its rank gave it up with the group: it is resubmitted, not ended.
                    fault = fault or GroupFault(f"DP rank {output.dp_rank}: {output.finish_reason}")
                    continue
                shown = ledger.take(output)
                if shown is None:  # a resubmitted request's delta, kept for its terminal output
                    continue
                text = texts[request_id]
                kept = _kept(shown, text, text.take(shown))
                if text.stopped and not output.finished:
                    ledger.forget(request_id)
                    fault = fault or self._abort(request_id, generation)
                if kept.finished:
                    pending.discard(request_id)
                    self.router.finished(request_id)
                if kept.finished or stream:
                    yield *where[request_id], kept, text
        if failed:
            raise _GroupFailure(failed)

    def _abort(self, request_id: str, generation: int) -> GroupFault | None:
        """Abort a request on its rank (a sample a stop string ended); the group's failure if
        the rank is gone."""
        try:
            self.client.abort(self.router.rank_of(request_id), request_id, generation=generation)
        except RankFailure as failure:
            if failure.generation == self.client.generation:
                return GroupFault(str(failure), failure.rank)
        return None

    def _submit(self, submissions: list[Submission]) -> GroupFault | None:
        """Hand each submission to its rank (the router's) in the current group; the group's
        failure if a rank is gone."""
        batches: dict[int, list[Submission]] = {}
        for submission in submissions:
            batches.setdefault(self.router.rank_of(submission.request_id), []).append(submission)
        generation = self.client.generation
        fault = None
        for rank, batch in batches.items():
            try:
                self.client.submit(rank, batch, generation=generation)
            except RankFailure as failure:
                fault = fault or GroupFault(str(failure), failure.rank)
        return fault

    def _may_heal(self) -> bool:
        """Whether a failure now heals: `on_rank_failure: heal`, a client that can re-form
        its group (Ray), and a recovery left in this hour's budget."""
        return (
            self.config.parallel.on_rank_failure != "fail"
            and self.client.can_reform
            and self._recoveries.available(time.monotonic())
        )

    def _recover(
        self, fault: GroupFault, ledger: ResumeLedger, failed: dict[int, str]
    ) -> tuple[list[RequestOutput], GroupFault | None]:
        """Heal the group after ``fault`` and resubmit the requests of the ranks it replaced
        (the kept ranks' requests go on there, a poison one aborted): returns the
        poison requests' terminal outputs and a failure of the new group's submissions, if
        any. Where it may not heal (or the new group does not start), records the failure in
        ``failed`` instead, for `_run` to fail the requests as `on_rank_failure: fail` does."""
        if not self._may_heal():
            if self.config.parallel.on_rank_failure != "fail" and self.client.can_reform:
                log.error("not healing the DP group: %s", self._recoveries.describe())
                self.client.give_up()  # the survivors end their requests now
            failed[fault.rank if fault.rank is not None else -1] = fault.reason
            return [], None
        start = time.monotonic()
        self._recoveries.spend(start)
        log.error(
            "DP group failure seen: %s; re-forming the group (%d unfinished request(s))",
            fault.reason, len(ledger),
        )  # fmt: skip
        while True:  # a new group that fails to start (a rank dies meanwhile) is tried again
            try:
                replaced = self.client.reform()
                break
            except Exception as error:
                reason = f"re-forming the DP group failed ({type(error).__name__}: {error})"
                if not self._may_heal():
                    failed[-1] = reason
                    log.error("%s; not trying again: %s", reason, self._recoveries.describe())
                    self.client.give_up()
                    return [], None
                log.error("%s; trying again", reason)
                self._recoveries.spend(time.monotonic())
        resumption = ledger.resume(fault, replaced)
        abort_fault = None
        for output in resumption.ended:
            log.error("%s", output.finish_reason)
            if output.dp_rank not in replaced:  # still held by its rank, which was kept
                abort_fault = abort_fault or self._abort(output.request_id, self.client.generation)
        self.router.set_live(self.client.live_ranks)
        for submission in resumption.submissions:  # a rank the group shrank away from: moved
            ledger.move(submission.request_id, self.router.reassign(submission.request_id))
        log.warning(
            "DP group re-formed in %.1f s (%s); "
            "%d request(s) resumed: %d from their streamed tokens, %d from their prompts",
            time.monotonic() - start, describe_reform(replaced, self.client.live_ranks),
            len(resumption.submissions), resumption.num_from_tokens,
            len(resumption.submissions) - resumption.num_from_tokens,
        )  # fmt: skip
        return resumption.ended, self._submit(resumption.submissions) or abort_fault

    def _grow(self) -> GroupFault | None:
        """Grow a group that shrank back to its full size (its replacements have loaded);
        every request stays where it is. The group's failure, if the re-form fails."""
        start = time.monotonic()
        try:
            joined = self.client.grow()
        except Exception as error:
            return GroupFault(f"growing the DP group back failed ({type(error).__name__}: {error})")
        self.router.set_live(self.client.live_ranks)
        if joined:
            log.warning(
                "DP group grew back to %d ranks in %.1f s (rank(s) %s joined)",
                len(self.client.live_ranks), time.monotonic() - start, sorted(joined),
            )  # fmt: skip
        return None

    @property
    def _failure_grace_s(self) -> float:
        """How long the healthy ranks get, after one failed, to end their own requests: their
        engines fail at the collective timeout at the latest (plus the survivors' 2 s look
        around the store)."""
        return self.config.parallel.collective_timeout_s + 10.0

    @staticmethod
    def _failed_output(
        prompt: _Prompt, request_id: str, reason: str, rank: int | None = None
    ) -> RequestOutput:
        """A sample the failed group never answered."""
        dp_rank = rank if rank is not None else (prompt.dp_rank or 0)
        return RequestOutput.failed(
            request_id,
            list(prompt.token_ids),
            reason,
            dp_rank,
            arrival_time=0.0,
            error_kind=ErrorKind.GROUP_FAILED,
        )

    def _tokens(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"text prompts need {self.config.model}/tokenizer.json; pass token ids"
                )
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def _replayed(self, prompt: _Prompt, output: RequestOutput) -> _Ended:
        """A sample another torchrun rank ended (its kept tokens, `_exchanged`), with its
        text: following the same tokens again gives the text the serving rank had (a stop
        string matches at the same token)."""
        text = SampleText.of(prompt.params, self.tokenizer)
        text.take(output)
        return output, text

    def _completion(self, prompt: _Prompt, samples: list[tuple[int, _Ended]]) -> Completion:
        """The prompt's result: one `CompletionOutput` per sample, and the first sample's
        `RequestOutput` fields under the prompt's request id."""
        completions = [
            self._completion_output(index, output, text, prompt.params)
            for index, (output, text) in samples
        ]
        first, _ = samples[0][1]
        values = {f.name: getattr(first, f.name) for f in fields(RequestOutput)}
        values["request_id"] = prompt.request_id
        return Completion(
            **values, text=completions[0].text, prompt=prompt.text, outputs=completions
        )

    def _completion_output(
        self, index: int, output: RequestOutput, text: SampleText, params: SamplingParams
    ) -> CompletionOutput:
        logprobs = cumulative = None
        if params.logprobs is not None and len(text.logprobs) == len(output.output_token_ids):
            logprobs = [self._vllm_logprobs(entry) for entry in text.logprobs]
            cumulative = sum(entry.logprob for entry in text.logprobs)
        return CompletionOutput(
            index=index,
            # Bytes of a character that never completed at the end are left out, as the
            # server's text (and vLLM's) leaves them out.
            # detokenize=False: token ids only, the text empty (vLLM's).
            text=(
                None
                if self.tokenizer is None or not output.finished
                else text.text
                if params.detokenize
                else ""
            ),
            token_ids=list(output.output_token_ids),
            finish_reason=output.finish_reason,
            cumulative_logprob=cumulative,
            logprobs=logprobs,
        )

    def _vllm_logprobs(self, entry: TokenLogprob) -> dict[int, Logprob]:
        """One position's logprobs in vLLM's shape: the sampled token first, then the most
        likely ones (as many as asked), each with its rank and its text."""

        def decoded(token_id: int) -> str | None:
            if self.tokenizer is None:
                return None
            return self.tokenizer.decode([token_id], skip_special_tokens=False)

        position = {entry.token_id: Logprob(entry.logprob, entry.rank, decoded(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            if token_id not in position:
                position[token_id] = Logprob(logprob, rank, decoded(token_id))
        return position

    # -- lifetime ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            if self._at_exit is not None:
                self._at_exit()  # runs client.shutdown once, and no more at exit
            else:
                self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _kept(output: RequestOutput, text: SampleText, piece: Piece) -> RequestOutput:
    """A sample's output as the front end keeps it (``piece``: what it added to ``text``):
    the tokens through the one that completed a stop string, and, once one matched,
    finished with finish reason "stop" (its rank request is being aborted)."""
    changes: dict[str, Any] = {}
    if len(text.token_ids) != len(output.output_token_ids):
        changes.update(output_token_ids=list(text.token_ids), new_token_ids=piece.token_ids)
        if output.new_logprobs is not None:
            changes["new_logprobs"] = piece.logprobs or []
    if text.stopped:
        changes.update(finished=True, finish_reason="stop", detail=None, error_kind=None)
        changes.setdefault("output_token_ids", list(output.output_token_ids))  # a list once ended
    return replace(output, **changes) if changes else output


def _whole(output: RequestOutput, text: SampleText) -> RequestOutput:
    """A sample's terminal output for a caller that did not stream: every token new (a
    sample with stop strings was streamed from its rank, so its last output has the last
    tokens only), with all their logprobs."""
    if output.new_token_ids == output.output_token_ids:
        return output
    whole: dict[str, Any] = {"new_token_ids": list(output.output_token_ids)}
    if output.new_logprobs is not None:
        whole["new_logprobs"] = list(text.logprobs)
    return replace(output, **whole)


def _exchanged(
    requests: list[_Prompt], ended: dict[int, dict[int, _Ended]]
) -> dict[int, RequestOutput]:
    """What this torchrun rank hands the others: each sample it ended (`_whole`, so that
    `LLM._replayed` follows the same tokens), keyed by its position among all prompts'
    samples in order."""
    mine: dict[int, RequestOutput] = {}
    position = 0
    for index, prompt in enumerate(requests):
        for sample, (output, _) in ended.get(index, {}).items():
            mine[position + sample] = output
        position += len(prompt.samples)
    return mine


def started_by_torchrun() -> bool:
    """Whether torchrun (torch.distributed.run) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "LOCAL_RANK"} <= set(os.environ)


def check_gpu_memory_utilization(config: EngineConfig, client: Client | None = None) -> None:
    """vLLM's `gpu_memory_utilization`: the engine sizes its KV pool by `scheduler.num_blocks`
    or `kv_cache_bytes`, and cannot size it from free GPU memory. So the setting is refused for
    a group on GPUs (ValueError saying what to give instead) and logged as not applying to a
    CPU group. Called before the group starts, with what this host can tell, and again with
    ``client`` once a Ray group has started (Ray gave it GPUs if the cluster has them)."""
    value = config.gpu_memory_utilization
    if value is None:
        return
    if _group_on_gpus(config, client):
        raise ValueError(
            f"gpu_memory_utilization {value}: Lockstep cannot size the KV pool from free GPU "
            "memory; give kv_cache_bytes (--kv-cache-memory-bytes) or scheduler.num_blocks "
            "instead, and leave gpu_memory_utilization unset"
        )
    if client is None:
        log.warning(
            "gpu_memory_utilization %s does not apply: the group runs on CPUs, and its KV pool "
            "is sized by scheduler.num_blocks or kv_cache_bytes",
            value,
        )


def check_cuda_graphs(config: EngineConfig) -> None:
    """`cuda_graphs: on` where graphs cannot run is refused before the group starts, with the
    ranks' own reason (`decode_graphs.graphs_refusal`), rather than from a rank after its
    model loaded. Only what the driver knows for certain: the group's size, EPLB, and a group
    that runs on CPUs (a local one, or gloo); whether Ray's ranks get GPUs the ranks decide."""
    if config.cuda_graphs != "on":
        return
    from dist_engine.engine.decode_graphs import graphs_refusal

    parallel = config.parallel
    on_cpus = parallel.launcher == "local" or parallel.backend == "gloo"
    refusal = graphs_refusal("cpu" if on_cpus else "cuda", parallel.dp_size, config.moe.enable_eplb)
    if refusal is not None:
        raise ValueError(f"cuda_graphs is 'on', but {refusal}; set it to auto or off")


def _group_on_gpus(config: EngineConfig, client: Client | None) -> bool:
    """Whether the group's ranks run on GPUs, as the launchers decide it (the MoE backend
    resolves to nccl where CUDA is available; a local group of one runs on the CPU)."""
    parallel = config.parallel
    if parallel.launcher == "local" or parallel.backend == "gloo":
        return False
    if parallel.backend == "nccl":
        return True
    if client is not None and parallel.launcher == "ray":
        import ray

        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def _dp_size(data_parallel_size: int | None, dp_size: int | None) -> int | None:
    if None not in (data_parallel_size, dp_size) and data_parallel_size != dp_size:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} and dp_size={dp_size} name the same "
            "setting (parallel.dp_size); give one"
        )
    return data_parallel_size if data_parallel_size is not None else dp_size


def _build_config(model, config, dp_size, launcher, dtype, overrides) -> EngineConfig:
    if isinstance(config, (str, Path)):
        config = EngineConfig.from_yaml(config)
    if config is None:
        if model is None:
            raise ValueError("LLM needs model=DIR or config=EngineConfig|path.yaml")
        config = EngineConfig(model=str(model))
    elif model is not None:
        overrides = {"model": str(model), **overrides}
    named = {"dp_size": dp_size, "launcher": launcher, "dtype": dtype}
    overrides = {VLLM_KEYWORDS.get(k, k): v for k, v in overrides.items()}
    overrides = {**{k: v for k, v in named.items() if v is not None}, **overrides}
    return config.with_overrides(**overrides) if overrides else config


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


def _check_neutral(lora_request: Any, priority: Any, mm_processor_kwargs: Any) -> None:
    """vLLM's `generate` keywords this engine has nothing behind: only their neutral values."""
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported here; leave it None")
    priorities = [priority] if isinstance(priority, int) else list(priority or [])
    if any(p != 0 for p in priorities):
        raise ValueError(
            f"priority {priority!r}: the scheduler has no priority policy (vLLM refuses "
            "priorities without one too); leave it unset or 0"
        )
    if mm_processor_kwargs:
        raise ValueError("mm_processor_kwargs: there are no multi-modal inputs here")


def _prompt_list(prompts: Any) -> list[Any]:
    """`generate`'s prompts as a list, taken as vLLM takes them: a list of prompts, or one
    prompt (a string, a list of token ids, a `{"prompt": text}` or
    `{"prompt_token_ids": ids}` dict)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise ValueError(
            "prompts must be a prompt or a list of them: strings, token-id lists, or "
            f'{{"prompt": text}} / {{"prompt_token_ids": ids}} dicts; got {type(prompts).__name__}'
        )
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]  # one prompt's token ids
    return list(prompts)


def _cache_salt(prompt: Any) -> str | None:
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


def _unwrapped(prompt: Any) -> str | Sequence[int]:
    """A prompt's text or token ids (vLLM's TextPrompt / TokensPrompt dicts unwrapped; their
    `cache_salt` is read apart, `_cache_salt`)."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt) - {"cache_salt"}
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], Sequence):
        return prompt["prompt_token_ids"]
    raise ValueError(
        f'a dict prompt takes "prompt" (text) or "prompt_token_ids", and "cache_salt"; got '
        f"keys {sorted(prompt)} (no multi-modal data or embeddings here)"
    )


def _load_tokenizer(directory: str) -> ModelTokenizer | None:
    """The tokenizer of ``directory`` (the server's kind), or None if it has no tokenizer
    files; ValueError naming the package a SentencePiece-only tokenizer needs."""
    return ModelTokenizer.load(directory)


@contextlib.contextmanager
def group_loading(config: EngineConfig) -> Iterator[None]:
    """One line on the driver as the group starts and loads the model, one when it is up
    (each rank logs its own progress over its shards, models/loader.py)."""
    num_bytes = sum(path.stat().st_size for path in Path(config.model).glob("*.safetensors"))
    size = f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
    source = config.model if config.hub_id is None else f"{config.hub_id} at {config.revision}"
    log.info(
        "starting %d DP rank(s), loading %s (%s of safetensors; each rank reads its share)",
        config.parallel.dp_size,
        source,
        size,
    )
    start = time.monotonic()
    yield
    log.info("the DP group is up: loaded in %.1f s", time.monotonic() - start)
