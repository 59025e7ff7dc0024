"""The offline API: ``LLM(...).generate(prompts, params)`` over a DP group of engines.

    with LLM(model=DIR, dp_size=2, launcher="ray", dtype="float32") as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=32))

Prompts are token-id lists, or strings when the model directory has a tokenizer.json. Each
output carries ``request_id``, ``prompt_token_ids``, ``output_token_ids``, ``text``,
``finish_reason`` and ``dp_rank``. If a rank dies, ``generate`` raises ``LockstepError`` naming
it; the error's ``outputs`` hold every request's result, the unfinished ones failed.
"""

from __future__ import annotations

import itertools
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.outputs import RequestOutput
from dist_engine.errors import LockstepError
from launcher.clients import LocalClient, RankFailure, Submission
from launcher.routing import Router
from scheduler import SamplingParams

_POLL_S = 0.02


@dataclass(frozen=True)
class Completion(RequestOutput):
    """A rank's ``RequestOutput`` plus the output decoded to text (when there is a tokenizer)."""

    text: str | None = None


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        config: EngineConfig | str | Path | None = None,
        dp_size: int | None = None,
        launcher: str | None = None,
        dtype: str | None = None,
        routing: str = "round_robin",
        **overrides: Any,
    ) -> None:
        self.config = _build_config(model, config, dp_size, launcher, dtype, overrides)
        self.tokenizer = _load_tokenizer(self.config.model)
        launcher_name = self.config.parallel.launcher
        if launcher_name == "ray":
            from launcher.ray_launcher import RayClient

            self.client = RayClient(self.config)
        elif launcher_name == "torchrun":
            from launcher.torchrun_launcher import TorchrunClient

            self.client = TorchrunClient(self.config)
        else:
            self.client = LocalClient(self.config)
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
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        dp_rank: int | Sequence[int | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[Completion]:
        """Run every prompt to its end; results in input order."""
        requests = self._prepare(prompts, sampling_params, dp_rank)
        finals: dict[int, RequestOutput] = {}
        total = len(requests)
        if self._torchrun:  # each process serves its share; only rank 0 shows progress
            use_tqdm = use_tqdm and self.client.rank == 0
            total = sum(1 for index, request in enumerate(requests) if self._serves(index, request))
        with tqdm(total=total, disable=not use_tqdm, desc="generate") as progress:
            for index, output in self._run(requests, stream=False):
                finals[index] = output
                progress.update(1)
        if self._torchrun:
            finals = self.client.exchange(finals)
        return [self._completion(finals[i]) for i in range(len(requests))]

    def generate_stream(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        dp_rank: int | Sequence[int | None] | None = None,
    ) -> Iterator[Completion]:
        """Yield each request's new tokens as they come; its last item has ``finished``."""
        if self._torchrun:
            raise ValueError("generate_stream is not available under torchrun; use generate")
        requests = self._prepare(prompts, sampling_params, dp_rank)
        for _, output in self._run(requests, stream=True):
            yield self._completion(output)

    def _serves(self, index: int, request: tuple) -> bool:
        """Under torchrun: whether this process's rank serves prompt ``index``."""
        pin = request[3]
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

    @property
    def _torchrun(self) -> bool:
        return self.config.parallel.launcher == "torchrun"

    def _prepare(self, prompts, sampling_params, dp_rank) -> list[tuple[str, list[int], Any, Any]]:
        if self.closed:
            raise LockstepError("this LLM is shut down; start a new one")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of strings or of token-id lists")
        count = len(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), count, "sampling_params")
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
        return [
            (f"{self._id_prefix}-{next(self._ids)}", self._tokens(prompt), param, pin)
            for prompt, param, pin in zip(prompts, params, pins, strict=True)
        ]

    def _run(self, requests, *, stream: bool) -> Iterator[tuple[int, RequestOutput]]:
        index_of = {}
        batches: dict[int, list[Submission]] = {}
        for index, (request_id, tokens, params, pin) in enumerate(requests):
            if self._torchrun:
                if not self._serves(index, requests[index]):
                    continue
                pin = self.client.rank
            cost = len(tokens) + params.max_tokens
            rank = self.router.assign(request_id, cost, pin)
            index_of[request_id] = index
            batches.setdefault(rank, []).append((request_id, tokens, params, stream))
        pending = set(index_of)
        try:
            for rank, batch in batches.items():
                self.client.submit(rank, batch)
            while pending:
                for output in self.client.poll(_POLL_S):
                    if output.request_id not in pending:
                        continue
                    if output.finished:
                        pending.discard(output.request_id)
                        self.router.finished(output.request_id)
                    if output.finished or stream:
                        yield index_of[output.request_id], output
        except RankFailure as failure:
            self._fail(failure, requests, pending, index_of)

    def _fail(self, failure: RankFailure, requests, pending, index_of) -> None:
        reason = f"error: {failure}"
        failed = [
            RequestOutput(
                request_id=request_id,
                prompt_token_ids=requests[index_of[request_id]][1],
                output_token_ids=[],
                new_token_ids=[],
                finished=True,
                finish_reason=reason,
                dp_rank=self.router.rank_of(request_id) or 0,
                arrival_time=0.0,
            )
            for request_id in pending
        ]
        self.shutdown()
        error = LockstepError(f"the DP group failed: {failure}")
        error.failed_rank = failure.rank  # type: ignore[attr-defined]
        error.outputs = [self._completion(o) for o in failed]  # type: ignore[attr-defined]
        raise error from failure

    def _tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"text prompts need {self.config.model}/tokenizer.json; pass token ids"
                )
            return self.tokenizer.encode(prompt).ids
        return list(prompt)

    def _completion(self, output: RequestOutput) -> Completion:
        text = None
        if self.tokenizer is not None and output.finished:
            text = self.tokenizer.decode(output.output_token_ids)
        values = {f.name: getattr(output, f.name) for f in fields(RequestOutput)}
        return Completion(**values, text=text)

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
    overrides = {**{k: v for k, v in named.items() if v is not None}, **overrides}
    return config.with_overrides(**overrides) if overrides else config


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


def _load_tokenizer(model_dir: str) -> Any:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
