"""Three request logs with volatile content where real prompts have it (seeded, so the
same every run): a support bot with an early timestamp, RAG with per-request ids in
front of shared documents, and multi-turn chats whose system prompt names the session."""

from __future__ import annotations

import random

POLICY = ("You are the support assistant of Acme Cloud. Answer in two sentences at most. "
          "Refunds are possible within thirty days of purchase. Never share internal notes. "
          "If the customer is angry, apologise once and offer a ticket. Escalate outages to the on-call team. "
          "Prices are listed on the pricing page; do not quote discounts. ")
QUESTIONS = ["How do I reset my password?", "Can I get a refund?", "Why is my bill higher this month?",
             "How do I add a team member?", "Is there an outage right now?"]
DOCS = [
    "Document A: The cache keeps keys and values of shared prefixes. Blocks are hashed in a chain, "
    "so a block is reused only when everything before it matches. ",
    "Document B: Chunked prefill splits long prompts over several steps. Each step has a token budget "
    "that running decodes share with new prompts. ",
    "Document C: Eviction frees the least recently used blocks first. A request releases its last "
    "blocks first, so shared heads stay cached longest. ",
]
PERSONA = ("You are a friendly assistant for the Acme store. Keep answers short and polite, recommend "
           "products only when asked, and never invent prices. ")
ANSWERS = ["Sure, here is what I found.", "That depends on your plan.", "Yes, that works.", "Let me check."]


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def support_bot(n: int = 24, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"messages": [_msg("system", f"Current time: 2026-11-23T{9 + i // 60:02d}:{i % 60:02d}:"
                                         f"{rng.randint(10, 59)}Z\n{POLICY}"),
                          _msg("user", rng.choice(QUESTIONS))]} for i in range(n)]


def rag(n: int = 24, seed: int = 2) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        docs = DOCS[rng.randrange(len(DOCS))] + DOCS[rng.randrange(len(DOCS))]
        rows.append({"messages": [_msg("system", f"Request ID: req-{rng.getrandbits(40):010x}\n"
                                                 f"Answer from these documents only.\n{docs}"),
                                  _msg("user", rng.choice(["Summarise.", "What is reused?", "What is freed?"]))]})
    return rows


def multi_turn(conversations: int = 5, turns: int = 4, seed: int = 3) -> list[dict]:
    """Turns of several conversations, interleaved as concurrent users send them."""
    rng = random.Random(seed)
    sessions = [f"Session ID: s-{rng.getrandbits(24):06x}" for _ in range(conversations)]
    history: list[list[dict]] = [[] for _ in range(conversations)]
    rows = []
    for t in range(turns):
        for c in range(conversations):
            history[c].append(_msg("user", f"Question {t + 1}: {rng.choice(QUESTIONS)}"))
            rows.append({"messages": [_msg("system", f"{sessions[c]}\n{PERSONA}"), *history[c]]})
            history[c].append(_msg("assistant", rng.choice(ANSWERS)))
    return rows


LOGS = {"support_bot": support_bot, "rag": rag, "multi_turn": multi_turn}
