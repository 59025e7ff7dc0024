import pytest

from scheduler import SamplingParams


def test_defaults_are_greedy():
    params = SamplingParams()
    assert params.greedy and params.max_tokens == 16 and params.stop_token_ids == frozenset()


def test_stop_ids_become_a_frozenset():
    assert SamplingParams(stop_token_ids=[3, 3, 5]).stop_token_ids == frozenset({3, 5})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 2.5}, "max_tokens must be an int"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"seed": "7"}, "seed must be an int in [0, 2**64 - 1] or None"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids must be ints >= 0"),
        ({"stop_token_ids": "abc"}, "stop_token_ids must be a collection of ints"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ],
)
def test_bad_values_name_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=pytest.importorskip("re").escape(message)):
        SamplingParams(**kwargs)
