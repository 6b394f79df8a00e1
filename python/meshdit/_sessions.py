"""Which tensors a forward must send: the client side of the server's sessions (docs/serve.md).

Within one generation most of a transformer's inputs do not change from step to step (Flux:
the text embeddings, pooled projections, ids, guidance). The planner keeps, per open server
session, a fingerprint of every tensor that session holds; a forward sends only the tensors whose
content differs from the best-matching session and names them in ``keep`` so that session is
brought up to date. Fingerprints are content hashes (BLAKE2b over dtype, shape and bytes), so a
pipeline that builds a new but equal tensor each step still sends it once, and one that changes a
tensor in place sends it again: equality is never assumed from identity.

A session whose tensors mostly match (at least half the bytes) is updated with the changed ones
(a small tensor that changes every step costs only itself); otherwise the forward opens a
session of its own while there is room. Several sessions are kept at once (the least recently
used ends first), so classifier-free guidance, which alternates two sets of text embeddings,
sends each set once.

Session names here are this planner's own handles (``s1``, ``s2``, ...): the server issues each
session an unguessable token when it opens (``"session": "new"``), and the `Client` maps a
handle to its token, so two planners (or two processes, whatever their PIDs) never share one.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Mapping

from ._blob import Raw

def fingerprint(t: Raw) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{t.shape}".encode())
    h.update(t.data)
    return h.digest()


class Planner:
    """Plans the requests of one client. `capacity` sessions at most (0: never use sessions)."""

    def __init__(self, capacity: int):
        self.capacity = max(0, capacity)
        self.open: dict[str, dict[str, bytes]] = {}  # session -> {name: fingerprint}, LRU first
        self._serial = itertools.count(1)

    def plan(self, tensors: Mapping[str, Raw], per_step) -> tuple:
        """(session or None, {name: Raw} to send, names to keep, sessions to end first,
        fingerprints of the kept names). `per_step` names tensors that change every step (never
        kept)."""
        if self.capacity == 0:
            return None, dict(tensors), [], [], {}
        cand = {n: t for n, t in tensors.items() if n not in per_step}
        if not cand:
            return None, dict(tensors), [], [], {}
        fps = {n: fingerprint(t) for n, t in cand.items()}
        best, saved = None, 0
        for s, held in self.open.items():
            if set(held) != set(fps):  # a session holding other names would add stale tensors
                continue
            same = sum(len(cand[n].data) for n in fps if held[n] == fps[n])
            if same > saved:
                best, saved = s, same
        changed_bytes = sum(len(cand[n].data) for n in fps) - saved
        if best is not None and saved < changed_bytes and len(self.open) < self.capacity:
            best = None  # mostly other tensors (another prompt): a session of its own
        ended = []
        if best is None:
            if len(self.open) >= self.capacity:
                lru = next(iter(self.open))
                ended.append(lru)
                del self.open[lru]
            best = f"s{next(self._serial)}"
            held = {}
        else:
            held = self.open.pop(best)
        self.open[best] = held  # most recently used last
        changed = [n for n in fps if held.get(n) != fps[n]]
        send = {n: t for n, t in tensors.items() if n not in cand or n in changed}
        return best, send, changed, ended, {n: fps[n] for n in changed}

    def commit(self, session: str, kept: Mapping[str, bytes]) -> None:
        """The forward succeeded: the session now holds `kept` too."""
        if session in self.open:
            self.open[session].update(kept)

    def forget(self, session: str) -> None:
        """The session is gone on the server (or its state unknown): plan as if it never was."""
        self.open.pop(session, None)
