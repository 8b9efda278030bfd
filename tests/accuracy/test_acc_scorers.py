"""Scorers: known values and edge cases, each able to return both 0 and 1."""

from __future__ import annotations

import pytest
from benchmark.accuracy.scorers import (
    all_found,
    exact_match,
    first_span_exact_match,
    lcs_length,
    normalise,
    rouge_l_f1,
    score_instance,
    set_f1,
    token_agreement,
)
from benchmark.accuracy.tasks_needle import NUMBER_PATTERN, generate_needle_single
from benchmark.accuracy.token_count import TokenCounter


def test_normalise_and_exact_match() -> None:
    assert normalise("  The Answer, is: 42! ") == "answer is 42"
    assert exact_match("The answer is 42.", "answer is 42") == 1.0
    assert exact_match("answer is 43", "answer is 42") == 0.0
    assert exact_match("", "") == 1.0


def test_first_span_exact_match() -> None:
    assert first_span_exact_match("The number is 1234567.", "1234567", NUMBER_PATTERN) == 1.0
    assert first_span_exact_match("It is 7654321, or 1234567", "1234567", NUMBER_PATTERN) == 0.0
    assert first_span_exact_match("I do not know", "1234567", NUMBER_PATTERN) == 0.0
    assert first_span_exact_match("12345678", "1234567", NUMBER_PATTERN) == 0.0


def test_all_found_and_set_f1() -> None:
    refs = ["1111111", "2222222"]
    assert all_found("1111111, 2222222", refs, NUMBER_PATTERN) == 1.0
    assert all_found("1111111 and 3333333", refs, NUMBER_PATTERN) == 0.5
    assert all_found("none", refs, NUMBER_PATTERN) == 0.0
    names = ["ABCDE", "FGHIJ"]
    assert set_f1("ABCDE, FGHIJ", names, r"\b[A-Z]{5}\b") == 1.0
    assert set_f1("ABCDE, FGHIJ, KLMNO, PQRST", names, r"\b[A-Z]{5}\b") == pytest.approx(2 / 3)
    assert set_f1("nothing here", names, r"\b[A-Z]{5}\b") == 0.0
    with pytest.raises(ValueError):
        set_f1("x", [], r"x")


def test_lcs_and_rouge_l_known_values() -> None:
    assert lcs_length("abcbdab", "bdcaba") == 4
    assert lcs_length([], ["a"]) == 0
    # reference 6 words, prediction 4 words, LCS = 3 ("cat sat mat") after article removal
    pred = "the cat sat on mat"
    ref = "a cat quietly sat upon the mat today"
    p_words, r_words = 4, 6
    p, r = 3 / p_words, 3 / r_words
    assert rouge_l_f1(pred, ref) == pytest.approx(2 * p * r / (p + r))
    assert rouge_l_f1("Paris", "Paris") == 1.0
    assert rouge_l_f1("London", "Paris") == 0.0
    assert rouge_l_f1("", "") == 1.0
    assert rouge_l_f1("", "Paris") == 0.0
    assert rouge_l_f1("mat sat cat", "cat sat mat") == pytest.approx(1 / 3)


def test_token_agreement() -> None:
    same = token_agreement([1, 2, 3], [1, 2, 3])
    assert (same.common_prefix, same.match_rate) == (3, 1.0)
    diverged = token_agreement([1, 2, 3, 4], [1, 9, 3, 4])
    assert (diverged.common_prefix, diverged.match_rate) == (1, 0.75)
    shorter = token_agreement([1, 2, 3, 4], [1, 2])
    assert (shorter.common_prefix, shorter.match_rate) == (2, 0.5)
    assert token_agreement([], []).match_rate == 1.0
    assert token_agreement([5], []).match_rate == 0.0
    assert token_agreement(["a", "b"], ["a", "c"]).common_prefix == 1


def test_score_instance_uses_task_metric(counter: TokenCounter) -> None:
    inst = generate_needle_single(1, 1024, 0.5, counter)
    answer = inst.expected_answers[0]
    assert score_instance(inst, f"The special magic number is {answer}.") == 1.0
    wrong = str(int(answer) + 1)
    assert score_instance(inst, wrong) == 0.0


def test_kv_scorer_skips_an_echo_of_the_queried_key(counter: TokenCounter) -> None:
    from benchmark.accuracy.tasks_kv import generate_kv_retrieval

    inst = generate_kv_retrieval(3, 1024, 0.5, counter)
    (key,) = inst.echo_spans
    value = inst.expected_answers[0]
    assert score_instance(inst, f'The value corresponding to the key "{key}" is "{value}".') == 1.0
    assert score_instance(inst, f'The value corresponding to the key "{key}" is') == 0.0
    other_digit = "1" if value[-1] != "1" else "2"
    assert score_instance(inst, value[:-1] + other_digit) == 0.0
    assert first_span_exact_match(f"{key} {value}", value, inst.answer_pattern) == 0.0
