"""A DP group's outputs have one reader at a time (`launcher.clients.claim_outputs`).

A client hands each output to whoever polls first. Two readers of one group (two `generate`
calls at once, a `generate` beside an unfinished `generate_stream`, a `LockstepServer` over an
LLM's group) would each take and drop outputs of the other's requests and wait for them
forever; the second is refused before it submits anything, naming the first.
"""

from __future__ import annotations

import threading

import pytest
from server_harness import ServerThread

from dist_engine.engine.config import EngineConfig
from dist_engine.errors import LockstepError
from launcher import LLM, SamplingParams
from launcher.clients import claim_outputs, release_outputs
from launcher.server.config import ServerConfig

SETTINGS = {"launcher": "local", "dtype": "float64", "threads_per_rank": 1, "max_num_seqs": 8}
SETTINGS.update(max_model_len=128, num_blocks=128, block_size=8)
PROMPTS = [[5, 17, 42, 99], [4, 5, 6]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_a_second_reader_is_refused_and_the_first_goes_on(model_dir) -> None:
    with LLM(model_dir, **SETTINGS) as llm:
        reference = tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        stream = llm.generate_stream(PROMPTS, PARAMS)
        first = next(stream)
        with pytest.raises(
            LockstepError, match=r"LLM\.generate cannot read .* while LLM\.generate"
        ):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        # From another thread too (LLM is not thread-safe; this says so instead of hanging).
        errors: list[BaseException] = []

        def other() -> None:
            try:
                llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(60)
        assert not thread.is_alive() and isinstance(errors[0], LockstepError)
        # The refused calls submitted nothing: the stream ends with its own tokens.
        items = [first, *stream]
        finals = [item for item in items if item.finished]
        assert sorted(item.outputs[0].token_ids for item in finals) == sorted(reference)
        # Once the stream is done, generate reads again.
        assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference


def test_a_closed_stream_frees_the_outputs(model_dir) -> None:
    with LLM(model_dir, **SETTINGS) as llm:
        stream = llm.generate_stream(PROMPTS, PARAMS)
        next(stream)
        stream.close()
        assert len(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == len(PROMPTS)


def test_a_server_holds_its_groups_outputs_until_it_stops(model_dir) -> None:
    engine = EngineConfig(model=model_dir).with_overrides(**SETTINGS)
    server = ServerThread(engine, ServerConfig(port=0))
    try:
        with pytest.raises(LockstepError, match="while a LockstepServer reads them"):
            claim_outputs(server.client, "LLM.generate")
    finally:
        server.stop()
    claim_outputs(server.client, "LLM.generate")  # released when the server stopped
    release_outputs(server.client, "LLM.generate")
