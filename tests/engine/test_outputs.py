"""A running stream's outputs carry every token so far without copying them each step
(`TokenSlice`, dist_engine/engine/outputs.py): they read as the lists they stand for, stay
as they were made while the sequence grows, and a finished request's output is a list."""

from __future__ import annotations

import json
import pickle

import pytest

from dist_engine.engine.outputs import RequestOutput, TokenSlice, output_to_plain
from dist_engine.engine.request import Request
from scheduler import SamplingParams, Sequence, SequenceStatus


def test_a_slice_reads_as_the_list_it_stands_for():
    tokens = [10, 11, 12, 13, 14]
    view = TokenSlice(tokens, 1, 4)
    expected = [11, 12, 13]
    assert len(view) == 3 and list(view) == expected and tuple(view) == (11, 12, 13)
    assert [view[0], view[2], view[-1], view[-3]] == [11, 13, 13, 11]
    for bad in (3, -4):
        with pytest.raises(IndexError):
            view[bad]
    assert view[1:] == [12, 13] and type(view[1:]) is list and view[::-1] == [13, 12, 11]
    assert view == expected and expected == view and view == (11, 12, 13)
    assert view != [11, 12] and view != [11, 12, 14] and view != "abc"
    assert view == TokenSlice([0, 11, 12, 13], 1, 4) and view != TokenSlice(tokens, 0, 3)
    assert 12 in view and 14 not in view and view.index(13) == 2 and view.count(11) == 1
    assert view + [1] == [11, 12, 13, 1] and [1] + view == [1, 11, 12, 13]
    assert repr(view) == "[11, 12, 13]"
    with pytest.raises(TypeError):
        hash(view)
    tokens.append(15)  # the list grows: the slice is what it was
    assert list(view) == expected and len(view) == 3
    copied = pickle.loads(pickle.dumps(view))
    assert isinstance(copied, TokenSlice) and copied == expected
    empty = TokenSlice(tokens, 6, 6)
    assert len(empty) == 0 and list(empty) == [] and empty == []


def _running(prompt: list[int], outputs: list[int]) -> Request:
    seq = Sequence("r", prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    request = Request.admit(seq, stream=True)
    seq.token_ids.extend(outputs)  # as the scheduler commits them
    seq.num_output_tokens = len(outputs)
    seq.status = SequenceStatus.RUNNING
    return request


def test_a_running_streams_output_is_a_fixed_slice_and_a_finished_ones_a_list():
    request = _running([1, 2, 3], [7, 8])
    seq = request.seq
    first = request.delta(0)
    assert isinstance(first.output_token_ids, TokenSlice)
    assert first.output_token_ids == [7, 8] and first.new_token_ids == [7, 8]
    assert first.prompt_token_ids == [1, 2, 3]
    seq.token_ids.append(9)
    seq.num_output_tokens += 1
    second = request.delta(0)
    assert second.output_token_ids == [7, 8, 9] and second.new_token_ids == [9]
    assert first.output_token_ids == [7, 8]  # unchanged by the token after it
    assert request.delta(0) is None  # nothing new
    seq.token_ids.append(6)
    seq.num_output_tokens += 1
    seq.status = SequenceStatus.LENGTH_CAPPED
    last = request.terminal(0)
    assert type(last.output_token_ids) is list and last.output_token_ids == [7, 8, 9, 6]
    assert last.new_token_ids == [6] and last.finished
    plain = json.loads(json.dumps(output_to_plain(second)))  # a slice goes as a list
    assert plain["output_token_ids"] == [7, 8, 9]
    assert RequestOutput(**{**plain, "error_kind": None}) == second
