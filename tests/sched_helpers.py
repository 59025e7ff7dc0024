"""Helpers for scheduler tests: a deterministic stand-in for the model's sampled token.

``fake_token`` depends only on a sequence's committed tokens, as greedy decoding of a real model
does, so any scheduling that is correct yields the same tokens for every request.
"""

from __future__ import annotations

from scheduler import SamplingParams, Scheduler, SchedulerConfig, SchedulerOutputs, Sequence

VOCAB = 1000


def fake_token(seq: Sequence) -> int:
    tokens = seq.token_ids
    return (sum(tokens[-3:]) * 31 + len(tokens) * 7) % VOCAB


def make_scheduler(vote=None, **overrides) -> Scheduler:
    settings = dict(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=512,
        block_size=4,
        num_blocks=257,
    )
    settings.update(overrides)
    return Scheduler(SchedulerConfig(**settings), vote=vote)


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 8, **kwargs) -> Sequence:
    base = sum(map(ord, request_id))
    prompt = [(base + 13 * i) % VOCAB for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(request_id, prompt, params, **kwargs)


def prompt_part(outputs: SchedulerOutputs) -> list[Sequence]:
    """The prompt chunks of a prefill step (a mixed step lists its decode tokens after them)."""
    return outputs.scheduled_seqs[: outputs.num_seqs - outputs.num_decode_seqs]


def run_step(sched: Scheduler) -> tuple[SchedulerOutputs, list[Sequence]]:
    outputs = sched.schedule()
    sampled = [fake_token(seq) for seq in outputs.scheduled_seqs]
    finished = sched.process_outputs(outputs, sampled)
    return outputs, finished


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> dict[str, Sequence]:
    """Run until nothing is left; returns every reported sequence by id (each exactly once)."""
    reported: dict[str, Sequence] = {}

    def report(seq: Sequence) -> None:
        assert seq.request_id not in reported, f"{seq.request_id} reported twice"
        assert seq.is_finished
        reported[seq.request_id] = seq

    for _ in range(max_steps):
        outputs, finished = run_step(sched)
        for seq in [*outputs.ignored_seqs, *finished]:
            report(seq)
        sched.check_integrity()
        if sched.num_unfinished == 0:
            outputs, _ = run_step(sched)  # flush sequences ended at arrival
            for seq in outputs.ignored_seqs:
                report(seq)
            return reported
    raise AssertionError(f"not finished after {max_steps} steps")
