"""The count task: prompts, verifiable rewards, and the long tail of target lengths."""

import random
import statistics

import pytest

from dora.runtime.tasks import (
    BOS,
    EOS,
    FIRST_NUMBER_TOKEN,
    SEP,
    TaskConfig,
    make_prompt,
    make_prompts,
    score,
    warmup_examples,
)
from planner.workload import LengthDistribution

LOCAL = LengthDistribution.lognormal(median=8, p99=80, max_tokens=128)


def test_prompt_and_target_spell_the_count() -> None:
    task = TaskConfig()
    for p in make_prompts(task, LOCAL, random.Random(0), 200):
        bos, a, b, sep = p.prompt_ids
        assert (bos, sep) == (BOS, SEP) and FIRST_NUMBER_TOKEN <= a <= b < task.vocab_size
        assert p.target_ids == (*range(a, b + 1), EOS)
        assert 2 <= len(p.target_ids) <= 128


def test_prompts_are_deterministic_given_the_seed() -> None:
    task = TaskConfig()
    assert make_prompts(task, LOCAL, random.Random(7), 50) == make_prompts(task, LOCAL, random.Random(7), 50)
    assert make_prompts(task, LOCAL, random.Random(7), 50) != make_prompts(task, LOCAL, random.Random(8), 50)


def test_target_lengths_follow_the_long_tailed_distribution() -> None:
    lengths = [len(p.target_ids) for p in make_prompts(TaskConfig(), LOCAL, random.Random(1), 5000)]
    median = statistics.median(lengths)
    p99 = sorted(lengths)[int(0.99 * len(lengths))]
    assert 7 <= median <= 9
    assert p99 / median >= 9.0, (median, p99)
    assert max(lengths) == 128  # the cap is reached: truncated lognormal mass lands on max_tokens


def test_score_exact_prefix_and_overrun() -> None:
    p = make_prompt(TaskConfig(), LengthDistribution.lognormal(median=5, p99=5, max_tokens=8), random.Random(0), "x")
    target = p.target_ids
    assert len(target) == 5
    assert score(p, target) == 1.0 and p.max_new_tokens == 5
    assert score(p, target[:3]) == pytest.approx(3 / 5)  # cut by the budget before EOS, 3 correct
    assert score(p, (*target[:2], EOS)) == pytest.approx(2 / 5)  # EOS too soon
    overrun = (*target[:-1], target[-2] + 1, target[-2] + 2, EOS)
    assert score(p, overrun) == pytest.approx(4 / 7)  # kept counting (no budget): the extra tokens cost
    assert score(p, ()) == 0.0
    assert score(p, (BOS,) + target) == 0.0


def test_short_lengths_are_raised_to_one_number_and_capped_by_the_vocabulary() -> None:
    tiny = TaskConfig(number_tokens=10)
    ones = LengthDistribution.lognormal(median=1, p99=1, max_tokens=4)
    p = make_prompt(tiny, ones, random.Random(0), "a")
    assert len(p.target_ids) == 2 and p.prompt_ids[1] == p.prompt_ids[2]
    long = LengthDistribution.lognormal(median=50, p99=50, max_tokens=64)
    q = make_prompt(tiny, long, random.Random(0), "b")
    assert q.target_ids == (*range(FIRST_NUMBER_TOKEN, FIRST_NUMBER_TOKEN + 10), EOS)


def test_warmup_examples_are_correct_answers() -> None:
    task = TaskConfig()
    for prompt_ids, response in warmup_examples(task, LOCAL, random.Random(3), 20):
        assert response == (*range(prompt_ids[1], prompt_ids[2] + 1), EOS)


def test_config_validation_names_the_field() -> None:
    assert TaskConfig().vocab_size == 192 and TaskConfig().eos_token_id == EOS
    with pytest.raises(ValueError, match=r"number_tokens\(1\)"):
        TaskConfig(number_tokens=1)
    with pytest.raises(ValueError, match=r"warmup_steps\(-1\)"):
        TaskConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match=r"warmup_label_smoothing\(1.0\)"):
        TaskConfig(warmup_label_smoothing=1.0)


def test_a_length_cap_with_no_room_for_an_answer_names_the_spec_field() -> None:
    """max_tokens 1 left no room for a number and EOS: make_prompt indexed an empty tuple (IndexError, printed as
    an internal error by `dora apply`). The spec check refuses it first; this is the second line of defence."""
    one = LengthDistribution.lognormal(median=1, p99=1, max_tokens=1)
    with pytest.raises(ValueError, match=r"workload\.response_length\.max_tokens is 1.*at least 2"):
        make_prompt(TaskConfig(), one, random.Random(0), "x")
    two = LengthDistribution.lognormal(median=1, p99=1, max_tokens=2)
    assert len(make_prompt(TaskConfig(), two, random.Random(0), "y").target_ids) == 2  # the shortest answer fits
