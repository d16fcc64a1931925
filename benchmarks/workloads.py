"""Workloads for the suffix-drafting benchmark (suffix_bench) and the serving load (serve_load): lists of
conversations, each turn a chat prompt, built from Spec-Bench's question file (read, never copied) or in code.

- `spec_bench`: the first turn of the first `per_group` questions of each Spec-Bench task group.
- `multi_turn`: Spec-Bench's two-turn questions (MT-Bench, 80 of them) as Spec-Bench runs them: turn 1,
  then turn 2 with turn 1's answer as the assistant message before it; a conversation is sequential.
- `schema`: repeated-schema requests made here: one JSON record per request, three record shapes
  (city, book, scientist) each given in the system prompt, the entities taken in turn from fixed lists.

Example (multi_turn): turns ["Write a poem.", "Rewrite it in French."] with the answer A to turn 1
gives turn 2's messages [user "Write a poem.", assistant A, user "Rewrite it in French."].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .common import MT_BENCH, load_questions

WORKLOADS = ("spec_bench", "multi_turn", "schema")


@dataclass
class Conversation:
    id: str
    group: str  # what the results are reported by: a Spec-Bench task group, an MT-Bench category, a record kind
    turns: list[str]  # the user's messages, in order
    system: str | None = None

    def messages(self, turn: int, answers: list[str]) -> list[dict]:
        """The chat messages of turn `turn` (0-based): the system message, each earlier turn's user
        message followed by its answer (answers[i]: the assistant's reply to turn i), then this turn's."""
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs the answers of the {turn} turn(s) before it, got {len(answers)}")
        chat = [{"role": "system", "content": self.system}] if self.system else []
        for user, answer in zip(self.turns[:turn], answers):
            chat += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return chat + [{"role": "user", "content": self.turns[turn]}]


def spec_bench(path: Path, per_group: int, limit: int | None = None) -> list[Conversation]:
    """First turns of the first `per_group` questions of each Spec-Bench task group, in file order
    (so grouped), at most `limit`."""
    questions = load_questions(path, per_group=per_group, limit=limit, group_by="task")
    return [Conversation(str(q["question_id"]), q["group"], [q["turns"][0]]) for q in questions]


def multi_turn(path: Path, per_category: int, limit: int | None = None) -> list[Conversation]:
    """The first `per_category` two-turn questions of each MT-Bench category (8 categories, 10
    each), at most `limit`, both turns."""
    questions = [q for q in load_questions(path) if q["category"] in MT_BENCH and len(q["turns"]) == 2]
    taken: dict[str, int] = {}
    out = []
    for q in questions:
        if taken.get(q["category"], 0) < per_category:
            taken[q["category"]] = taken.get(q["category"], 0) + 1
            out.append(Conversation(str(q["question_id"]), q["category"], list(q["turns"])))
    return out[:limit]


# record kind -> (the JSON shape the system prompt gives, the entities asked about, in order)
SCHEMAS: dict[str, tuple[dict, list[str]]] = {
    "city": (
        {
            "name": "string",
            "country": "string",
            "population": "integer",
            "founded": "integer year or null",
            "landmarks": ["string"],
            "climate": "string",
            "is_capital": "boolean",
        },
        [
            "Lisbon",
            "Nairobi",
            "Osaka",
            "Toronto",
            "Cusco",
            "Tbilisi",
            "Hanoi",
            "Marrakesh",
            "Reykjavik",
            "Adelaide",
            "Bergen",
            "Valparaiso",
            "Krakow",
            "Chennai",
            "Quebec City",
            "Bruges",
        ],
    ),
    "book": (
        {
            "title": "string",
            "author": "string",
            "year": "integer",
            "genre": "string",
            "pages": "integer",
            "original_language": "string",
            "summary": "string (one sentence)",
        },
        [
            "Moby-Dick",
            "Pride and Prejudice",
            "One Hundred Years of Solitude",
            "The Trial",
            "Things Fall Apart",
            "Don Quixote",
            "The Tale of Genji",
            "Middlemarch",
            "Beloved",
            "The Master and Margarita",
            "Invisible Cities",
            "Frankenstein",
            "The Name of the Rose",
            "Dune",
            "Wuthering Heights",
            "Ficciones",
        ],
    ),
    "scientist": (
        {
            "name": "string",
            "born": "integer year",
            "died": "integer year or null",
            "nationality": "string",
            "field": "string",
            "known_for": ["string"],
            "nobel_prize": "boolean",
        },
        [
            "Marie Curie",
            "Alan Turing",
            "Rosalind Franklin",
            "Srinivasa Ramanujan",
            "Niels Bohr",
            "Ada Lovelace",
            "Dmitri Mendeleev",
            "Emmy Noether",
            "Gregor Mendel",
            "Chien-Shiung Wu",
            "Michael Faraday",
            "Lise Meitner",
            "Louis Pasteur",
            "Barbara McClintock",
            "Alexander von Humboldt",
            "Tu Youyou",
        ],
    ),
}
SCHEMA_REQUESTS = sum(len(entities) for _, entities in SCHEMAS.values())  # 48: each entity once
SCHEMA_SYSTEM = (
    "You are a data API. Reply with exactly one JSON object with these keys, in this order, and the types "
    "shown; no prose, no markdown fences.\nSchema of a {kind} record:\n{schema}"
)
SCHEMA_USER = "Give the {kind} record for: {entity}."


def schema(n: int = 24) -> list[Conversation]:
    """`n` repeated-schema requests (at most 48): the record kinds taken in turn (city, book,
    scientist, city, ...), each kind's entities in list order. Deterministic."""
    kinds = list(SCHEMAS)
    if not 0 <= n <= SCHEMA_REQUESTS:
        raise ValueError(f"the schema workload has {SCHEMA_REQUESTS} requests, asked for {n}")
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        shape, entities = SCHEMAS[kind]
        entity = entities[i // len(kinds)]
        system = SCHEMA_SYSTEM.format(kind=kind, schema=json.dumps(shape, indent=1))
        out.append(
            Conversation(
                f"{kind}-{i // len(kinds)}", kind, [SCHEMA_USER.format(kind=kind, entity=entity)], system=system
            )
        )
    return out


def encode_chats(tokenizer, chats: list[list[dict]]) -> dict:
    """Chat message lists as prompts (the tokenizer's chat template, generation prompt added), left-padded
    into one batch: `common.encode` for whole conversations."""
    texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    return tokenizer(texts, return_tensors="pt", padding=True)
