"""Which replica serves a request: least loaded, or the one holding its prompt's prefix.

Owns: `prefix_key` (a hash of a request's first prompt block, read from its JSON body without
a tokenizer: the first PREFIX_CHARS characters of the prompt or of the chat messages as sent),
and `rank` (rendezvous hashing: every replica's score for a key, highest first, so a key keeps
its replica while the set changes and a dead replica's keys spread over the others). The Ray
Serve request router that uses both is `forerun.cluster.router.PrefixRouter`:

A request with a prefix key (prefix caching on, a long enough prompt) goes to the
replica ranked first for its key, whose prefix cache holds the blocks earlier requests with the
same beginning left there; when that replica is full (`max_ongoing_requests` in flight), the
next ranked, and so on. A request without a key: power of two choices, the less loaded of two
random replicas (by their queue lengths), as Ray Serve's default router does. The router runs
in the caller's process (the ingress) and reads the key from the call's `prefix_key` keyword.
"""

from __future__ import annotations

import hashlib
import json

PREFIX_CHARS = 256  # about one 64-token prefix-cache block of English or code
KEY_ARG = "prefix_key"  # the keyword of the replica call that carries the key


def prefix_key(path: str, body: bytes) -> str | None:
    """A hash of the request's first PREFIX_CHARS prompt characters (token ids: the first
    PREFIX_CHARS / 4 ids); None where the prompt is shorter or the body is not a request."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = request.get("messages")
        text = json.dumps(messages, sort_keys=True, ensure_ascii=False) if isinstance(
            messages, list) else ""
        block = text[:PREFIX_CHARS] if len(text) >= PREFIX_CHARS else None
    elif path.endswith("/completions"):
        block = prompt_block(request.get("prompt"))
    else:
        return None
    if block is None:
        return None
    return hashlib.blake2b(block.encode(), digest_size=8).hexdigest()


def prompt_block(prompt: object) -> str | None:
    """A completion prompt's first block: PREFIX_CHARS characters, or PREFIX_CHARS / 4 ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:PREFIX_CHARS] if len(prompt) >= PREFIX_CHARS else None
    ids = PREFIX_CHARS // 4
    if isinstance(prompt, list) and len(prompt) >= ids:
        return "ids:" + ",".join(map(str, prompt[:ids]))
    return None


def rank(key: str, replicas: list[str]) -> list[str]:
    """`replicas` by their rendezvous score for `key`, highest first."""
    def score(replica: str) -> bytes:
        return hashlib.blake2b(f"{key}/{replica}".encode(), digest_size=8).digest()

    return sorted(replicas, key=score, reverse=True)
