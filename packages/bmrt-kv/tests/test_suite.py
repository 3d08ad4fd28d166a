"""The RULER-style suite (#18): seeded generation, the needles where the answers say, and
RULER's all-or-nothing scoring."""

import re

import pytest
from evaluation import Sample
from ruler_suite import TASKS, make_sample, suite_samples

from bmrt_kv import BMRTError


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def test_the_suite_is_seeded_and_differs_across_seeds(tokenizer):
    a = suite_samples(tokenizer, 600, 3, seed=1)
    b = suite_samples(tokenizer, 600, 3, seed=1)
    c = suite_samples(tokenizer, 600, 3, seed=2)
    assert set(a) == set(TASKS)
    assert a == b
    assert all(a[t] != c[t] for t in TASKS)


@pytest.mark.parametrize("n_tokens", [1000, 4000])
@pytest.mark.parametrize("task", TASKS)
def test_a_sample_has_about_the_requested_length(tokenizer, task, n_tokens):
    import random

    sample = make_sample(task, tokenizer, n_tokens, random.Random(0))
    n = len(tokenizer(sample.context + sample.question).input_ids)
    assert 0.85 * n_tokens <= n <= 1.1 * n_tokens, (task, n)


@pytest.mark.parametrize("task", TASKS)
def test_every_answer_is_in_the_context_and_derivable(tokenizer, task):
    import random

    rng = random.Random(3)
    for _ in range(5):
        s = make_sample(task, tokenizer, 800, rng)
        assert s.task == task and s.answers and s.answer == s.answers[0]
        if task == "common_words":
            listed = re.findall(r"^\d+\. (\w+)$", s.context, re.M)
            counts = sorted(((listed.count(w), w) for w in set(listed)), reverse=True)
            assert {w for _, w in counts[:3]} == set(s.answers)
            assert counts[2][0] > counts[3][0]  # the top 3 are unambiguous
        elif task == "variable_tracking":
            value = re.search(r"the value (\d+) in", s.question).group(1)
            holding, changed = {}, True
            assigns = re.findall(r"VAR (\w+) = (VAR (\w+)|\d+)\.", s.context)
            while changed:  # resolve the chains, in any order
                changed = False
                for name, rhs, src in assigns:
                    v = holding.get(src) if src else rhs
                    if v is not None and holding.get(name) != v:
                        holding[name], changed = v, True
            assert {n for n, v in holding.items() if v == value} == set(s.answers)
        else:
            key = re.search(r"for (\w+)( and (\w+))? mentioned", s.question)
            asked = [k for k in (key.group(1), key.group(3)) if k]
            found = [
                v
                for k, v in re.findall(r"magic \w+ for (\w+) is: (\w+)\.", s.context)
                if k in asked
            ]
            assert sorted(found) == sorted(s.answers)


def test_scoring_is_all_or_nothing_on_whole_words():
    s = Sample("c", "q", "1234567", ("1234567", "7654321"), "multivalue", 32)
    assert s.correct("are 7654321, and 1234567.")
    assert not s.correct("are 1234567 and 765432")
    assert not s.correct("are 12345678 and 7654321")  # not a whole word
    one = Sample("c", "q", "lemon", ("lemon",), "single_word", 12)
    assert one.correct(" Lemon.") and not one.correct("lemons")
    passkey = Sample("c", "q", "48213")  # the pass key: the first number
    assert passkey.correct("48213. Remember") and not passkey.correct("1 48213")


def test_bad_requests_name_what_is_wrong(tokenizer):
    import random

    with pytest.raises(BMRTError, match="unknown task 'needle'"):
        make_sample("needle", tokenizer, 1000, random.Random(0))
    with pytest.raises(BMRTError, match="unknown tasks"):
        suite_samples(tokenizer, 1000, 1, tasks=["single_number", "x"])
    with pytest.raises(BMRTError, match="n_tokens"):
        make_sample("multikey", tokenizer, 10, random.Random(0))
