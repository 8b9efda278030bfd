"""Question answered from a long document (scored by ROUGE-L against a reference sentence).

A paragraph of invented facts about a fictional society (founder, town, year, first project) is
placed at `depth` inside filler; one question asks for one fact. The reference answer is a short
sentence that restates the fact, and every word of the fact appears verbatim in the paragraph, so
the answer is derivable from the document alone. Scored by ROUGE-L F1 (words, LCS-based).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmark.accuracy.haystack import build_haystack, validate_depth
from benchmark.accuracy.task_common import (
    filler_budget,
    task_rng,
    user_messages,
    validate_context_tokens,
)
from benchmark.accuracy.task_types import Metric, TaskInstance, TaskMetadata, TaskName
from benchmark.accuracy.token_count import TokenCounter

SYLLABLES = ("bra", "ven", "tor", "mil", "ka", "dor", "sel", "ith", "quo", "ran", "bel", "zen", "fa", "lum")
FIRST_NAMES = ("Amelia", "Tobias", "Ingrid", "Rafael", "Noor", "Casimir", "Elena", "Matteo", "Yara", "Oskar")
LAST_NAMES = ("Halvorsen", "Okafor", "Brennan", "Castellanos", "Lindqvist", "Moreau", "Tanaka", "Vasquez")
PROJECTS = (
    "a floating library on the river", "a map of every well in the valley", "a school for glassblowers",
    "a bridge made entirely of oak", "a seed bank for mountain flowers", "a choir of lighthouse keepers",
    "an observatory built from a windmill", "a ferry service for bicycles",
)


@dataclass(frozen=True)
class SocietyFacts:
    society: str
    founder: str
    town: str
    year: str
    project: str

    def paragraph(self) -> str:
        return (
            f"The {self.society} Society was founded in {self.year} by {self.founder} in the town of "
            f"{self.town}. The first project of the {self.society} Society was {self.project}."
        )


def invented_name(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()


def draw_facts(rng: random.Random) -> SocietyFacts:
    return SocietyFacts(
        society=invented_name(rng, 3),
        founder=f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
        town=invented_name(rng, 2),
        year=str(rng.randrange(1701, 1950)),
        project=rng.choice(PROJECTS),
    )


def question_and_reference(facts: SocietyFacts, kind: int) -> tuple[str, str]:
    name = f"the {facts.society} Society"
    questions = (
        (f"Who founded {name}, and in which year?", f"{facts.founder} founded {name} in {facts.year}."),
        (f"In which town was {name} founded?", f"{name.capitalize()} was founded in {facts.town}."),
        (f"What was the first project of {name}?", f"The first project of {name} was {facts.project}."),
    )
    return questions[kind % len(questions)]


def docqa_prompt(document: str, question: str) -> str:
    return (
        "Read the following document and answer the question that follows it.\n\n"
        f"Document:\n{document}\n\n"
        f"Question: {question}\nAnswer in one short sentence, using only the document."
    )


def generate_document_qa(seed: int, context_tokens: int, depth: float, counter: TokenCounter) -> TaskInstance:
    validate_context_tokens(context_tokens)
    validate_depth(depth)
    rng = task_rng(TaskName.DOCUMENT_QA, seed, context_tokens, depth)
    facts = draw_facts(rng)
    question, reference = question_and_reference(facts, rng.randrange(3))
    paragraph = facts.paragraph()
    budget = filler_budget(context_tokens, counter, docqa_prompt(paragraph, question))
    haystack = build_haystack(seed, budget, counter, [(depth, paragraph)])
    content = docqa_prompt(haystack.text, question)
    metadata = TaskMetadata(
        TaskName.DOCUMENT_QA, context_tokens, counter.count(content), counter.method, depth, seed, (depth,)
    )
    return TaskInstance(user_messages(content), (reference,), "", Metric.ROUGE_L, metadata)
