import math

import pytest

from radixserve import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("n", 0),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("min_tokens", 100),
        ("seed", 1.5),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_string_becomes_list_and_empty_stop_rejected():
    assert SamplingParams(stop="###").stop == ["###"]
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])


def test_vocab_checks():
    params = SamplingParams(logit_bias={5: 1.0}, stop_token_ids=[7])
    params.check_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={50: 1.0}).check_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).check_vocab(10)
