"""KV block pool with a prefix cache kept per prompt segment (vLLM's block-hash cache, aggregated).

NOTE: vLLM hashes every full 16-token block, chained to the block before it, and keeps freed
blocks in an LRU free queue from which they can still be hit until evicted. A prompt here is a
chain of segments whose ids are unique for their content and everything before them, so the
cache only needs, per segment, how many of its blocks are cached (from the segment's start)
and who holds them. All updates are arithmetic on block counts, never per token or per block.

A block belongs to the segment in which it ends (a block straddling two segments is unique to
the later one because ids are chained). Every block in the pool is exactly one of:
- free and empty (never filled, or its cached content evicted);
- held: a cached segment block referenced by a live execution, or a private block of one
  execution (its partial last prompt block, its output tokens);
- free and cached: a segment block nobody holds; still hittable, evictable in LRU order of
  release (a segment's tail first, like vLLM's reversed free order).

Simplifications (documented): output-token blocks are freed as empty (retries resend the
prompt only, so they are never hit); when two executions of one call compute the same blocks
concurrently, the later one adopts the cached copy instead of keeping a duplicate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

__all__ = ["BlockPool", "layout_and_length", "prompt_layout"]


def prompt_layout(segments: Sequence[tuple[Hashable, int]], block_size: int) -> list[tuple[Hashable, int]]:
    """``(segment_id, full blocks owned)`` for each segment: the blocks that end inside it."""
    return layout_and_length(segments, block_size)[0]


def layout_and_length(
    segments: Sequence[tuple[Hashable, int]], block_size: int
) -> tuple[list[tuple[Hashable, int]], int]:
    """``prompt_layout`` and the prompt's length in tokens, in one pass."""
    layout: list[tuple[Hashable, int]] = []
    offset = 0
    for segment_id, n_tokens in segments:
        if n_tokens <= 0:
            raise ValueError(f"segment {segment_id!r} has {n_tokens} tokens; every segment needs >= 1")
        end = offset + n_tokens
        layout.append((segment_id, end // block_size - offset // block_size))
        offset = end
    return layout, offset


class _Segment:
    __slots__ = ("cached", "hist", "max_held")

    def __init__(self) -> None:
        self.cached = 0  # contiguous cached blocks from the segment's first owned block
        self.hist: dict[int, int] = {}  # blocks held -> number of holders
        self.max_held = 0


class BlockPool:
    """The GPU's KV blocks: allocation, holding cached segment blocks, LRU eviction."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free_empty = num_blocks
        self.free_cached = 0
        self._segments: dict[Hashable, _Segment] = {}
        # segments with evictable (free, cached) blocks, least recently released first
        self._lru: OrderedDict[Hashable, None] = OrderedDict()

    # --- queries --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (empty ones, then evicting cached ones)."""
        return self.free_empty + self.free_cached

    @property
    def usage(self) -> float:
        """Share of blocks held by live executions (vLLM's ``kv_cache_usage_perc``, 0-1)."""
        return 1.0 - self.num_free / self.num_blocks

    def cached_blocks(self, segment_id: Hashable) -> int:
        seg = self._segments.get(segment_id)
        return seg.cached if seg is not None else 0

    def lookup(self, layout: Sequence[tuple[Hashable, int]], max_blocks: int) -> tuple[list[int], int, int]:
        """Longest cached prefix of ``layout``, at most ``max_blocks`` blocks.

        Returns the blocks hit per segment, the total, and how many of them are currently
        free (touching them takes them out of the free pool).
        """
        hits: list[int] = []
        total = 0
        free_hit = 0
        if not self.enable_caching:
            return [0] * len(layout), 0, 0
        for segment_id, owned in layout:
            seg = self._segments.get(segment_id)
            room = max_blocks - total
            if seg is None or room <= 0:
                hits.append(0)
                break
            h = min(seg.cached, owned, room)
            hits.append(h)
            total += h
            free_hit += max(0, h - seg.max_held)
            if h < owned:
                break
        hits.extend([0] * (len(layout) - len(hits)))
        return hits, total, free_hit

    # --- holding --------------------------------------------------------------------
    def _set_hold(self, segment_id: Hashable, seg: _Segment, old: int, new: int, grow_to: int = 0) -> None:
        """Change one holder's count from ``old`` to ``new``; ``grow_to`` first extends the
        segment's cached blocks with blocks the holder filled (never free before)."""
        if old == new:
            return
        cached = seg.cached
        max_held = seg.max_held
        evictable_before = cached - max_held
        if grow_to > cached:
            seg.cached = cached = grow_to
        hist = seg.hist
        if old > 0:
            left = hist[old] - 1
            if left:
                hist[old] = left
            else:
                del hist[old]
        if new > 0:
            hist[new] = hist.get(new, 0) + 1
        if new > max_held:
            seg.max_held = max_held = new
        elif old == max_held and old not in hist:
            seg.max_held = max_held = max(hist) if hist else 0
        evictable_after = cached - max_held
        self.free_cached += evictable_after - evictable_before
        lru = self._lru
        if evictable_after > 0:
            if segment_id not in lru:
                lru[segment_id] = None
            elif evictable_after > evictable_before:
                lru.move_to_end(segment_id)
        elif segment_id in lru:
            del lru[segment_id]
        if cached == 0 and not hist:
            del self._segments[segment_id]

    def hold(self, segment_id: Hashable, old: int, new: int) -> None:
        """An execution now holds ``new`` (was ``old``) cached blocks of a segment."""
        seg = self._segments.get(segment_id)
        if seg is None:
            if new == 0:
                return
            raise ValueError(f"cannot hold blocks of segment {segment_id!r}: nothing cached")
        if new > seg.cached:
            raise ValueError(f"cannot hold {new} blocks of segment {segment_id!r}: {seg.cached} cached")
        self._set_hold(segment_id, seg, old, new)

    def hold_hits(self, layout: Sequence[tuple[Hashable, int]], hits: list[int]) -> None:
        """A newly admitted execution holding nothing now holds the blocks ``lookup`` found:
        ``hits[j]`` blocks of each segment of its ``layout`` (all cached)."""
        segments = self._segments
        for j, h in enumerate(hits):
            if h:
                segment_id = layout[j][0]
                self._set_hold(segment_id, segments[segment_id], 0, h)

    def commit(self, segment_id: Hashable, held: int, upto: int) -> int:
        """An execution holding ``held`` blocks of a segment has filled its private blocks up
        to ``upto``: they become cached blocks of the segment, held by it. Returns the number
        of private blocks that were duplicates of already-cached ones, now freed as empty."""
        if upto <= held:
            return 0
        if not self.enable_caching:
            raise ValueError("commit() needs prefix caching on; keep the blocks private instead")
        seg = self._segments.get(segment_id)
        if seg is None:
            seg = self._segments[segment_id] = _Segment()
        duplicates = max(0, min(upto, seg.cached) - held)
        # Adopting cached copies that are currently free takes them out of the free pool;
        # the duplicates we computed go back as empty blocks: the pool size is unchanged.
        self.free_empty += duplicates
        self._set_hold(segment_id, seg, held, upto, grow_to=upto)
        return duplicates

    # --- allocation -----------------------------------------------------------------
    def allocate(self, n: int) -> bool:
        """Take ``n`` blocks (empty first, then evicting LRU cached ones); False if too few."""
        if n <= 0:
            return True
        if n > self.free_empty + self.free_cached:
            return False
        short = n - self.free_empty
        if short > 0:
            self._evict(short)
        self.free_empty -= n
        return True

    def release(self, layout: Sequence[tuple[Hashable, int]], held: list[int] | None, private: int) -> None:
        """An execution leaves: it no longer holds ``held[j]`` cached blocks of each segment of
        its ``layout`` (None: none; the list is zeroed) and returns ``private`` blocks as empty."""
        if held is not None:
            segments = self._segments
            for j, h in enumerate(held):
                if h:
                    segment_id = layout[j][0]
                    self._set_hold(segment_id, segments[segment_id], h, 0)
                    held[j] = 0
        self.free_empty += private

    def _evict(self, n: int) -> None:
        lru = self._lru
        segments = self._segments
        while n > 0:
            segment_id = next(iter(lru))
            seg = segments[segment_id]
            evictable = seg.cached - seg.max_held
            k = min(evictable, n)
            seg.cached -= k
            self.free_cached -= k
            self.free_empty += k
            n -= k
            if evictable == k:
                del lru[segment_id]
                if seg.cached == 0 and not seg.hist:
                    del segments[segment_id]

    def held_blocks(self) -> int:
        """Cached segment blocks held by live executions (O(segments))."""
        return sum(seg.max_held for seg in self._segments.values())

    def check(self) -> None:
        """Verify the pool's invariants (tests and debugging; O(segments))."""
        held = 0
        cached_free = 0
        for segment_id, seg in self._segments.items():
            assert seg.max_held == (max(seg.hist) if seg.hist else 0), segment_id
            assert seg.cached >= seg.max_held, segment_id
            cached_free += seg.cached - seg.max_held
            held += seg.max_held
            assert (seg.cached > seg.max_held) == (segment_id in self._lru), segment_id
        assert cached_free == self.free_cached, (cached_free, self.free_cached)
        assert self.free_empty >= 0 and self.free_cached >= 0
        assert held + self.free_empty + self.free_cached <= self.num_blocks
