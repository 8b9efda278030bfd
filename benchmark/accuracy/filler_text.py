"""Deterministic filler text built by the project itself (no downloads, no files read).

Lifecycle: `FillerTextGenerator(seed)` is created per task instance; `sentences()` yields an
endless, reproducible stream of plain English sentences about ordinary topics (weather, gardens,
trains, markets ...). Invariants: the same seed gives the same stream on every machine; the filler
never contains digits, the word "magic", variable-assignment syntax or the markers the tasks use
for their needles, so an answer cannot be found by accident in the filler.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

SUBJECTS = (
    "the old gardener", "a quiet librarian", "the river pilot", "our neighbour", "the baker",
    "a travelling painter", "the village teacher", "the ferry crew", "a young clockmaker",
    "the shepherd", "the station master", "an elderly fisherman", "the weaver", "the mapmaker",
    "a careful carpenter", "the choir", "the harbour guard", "a visiting botanist",
)
VERBS = (
    "walked along", "wrote about", "remembered", "painted", "repaired", "watched", "described",
    "measured", "cleaned", "visited", "photographed", "admired", "studied", "sketched",
    "talked about", "planted trees near", "sang about", "counted the birds above",
)
OBJECTS = (
    "the stone bridge", "the northern hills", "a narrow lane", "the market square", "the orchard",
    "the lighthouse", "a field of barley", "the frozen lake", "the chapel roof", "the long canal",
    "the eastern meadow", "a row of cottages", "the pine forest", "the mill wheel", "the sea wall",
    "the railway cutting", "a walled garden", "the salt marsh",
)
TIMES = (
    "early in the morning", "after a long rain", "before the first frost", "during the fair",
    "late in the evening", "on a windy afternoon", "in the middle of summer", "at dusk",
    "when the tide was low", "while the bells were ringing", "under a grey sky", "in the spring",
)
CLAUSES = (
    "and nobody seemed to mind", "because the light was soft", "although the path was muddy",
    "while the children played nearby", "as the wind turned cold", "and the air smelled of bread",
    "since the roads were quiet", "and the swallows returned", "though the clouds were heavy",
    "as the kettle began to sing", "and the dogs slept in the sun", "while the river rose slowly",
)
REFLECTIONS = (
    "Small places keep their stories in the walls.",
    "Patience is the oldest tool in any workshop.",
    "Every season leaves something behind for the next one.",
    "A good map is mostly about what it leaves out.",
    "The best conversations happen on long walks.",
    "Old roads remember the carts that made them.",
    "Quiet work is often the work that lasts.",
    "Weather changes the mood of a town more than any news.",
)


class FillerTextGenerator:
    """Reproducible sentence stream; one instance per (task instance, seed)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(f"filler:{seed}")

    def sentence(self) -> str:
        rng = self._rng
        if rng.random() < 0.12:
            return rng.choice(REFLECTIONS)
        subject = rng.choice(SUBJECTS)
        text = f"{subject} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TIMES)}"
        if rng.random() < 0.6:
            text += f", {rng.choice(CLAUSES)}"
        return text[0].upper() + text[1:] + "."

    def sentences(self) -> Iterator[str]:
        while True:
            yield self.sentence()
