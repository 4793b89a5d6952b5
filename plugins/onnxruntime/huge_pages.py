"""A session's weights on 2 MiB pages.

A batch-1 decode step streams every weight once (SmolLM2-135M float32: 540 MB a token), so it
runs at the memory system's read rate. Where transparent huge pages are set to `madvise` (the
default of many distributions), ONNX Runtime's buffers, its prepacked weights among them, get
4 KiB pages: a TLB miss every 4 KiB of weights, each a two-level page walk inside a virtual
machine. benchmarks/cpu_matmul_b1.py measured the same reads 1.2–1.3× faster from 2 MiB pages
on one core (docs/benchmarks.md, "Why float32 batch 1 cannot stream faster").

So after a session loads, the anonymous memory it added and the heap are collapsed onto 2 MiB
pages (MADV_COLLAPSE, Linux 6.1+: synchronous, the contents kept; it works whatever the
system-wide THP setting, and refuses memory advised MADV_NOHUGEPAGE, as the KV pools are). Other
mappings keep their pages, and later allocations are not advised. Where the kernel cannot (older
kernels, another OS), nothing changes. Only the runtime's long-lived sessions ask for it
(session(..., huge_pages=True)): a build's one-shot sessions would pay the copy for nothing.
A float32 SmolLM2 engine decodes 1.15–1.18× faster at batch 1 and 8 for it
(benchmarks/cpu_huge_pages.py, one thread)."""
from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25
MAPS = Path("/proc/self/maps")
# The kernel's answers when it had no 2 MiB page to give: none free even after compaction
# (ENOMEM), or none the cgroup could be charged for (EBUSY). EAGAIN is a page busy for a moment.
NO_FREE_PAGE = (errno.ENOMEM, errno.EBUSY)

log = logging.getLogger(__name__)

Range = tuple[int, int]  # [start, end) of a mapping, in bytes


def anonymous_ranges(heap_only: bool = False) -> list[Range]:
    """This process's writable anonymous mappings (the heap included), or its heap alone; sorted."""
    ranges = []
    for line in MAPS.read_text().splitlines():
        fields = line.split()
        heap = len(fields) >= 6 and fields[5] == "[heap]"
        if fields[1].startswith("rw") and (heap or (len(fields) < 6 and not heap_only)):
            start, end = (int(v, 16) for v in fields[0].split("-"))
            ranges.append((start, end))
    return sorted(ranges)


def added_ranges(before: list[Range], after: list[Range]) -> list[Range]:
    """The parts of ``after``'s ranges that none of ``before``'s (sorted, disjoint) covered."""
    starts = [s for s, _ in before]
    added = []
    for start, end in after:
        cursor = start
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(before) and before[i][0] < end:
            b_start, b_end = before[i]
            if b_end > cursor:
                if b_start > cursor:
                    added.append((cursor, b_start))
                cursor = max(cursor, b_end)
            i += 1
        if cursor < end:
            added.append((cursor, end))
    return added


@dataclass(frozen=True)
class Collapsed:
    """What MADV_COLLAPSE made of some ranges, in bytes."""
    done: int  # now on 2 MiB pages
    no_free_page: int  # the kernel had no 2 MiB page for (a fragmented or full memory, a cgroup's limit)
    refused: int  # not eligible: never touched, advised MADV_NOHUGEPAGE, ...


def collapse(ranges: list[Range]) -> Collapsed:
    """MADV_COLLAPSE on each whole 2 MiB page inside ``ranges``, one at a time, a busy page
    tried once more."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = no_free_page = refused = 0
    for start, end in ranges:
        for page in range(-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE, HUGE_PAGE):
            for _ in range(2):
                ok = libc.madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0
                if ok or ctypes.get_errno() != errno.EAGAIN:
                    break
            if ok:
                done += HUGE_PAGE
            elif ctypes.get_errno() in NO_FREE_PAGE:
                no_free_page += HUGE_PAGE
            else:
                refused += HUGE_PAGE
    return Collapsed(done, no_free_page, refused)


@contextmanager
def collapse_added():
    """Collapses onto 2 MiB pages the anonymous memory the body added (a session's weights)."""
    if not sys.platform.startswith("linux") or not MAPS.is_file():
        yield
        return
    before = anonymous_ranges()
    yield
    # The whole heap too: malloc puts part of the weights into heap memory freed before the
    # session (a float32 SmolLM2 engine: 55 of its 620 MB of heap), which no diff would find.
    result = collapse(merged(added_ranges(before, anonymous_ranges()) + anonymous_ranges(heap_only=True)))
    log.debug("weights onto 2 MiB pages: %d MiB moved, %d MiB found no free 2 MiB page",
              result.done >> 20, result.no_free_page >> 20)


def merged(ranges: list[Range]) -> list[Range]:
    """``ranges`` sorted, overlapping or touching ones joined (so no page is collapsed twice)."""
    out: list[Range] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def collapse_works() -> bool:
    """Whether this kernel collapses memory onto 2 MiB pages for this process (a touched,
    aligned 2 MiB of our own tried once)."""
    import mmap

    if not sys.platform.startswith("linux"):
        return False
    area = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc's memory
    buf = (ctypes.c_char * len(area)).from_buffer(area)
    try:
        start = -(-ctypes.addressof(buf) // HUGE_PAGE) * HUGE_PAGE
        ctypes.memset(start, 1, HUGE_PAGE)
        return collapse([(start, start + HUGE_PAGE)]).done == HUGE_PAGE
    finally:
        del buf  # the buffer's export ends before the map closes
        area.close()
