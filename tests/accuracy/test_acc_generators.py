"""Task generators: determinism by seed, length, needle at the requested depth, derivable answers."""

from __future__ import annotations

import json
import re

import pytest
from benchmark.accuracy.filler_text import FillerTextGenerator
from benchmark.accuracy.haystack import build_haystack
from benchmark.accuracy.task_registry import generate_instances, generate_one, parse_task_names
from benchmark.accuracy.task_types import TaskName
from benchmark.accuracy.tasks_docqa import generate_document_qa
from benchmark.accuracy.tasks_kv import generate_kv_retrieval
from benchmark.accuracy.tasks_needle import generate_needle_multi, generate_needle_single, needle_sentence
from benchmark.accuracy.tasks_vartrack import generate_variable_tracking
from benchmark.accuracy.token_count import TokenCounter


def test_filler_is_deterministic_and_free_of_digits() -> None:
    first = [FillerTextGenerator(3).sentence() for _ in range(300)]
    again = [FillerTextGenerator(3).sentence() for _ in range(300)]
    other = [FillerTextGenerator(4).sentence() for _ in range(300)]
    assert first == again
    assert first != other
    text = " ".join(first)
    assert not re.search(r"\d", text)
    assert "VAR" not in text and "magic" not in text.lower()


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_haystack_places_piece_at_depth(counter: TokenCounter, depth: float) -> None:
    piece = "PIECE-OF-TEXT"
    hay = build_haystack(7, 2000, counter, [(depth, piece)])
    offset = hay.offsets[0]
    assert hay.text[offset : offset + len(piece)] == piece
    assert hay.text.count(piece) == 1
    relative = offset / max(len(hay.text) - len(piece), 1)
    assert abs(relative - depth) < 0.03


@pytest.mark.parametrize("context", [1024, 4096, 8192])
def test_single_needle_length_depth_and_answer(counter: TokenCounter, context: int) -> None:
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        inst = generate_needle_single(11, context, depth, counter)
        content = inst.messages[0]["content"]
        assert abs(inst.metadata.context_tokens_approx - context) <= 0.03 * context
        (number,) = inst.expected_answers
        numbers = re.findall(r"\d{7}", content)
        assert numbers == [number]
        key = re.search(r"magic number for (\w+) mentioned", content)
        assert key is not None
        needle = needle_sentence(key.group(1), number)
        start = content.index("afterwards.\n\n") + len("afterwards.\n\n")
        end = content.index("\n\nWhat is")
        hay = content[start:end]
        relative = hay.index(needle) / max(len(hay) - len(needle), 1)
        assert abs(relative - depth) < 0.03, (depth, relative)


def test_single_needle_determinism(counter: TokenCounter) -> None:
    a = generate_needle_single(5, 2048, 0.5, counter)
    b = generate_needle_single(5, 2048, 0.5, counter)
    c = generate_needle_single(6, 2048, 0.5, counter)
    assert a == b
    assert a.messages != c.messages and a.expected_answers != c.expected_answers


def test_multi_needle_all_values_present_in_order(counter: TokenCounter) -> None:
    inst = generate_needle_multi(2, 2048, counter, num_needles=4)
    content = inst.messages[0]["content"]
    assert len(set(inst.expected_answers)) == 4
    assert re.findall(r"\d{7}", content) == list(inst.expected_answers)
    assert inst.metadata.needle_depths == (0.2, 0.4, 0.6, 0.8)
    assert generate_needle_multi(2, 2048, counter, num_needles=4) == inst
    with pytest.raises(ValueError):
        generate_needle_multi(2, 2048, counter, num_needles=1)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_kv_retrieval_answer_is_value_of_key(counter: TokenCounter, depth: float) -> None:
    inst = generate_kv_retrieval(9, 2048, depth, counter)
    content = inst.messages[0]["content"]
    json_text = content[content.index("{") : content.rindex("}") + 1]
    data = json.loads(json_text)
    key = re.search(r'Key: "([0-9a-f-]+)"', content)
    assert key is not None
    assert data[key.group(1)] == inst.expected_answers[0]
    keys = list(data)
    assert abs(keys.index(key.group(1)) / (len(keys) - 1) - depth) < 0.02
    assert len(set(data.values())) == len(data)
    assert abs(inst.metadata.context_tokens_approx - 2048) <= 0.03 * 2048
    assert generate_kv_retrieval(9, 2048, depth, counter) == inst


def test_variable_tracking_chain_resolves_to_answer(counter: TokenCounter) -> None:
    inst = generate_variable_tracking(4, 2048, counter, hops=3)
    content = inst.messages[0]["content"]
    value = re.search(r"assigned the value (\d+)", content)
    assert value is not None
    values: dict[str, str] = {}
    for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", content):
        values[name] = values[rhs[4:]] if rhs.startswith("VAR ") else rhs
    holders = sorted(name for name, v in values.items() if v == value.group(1))
    assert holders == sorted(inst.expected_answers)
    assert len(inst.expected_answers) == 4
    assert len(values) == 8  # the distractor chain is there too
    assert generate_variable_tracking(4, 2048, counter, hops=3) == inst


def test_document_qa_reference_is_derivable(counter: TokenCounter) -> None:
    for seed in range(6):
        inst = generate_document_qa(seed, 1024, 0.5, counter)
        content = inst.messages[0]["content"]
        reference = inst.expected_answers[0]
        document = content[content.index("Document:") : content.index("Question:")].lower()
        for word in re.findall(r"[a-z0-9]+", reference.lower()):
            assert word in document, (word, reference)
        assert generate_document_qa(seed, 1024, 0.5, counter) == inst


def test_grid_expansion_and_errors(counter: TokenCounter) -> None:
    tasks = parse_task_names(["needle_single", "variable_tracking"])
    grid = generate_instances(tasks, [1024], [0, 1], counter, depths=(0.0, 1.0))
    ids = [inst.instance_id for inst in grid]
    assert len(ids) == len(set(ids)) == 2 * 2 + 2
    with pytest.raises(ValueError, match="unknown task"):
        parse_task_names(["mmlu"])
    with pytest.raises(ValueError, match="depth"):
        generate_one(TaskName.NEEDLE_SINGLE, 0, 1024, None, counter)
    with pytest.raises(ValueError, match="depth"):
        generate_needle_single(0, 1024, 1.5, counter)
    with pytest.raises(ValueError, match="context_tokens"):
        generate_needle_single(0, 10, 0.5, counter)


def test_hf_tokenizer_counts_hit_the_target_when_the_model_is_prepared() -> None:
    from benchmark.accuracy.token_count import DEFAULT_TOKENIZER_DIR, load_hf_tokenizer

    hf = load_hf_tokenizer(DEFAULT_TOKENIZER_DIR)
    if hf is None:
        pytest.skip(f"no local tokenizer at {DEFAULT_TOKENIZER_DIR} (python -m sglang_lynx.models prepare)")
    for task in (TaskName.NEEDLE_SINGLE, TaskName.KV_RETRIEVAL, TaskName.VARIABLE_TRACKING):
        inst = generate_one(task, 0, 2048, 0.5, hf)
        measured = hf.count(inst.messages[0]["content"])
        assert inst.metadata.context_tokens_approx == measured
        assert inst.metadata.token_count_method.startswith("hf-tokenizer")
        assert abs(measured - 2048) <= 0.03 * 2048, (task, measured)
