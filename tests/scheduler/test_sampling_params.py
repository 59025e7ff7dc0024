import re

import pytest

from scheduler import SamplingParams


def test_defaults_are_greedy():
    params = SamplingParams()
    assert params.greedy and params.max_tokens == 16 and params.stop_token_ids == frozenset()


def test_vllm_fields_default_to_vllms_values_and_disable_themselves():
    params = SamplingParams()
    assert (params.min_p, params.min_tokens) == (0.0, 0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert params.logit_bias is None and params.logprobs is None and params.prompt_logprobs is None
    assert not params.uses_penalties


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty", "repetition_penalty"])
def test_any_penalty_means_the_token_history_is_needed(field):
    assert SamplingParams(**{field: 1.5}).uses_penalties


def test_front_end_fields_default_to_one_sample_and_no_stop_strings():
    params = SamplingParams()
    assert (params.n, params.stop, params.include_stop_str_in_output) == (1, (), False)
    # A string or a list becomes a tuple, so params stay hashable and compare by value.
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "bc"]) == SamplingParams(stop=("a", "bc"))
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop="a"))


def test_stop_ids_become_a_frozenset():
    assert SamplingParams(stop_token_ids=[3, 3, 5]).stop_token_ids == frozenset({3, 5})


def test_logit_bias_is_a_private_copy_of_floats_and_params_stay_hashable():
    bias = {7: 1, 3: -2.5}
    params = SamplingParams(logit_bias=bias)
    bias[7] = 99.0
    assert params.logit_bias == {7: 1.0, 3: -2.5}
    assert all(isinstance(value, float) for value in params.logit_bias.values())
    assert hash(params) == hash(SamplingParams(logit_bias={7: 1.0}))  # bias is left out of it
    assert params == SamplingParams(logit_bias={3: -2.5, 7: 1.0})
    assert params != SamplingParams(logit_bias={7: 1.0})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": -2.0, "frequency_penalty": 2},
        {"repetition_penalty": 0.01},
        {"repetition_penalty": 100},
        {"min_p": 1.0},
        {"min_tokens": 16},
        {"logit_bias": {0: -100, 2**40: 100.0}},
        {"logprobs": -1, "prompt_logprobs": 0},
        {"logprobs": 20, "prompt_logprobs": -1},
    ],
)
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 2.5}, "max_tokens must be an int"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 10**400}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"seed": "7"}, "seed must be an int in [0, 2**64 - 1] or None"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids must be ints >= 0"),
        ({"stop_token_ids": "abc"}, "stop_token_ids must be a collection of ints"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
        ({"min_p": 1.5}, "min_p must be in [0, 1] (0 disables it), got 1.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1] (0 disables it), got -0.1"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2] (0 disables it), got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2] (0 disables it), got -3"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty must be in [-2, 2]"),
        ({"presence_penalty": True}, "presence_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in [0.01, 100] (1 disables it)"),
        ({"repetition_penalty": -1.2}, "repetition_penalty must be in [0.01, 100]"),
        (
            {"repetition_penalty": 1e3},
            "repetition_penalty must be in [0.01, 100] (1 disables it), got 1000.0",
        ),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be in [0.01, 100]"),
        ({"min_tokens": -1}, "min_tokens must be an int in [0, max_tokens=16], got -1"),
        ({"min_tokens": 17}, "min_tokens must be an int in [0, max_tokens=16], got 17"),
        ({"min_tokens": 2.0}, "min_tokens must be an int in [0, max_tokens=16], got 2.0"),
        ({"logit_bias": [(1, 2.0)]}, "logit_bias must be a dict of token id -> bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids (ints >= 0), got '5'"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias keys must be token ids (ints >= 0), got -3"),
        ({"logit_bias": {True: 1.0}}, "logit_bias keys must be token ids (ints >= 0), got True"),
        (
            {"logit_bias": {4: 100.5}},
            "logit_bias values must be in [-100, 100], got 100.5 for token 4",
        ),
        ({"logit_bias": {4: float("nan")}}, "logit_bias values must be in [-100, 100], got nan"),
        ({"logit_bias": {4: "1"}}, "logit_bias values must be in [-100, 100], got '1'"),
        (
            {"logprobs": -2},
            "logprobs must be None, an int >= 0 or -1 (the whole vocabulary), got -2",
        ),
        ({"logprobs": 1.0}, "logprobs must be None, an int >= 0 or -1"),
        ({"logprobs": True}, "logprobs must be None, an int >= 0 or -1"),
        ({"prompt_logprobs": -3}, "prompt_logprobs must be None, an int >= 0 or -1"),
        ({"n": 0}, "n must be an int >= 1 (samples per prompt), got 0"),
        ({"n": 2.0}, "n must be an int >= 1 (samples per prompt), got 2.0"),
        ({"n": True}, "n must be an int >= 1"),
        ({"stop": ""}, "stop must be a non-empty string or a list of them"),
        ({"stop": ["ok", ""]}, "stop must be a non-empty string or a list of them"),
        ({"stop": [7]}, "(token ids go in stop_token_ids), got [7]"),
        ({"stop": {"a"}}, "stop must be a non-empty string or a list of them"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool, got 1"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a bool, got None"),
        ({"detokenize": 0}, "detokenize must be a bool, got 0"),
        ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens must be a bool"),
        ({"detokenize": False, "stop": "x"}, "stop=['x'] needs detokenize=True"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list of token ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids must be a non-empty list of token ids"),
        ({"allowed_token_ids": [1, -1]}, "allowed_token_ids must hold token ids (ints >= 0)"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids must hold token ids"),
        ({"bad_words": "word"}, "bad_words must be a list of strings, got 'word'"),
        ({"bad_words": ["ok", " "]}, "bad_words must be non-blank strings"),
        ({"bad_words": [3]}, "bad_words must be non-blank strings"),
        ({"bad_words": ["w"] * 129}, "bad_words holds 129 words; at most 128"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids must be a non-empty list of token"),
        ({"bad_words_token_ids": [5]}, "bad_words_token_ids must be a non-empty list of token"),
        ({"bad_words_token_ids": "ab"}, "bad_words_token_ids must be a list of token id lists"),
        ({"bad_words_token_ids": [[1]] * 129}, "bad_words_token_ids holds 129 sequences; at most"),
        ({"bad_words_token_ids": [[1] * 65]}, "a bad word's token ids are at most 64, got one"),
    ],
)
def test_bad_values_name_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_vllms_token_filters_and_text_fields_default_off_and_stay_hashable():
    params = SamplingParams()
    assert params.allowed_token_ids is None and params.bad_words == ()
    assert params.bad_words_token_ids == () and not params.reads_output
    assert params.detokenize and params.skip_special_tokens and params.spaces_between_special_tokens
    given = SamplingParams(allowed_token_ids=[4, 2, 4], bad_words=["a b"],
                           bad_words_token_ids=[[1, 2], (3,)])  # fmt: skip
    assert given.allowed_token_ids == (4, 2) and given.bad_words == ("a b",)
    assert given.bad_words_token_ids == ((1, 2), (3,)) and given.reads_output
    same = SamplingParams(allowed_token_ids=(4, 2, 4), bad_words=("a b",),
                          bad_words_token_ids=((1, 2), [3]))  # fmt: skip
    assert given == same and hash(given) == hash(same)
    assert SamplingParams(bad_words=None).bad_words == ()


def test_bad_words_resolve_to_their_bare_and_spaced_encodings():
    from scheduler.sampling_params import resolve_bad_words

    # A stand-in encoder: a leading space changes a word's first token, as BPE tokenizers do.
    vocab = {"bad": 1, " bad": 2, "two": 3, "words": 4, " two": 5, "x": 6}

    def encode(text: str) -> list[int]:
        pieces = text.replace(" words", "|words").split("|") if "two" in text else [text]
        return [vocab[p] for p in pieces if p]

    assert resolve_bad_words(("bad", " bad"), encode) == ((1,), (2,))
    assert resolve_bad_words(("two words",), encode) == ((3, 4), (5, 4))
    with pytest.raises(ValueError, match="bad_words entry 'y' encodes to no token"):
        resolve_bad_words(("y",), lambda text: [])
