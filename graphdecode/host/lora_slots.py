"""Which adapter sits in which of the device's LoRA slots: the scheduler's only view of them.

Slots 1..max_loras hold one adapter each (slot 0 is "no adapter"). A sequence holds its adapter's slot from
admission until it leaves the batch (finished, retired, aborted, preempted), counted per slot. An adapter stays
in its slot after its last holder leaves, so the next request for it needs no load; a request for an adapter
that is not resident takes a free slot, else the least recently used slot that no sequence holds (its new
adapter is loaded by the plan, plan.LoRALoad, before anything of that step runs: in stream order after every
launched window that read the old one). When every slot is held by other adapters, the request waits at the
head of the queue until one is given back.

For routers (vLLM's lora_requests_info metric): `running` names the adapters some sequence in the batch holds,
`waiting` those of requests not admitted yet (counted from their arrival to their first admission or their end).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from ..plan import LoRALoad


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._resident: OrderedDict[object, int] = OrderedDict()  # adapter key -> slot, least recent use first
        self._holders = [0] * (max_loras + 1)  # sequences holding each slot
        self._loads: list[LoRALoad] = []
        self.num_loads = 0
        self._names: dict[object, str] = {}  # adapter key -> its name (the newest request's)
        self._waiting: Counter = Counter()  # adapter key -> requests not admitted yet

    def acquire(self, seqs, lora, adapter) -> bool:
        """Give `seqs` (one admission group, one request) the slot of adapter `lora` (a LoRARequest read as
        `adapter`, a LoadedAdapter), loading it if it is not resident; False (nothing changed) when no slot can
        take it."""
        slot = self._resident.get(lora.key)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._loads.append(LoRALoad(slot, adapter))
            self._resident[lora.key] = slot
            self.num_loads += 1
        self._resident.move_to_end(lora.key)
        self._holders[slot] += len(seqs)
        for seq in seqs:
            seq.lora_slot = slot
        return True

    def arrived(self, request) -> None:
        """A new request with an adapter joins the queue."""
        self._names[request.lora.key] = request.lora.lora_name
        self._waiting[request.lora.key] += 1
        request.lora_waiting = True

    def left_queue(self, request) -> None:
        """The request was admitted for the first time, or ended before it was."""
        if request.lora_waiting:
            request.lora_waiting = False
            self._waiting[request.lora.key] -= 1
            if not self._waiting[request.lora.key]:
                del self._waiting[request.lora.key]

    @property
    def running(self) -> list[str]:
        """Names of the adapters that sequences in the batch hold."""
        return sorted(self._names[key] for key, slot in self._resident.items() if self._holders[slot])

    @property
    def waiting(self) -> list[str]:
        """Names of the adapters of requests not admitted yet."""
        return sorted(self._names[key] for key in self._waiting)

    def _free_slot(self) -> int | None:
        used = set(self._resident.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        for key, slot in self._resident.items():  # least recently used first
            if not self._holders[slot]:
                del self._resident[key]
                return slot
        return None

    def release(self, seq) -> None:
        if seq.lora_slot:
            self._holders[seq.lora_slot] -= 1
            seq.lora_slot = 0

    def take_loads(self) -> list[LoRALoad]:
        loads, self._loads = self._loads, []
        return loads
