"""Weight updates and pauses in the engine core (AsyncLLM.update_weights* / pause_generation / resume_generation,
the server's /update_weights_from_disk, /pause, /resume).

An update waits until no request runs, so that every request's tokens come from one version of the weights:
requests that arrive meanwhile wait too (their "add" and any "abort" of theirs are held, in order, and handed
on after the update), requests already running finish first; with `abort_all_requests` they are aborted
instead (each ends with finish_reason "abort"). Then the engine writes the weights (Engine.update_weights).

A pause (vLLM's pause_generation, modes "wait" and "abort") does the same without writing anything, and keeps
holding new requests until `resume`: a trainer that sends its weights in several updates pauses first, so that
no request runs on half of them.

Every such message carries a token; its client gets ("reply", token, result, error) once it is done: the
WeightUpdate's fields, True for a pause or a resume, or the ValueError / TypeError that refused an update before
anything was written (the engine serves on with the weights it had).
"""

from __future__ import annotations

import logging
import pickle
from collections import deque

log = logging.getLogger("graphdecode")

PAUSE_MODES = ("abort", "wait")  # vLLM's, but "keep" (running requests frozen in place across an update)


class WeightSync:
    def __init__(self):
        # (client, message) of the updates and pauses waiting for the running requests, in arrival order
        self.pending: deque[tuple[int, tuple]] = deque()
        self.held: list[tuple[int, tuple]] = []  # (client, message) that arrived meanwhile
        self._held_ids: set[str] = set()
        self.paused = False  # paused (or pausing): new requests are held until resume

    def ask(self, engine, client: int, message: tuple) -> None:
        """("update_weights", token, source, weight_version, abort_all_requests) or ("pause", token, mode,
        clear_cache)."""
        if message[0] == "pause":
            self.paused = True
        if (message[4] if message[0] == "update_weights" else message[2] == "abort"):
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
        self.pending.append((client, message))

    def resume(self, client: int, message: tuple, outputs) -> list[tuple[int, tuple]]:
        """("resume", token): new requests run again (once the updates still waiting are in); returns the held
        messages to handle now."""
        self.paused = False
        outputs[client].send(("reply", message[1], True, None))
        return self._release() if not self.pending else []

    def holds(self, client: int, message: tuple) -> bool:
        """Keep `message` for later: a new request, or an abort of one kept."""
        if not (self.pending or self.paused):
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
        every pending update and pause, answering its client (`outputs[client]`); returns the messages held
        meanwhile, to be handled now in their order (none while paused)."""
        if not self.pending or engine.has_unfinished():
            return []
        while self.pending:
            client, message = self.pending.popleft()
            if message[0] == "pause":
                if message[3]:  # clear_cache
                    engine.reset_prefix_cache()
                outputs[client].send(("reply", message[1], True, None))
                continue
            _, token, (kind, value), version, _ = message  # ("disk", path) or ("pickled", pairs pickled by value)
            try:
                update = (engine.update_weights_from_disk(value, version) if kind == "disk"
                          else engine.update_weights(pickle.loads(value), version))
                result, error = update.as_dict(), None
            except (ValueError, TypeError, RuntimeError) as exc:  # refused before any write: the weights stand
                result, error = None, str(exc)
                log.warning("graphdecode: weight update refused: %s", exc)
            outputs[client].send(("reply", token, result, error))
        return [] if self.paused else self._release()

    def _release(self) -> list[tuple[int, tuple]]:
        held, self.held = self.held, []
        self._held_ids.clear()
        return held
