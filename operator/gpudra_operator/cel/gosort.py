"""Go's ``sort.Slice`` (pattern-defeating quicksort, Go's sort/zsortfunc.go, unchanged since Go
1.19), for where CEL's results depend on its order of equal elements: ``sortBy`` with equal keys
(ext/lists.go sorts the indices with it). It is not stable past 12 elements, and deterministic,
so the same steps give the same order. Functions are named after upstream's."""

from __future__ import annotations

from collections.abc import Callable

Less = Callable[[int, int], bool]
Swap = Callable[[int, int], None]

_MAX_INSERTION = 12
_UNKNOWN, _INCREASING, _DECREASING = 0, 1, 2
_MASK64 = 2**64 - 1


def sort_slice(length: int, less: Less, swap: Swap) -> None:
    """``sort.Slice``: ``less`` and ``swap`` on indices of a sequence of ``length`` items."""
    _pdqsort(less, swap, 0, length, length.bit_length())


def _insertion_sort(less: Less, swap: Swap, a: int, b: int) -> None:
    for i in range(a + 1, b):
        j = i
        while j > a and less(j, j - 1):
            swap(j, j - 1)
            j -= 1


def _sift_down(less: Less, swap: Swap, lo: int, hi: int, first: int) -> None:
    root = lo
    while True:
        child = 2 * root + 1
        if child >= hi:
            return
        if child + 1 < hi and less(first + child, first + child + 1):
            child += 1
        if not less(first + root, first + child):
            return
        swap(first + root, first + child)
        root = child


def _heap_sort(less: Less, swap: Swap, a: int, b: int) -> None:
    first, hi = a, b - a
    for i in range((hi - 1) // 2, -1, -1):
        _sift_down(less, swap, i, hi, first)
    for i in range(hi - 1, -1, -1):
        swap(first, first + i)
        _sift_down(less, swap, 0, i, first)


def _pdqsort(less: Less, swap: Swap, a: int, b: int, limit: int) -> None:
    was_balanced = was_partitioned = True
    while True:
        length = b - a
        if length <= _MAX_INSERTION:
            _insertion_sort(less, swap, a, b)
            return
        if limit == 0:
            _heap_sort(less, swap, a, b)
            return
        if not was_balanced:
            _break_patterns(swap, a, b)
            limit -= 1
        pivot, hint = _choose_pivot(less, a, b)
        if hint == _DECREASING:
            _reverse_range(swap, a, b)
            pivot = (b - 1) - (pivot - a)
            hint = _INCREASING
        if was_balanced and was_partitioned and hint == _INCREASING and _partial_insertion_sort(less, swap, a, b):
            return
        if a > 0 and not less(a - 1, pivot):
            a = _partition_equal(less, swap, a, b, pivot)
            continue
        mid, was_partitioned = _partition(less, swap, a, b, pivot)
        left, right = mid - a, b - mid
        threshold = length // 8
        if left < right:
            was_balanced = left >= threshold
            _pdqsort(less, swap, a, mid, limit)
            a = mid + 1
        else:
            was_balanced = right >= threshold
            _pdqsort(less, swap, mid + 1, b, limit)
            b = mid


def _partition(less: Less, swap: Swap, a: int, b: int, pivot: int) -> tuple[int, bool]:
    swap(a, pivot)
    i, j = a + 1, b - 1
    while i <= j and less(i, a):
        i += 1
    while i <= j and not less(j, a):
        j -= 1
    if i > j:
        swap(j, a)
        return j, True
    swap(i, j)
    i, j = i + 1, j - 1
    while True:
        while i <= j and less(i, a):
            i += 1
        while i <= j and not less(j, a):
            j -= 1
        if i > j:
            break
        swap(i, j)
        i, j = i + 1, j - 1
    swap(j, a)
    return j, False


def _partition_equal(less: Less, swap: Swap, a: int, b: int, pivot: int) -> int:
    swap(a, pivot)
    i, j = a + 1, b - 1
    while True:
        while i <= j and not less(a, i):
            i += 1
        while i <= j and less(a, j):
            j -= 1
        if i > j:
            return i
        swap(i, j)
        i, j = i + 1, j - 1


def _partial_insertion_sort(less: Less, swap: Swap, a: int, b: int) -> bool:
    max_steps, shortest_shifting = 5, 50
    i = a + 1
    for _ in range(max_steps):
        while i < b and not less(i, i - 1):
            i += 1
        if i == b:
            return True
        if b - a < shortest_shifting:
            return False
        swap(i, i - 1)
        if i - a >= 2:
            for j in range(i - 1, 0, -1):
                if not less(j, j - 1):
                    break
                swap(j, j - 1)
        if b - i >= 2:
            for j in range(i + 1, b):
                if not less(j, j - 1):
                    break
                swap(j, j - 1)
    return False


def _break_patterns(swap: Swap, a: int, b: int) -> None:
    length = b - a
    if length < 8:
        return
    random = length  # xorshift, seeded with the length
    modulus = 1 << length.bit_length()
    for index in range(a + (length // 4) * 2 - 1, a + (length // 4) * 2 + 2):
        random ^= (random << 13) & _MASK64
        random ^= random >> 7
        random ^= (random << 17) & _MASK64
        other = random & (modulus - 1)
        if other >= length:
            other -= length
        swap(index, a + other)


def _choose_pivot(less: Less, a: int, b: int) -> tuple[int, int]:
    shortest_ninther, max_swaps = 50, 4 * 3
    length = b - a
    swaps = [0]
    i, j, k = a + length // 4 * 1, a + length // 4 * 2, a + length // 4 * 3
    if length >= 8:
        if length >= shortest_ninther:
            i = _median(less, i - 1, i, i + 1, swaps)
            j = _median(less, j - 1, j, j + 1, swaps)
            k = _median(less, k - 1, k, k + 1, swaps)
        j = _median(less, i, j, k, swaps)
    if swaps[0] == 0:
        return j, _INCREASING
    if swaps[0] == max_swaps:
        return j, _DECREASING
    return j, _UNKNOWN


def _order2(less: Less, a: int, b: int, swaps: list[int]) -> tuple[int, int]:
    if less(b, a):
        swaps[0] += 1
        return b, a
    return a, b


def _median(less: Less, a: int, b: int, c: int, swaps: list[int]) -> int:
    a, b = _order2(less, a, b, swaps)
    b, c = _order2(less, b, c, swaps)
    a, b = _order2(less, a, b, swaps)
    return b


def _reverse_range(swap: Swap, a: int, b: int) -> None:
    i, j = a, b - 1
    while i < j:
        swap(i, j)
        i, j = i + 1, j - 1
