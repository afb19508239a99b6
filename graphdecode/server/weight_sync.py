"""Weight updates in the engine core (AsyncLLM.update_weights*, the server's /update_weights_from_disk).

An update waits until no request runs, so that every request's tokens come from one version of the weights:
requests that arrive meanwhile wait too (their "add" and any "abort" of theirs are held, in order, and handed
on after the update), requests already running finish first; with `abort_all_requests` they are aborted
instead (each ends with finish_reason "abort"). Then the engine writes the weights (Engine.update_weights)
and the asking client gets ("weights_updated", token, result, error): the WeightUpdate's fields, or the
ValueError / TypeError that refused the weights before anything was written (the engine serves on with the
weights it had).
"""

from __future__ import annotations

import logging
import pickle
from collections import deque

log = logging.getLogger("graphdecode")


class WeightSync:
    def __init__(self):
        self.pending: deque[tuple[int, tuple]] = deque()  # (client, its update message), in arrival order
        self.held: list[tuple[int, tuple]] = []  # (client, message) that arrived while an update waits
        self._held_ids: set[str] = set()

    def ask(self, engine, client: int, message: tuple) -> None:
        """An update message: ("update_weights", token, source, weight_version, abort_all_requests)."""
        if message[4]:
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
        self.pending.append((client, message))

    def holds(self, client: int, message: tuple) -> bool:
        """Keep `message` for after the pending updates: a new request, or an abort of one kept."""
        if not self.pending:
            return False
        kind = message[0]
        if kind == "add" or (kind == "abort" and message[1] in self._held_ids):
            if kind == "add":
                self._held_ids.add(message[1])
            self.held.append((client, message))
            return True
        return False

    def apply_ready(self, engine, outputs) -> list[tuple[int, tuple]]:
        """Once the engine has nothing left to step (no request runs, every final delta, aborts' too, sent): apply
        every pending update, answering its client (`outputs[client]`); returns the messages held meanwhile, to be
        handled now in their order."""
        if not self.pending or engine.has_unfinished():
            return []
        while self.pending:
            client, (_, token, source, version, _) = self.pending.popleft()
            try:
                kind, value = source  # ("disk", path) or ("pickled", the pairs pickled by value)
                update = (engine.update_weights_from_disk(value, version) if kind == "disk"
                          else engine.update_weights(pickle.loads(value), version))
                result, error = update.as_dict(), None
            except (ValueError, TypeError, RuntimeError) as exc:  # refused before any write: the weights stand
                result, error = None, str(exc)
                log.warning("graphdecode: weight update refused: %s", exc)
            outputs[client].send(("weights_updated", token, result, error))
        held, self.held = self.held, []
        self._held_ids.clear()
        return held
