"""KV-cache slot table: which request owns which slot of the per-layer pools.

Pools are [capacity + 1, H_kv, S_max, D] per layer; the extra slot is scratch for swaps.
Active slots stay contiguous from 0 and ordered [decoding | prefilling], so a decode step
binds ``pool[:num_decoding]`` and a prefill step ``pool[num_decoding:num_active]`` with no
copies. Keeping that order costs slot-to-slot copies, returned as ``Move``s naming whose K/V
moves; the scheduler turns each into a copy of that request's filled positions only.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Move:
    """The K/V of request ``owner`` moves from slot ``src`` to slot ``dst``."""
    src: int
    dst: int
    owner: str


class SlotTable:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.scratch = capacity  # the pools' extra slot
        self._order: list[str] = []   # request id by slot
        self._decoding = 0            # slots [0, _decoding) decode; the rest prefill

    @property
    def num_active(self) -> int:
        return len(self._order)

    @property
    def num_decoding(self) -> int:
        return self._decoding

    @property
    def free(self) -> int:
        return self.capacity - len(self._order)

    def slot_of(self, rid: str) -> int:
        return self._order.index(rid)

    def decoding(self) -> list[str]:
        return self._order[: self._decoding]

    def prefilling(self) -> list[str]:
        return self._order[self._decoding:]

    def admit(self, rid: str) -> int:
        """A new request takes the first free slot, at the prefilling end."""
        if self.free == 0:
            raise RuntimeError("no free KV slot")
        self._order.append(rid)
        return len(self._order) - 1

    def promote(self, rid: str) -> list[Move]:
        """``rid`` finished its prompt: it moves to the first prefilling slot and starts decoding."""
        slot, first = self.slot_of(rid), self._decoding
        if slot < first:
            raise RuntimeError(f"{rid} is already decoding")
        moves = []
        if slot != first:  # swap with the request at `first` through the scratch slot
            moves = [Move(slot, self.scratch, rid), Move(first, slot, self._order[first]), Move(self.scratch, first, rid)]
            self._order[slot], self._order[first] = self._order[first], self._order[slot]
        self._decoding += 1
        return moves

    def release(self, rid: str) -> list[Move]:
        """``rid`` leaves; the last slot of its group fills the hole, keeping both groups contiguous."""
        slot = self.slot_of(rid)
        moves = []
        if slot < self._decoding:
            last_decoding = self._decoding - 1
            if slot != last_decoding:
                moves.append(Move(last_decoding, slot, self._order[last_decoding]))
                self._order[slot] = self._order[last_decoding]
            last = len(self._order) - 1
            if last != last_decoding:  # a prefilling request moves down into the decoding group's end
                moves.append(Move(last, last_decoding, self._order[last]))
                self._order[last_decoding] = self._order[last]
            self._order.pop()
            self._decoding -= 1
        else:
            last = len(self._order) - 1
            if slot != last:
                moves.append(Move(last, slot, self._order[last]))
                self._order[slot] = self._order[last]
            self._order.pop()
        return moves
