"""Compiled programs kept by content: the one cache type of every compiled-write path.

Three recipes compile code keyed by what determines it: a build's writes
(`writes.compile_writes`), a load's chunk writes (`chunk_writes`) and `init.chunked`'s tile draws
(`eqx_lean._init`). Each keeps its own key, on purpose: each leaves out what cannot change its
program (a chunk write never depends on the random settings, say) and includes the settings
that change values without changing a traced program (`settings_key`) where they matter. They
share the cache itself, and `clear_caches` empties every one.
"""

import collections
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax


def settings_key() -> Hashable:
    """The settings that change random values or numerics without changing a traced program."""
    config = jax.config
    return tuple(
        (name, str(getattr(config, name, None)))
        for name in (
            "jax_threefry_partitionable",
            "jax_enable_x64",
            "jax_default_prng_impl",
            "jax_default_matmul_precision",
        )
    )


_ALL_CACHES: "weakref.WeakSet[CompiledCache]" = weakref.WeakSet()
_OTHER_CLEARS: list[Callable[[], None]] = []


class CompiledCache:
    """Compiled programs by a key of their content (each user's own recipe).

    Bounded (least recently used entries go first) and thread-safe. It holds compiled programs
    and hashable descriptions only: never the user's function, nor the arrays it closes over.
    Every instance is emptied by `clear_caches`.

    **Arguments:**

    - `max_entries`: how many programs it keeps at most.
    """

    def __init__(self, max_entries: int = 32):
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        _ALL_CACHES.add(self)

    def get(self, key: Hashable) -> Any | None:
        """The program kept under `key` (now the most recently used), or `None`."""
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
            return self._entries[key]

    def put(self, key: Hashable, value: Any) -> None:
        """Keeps `value` under `key`, forgetting the least recently used beyond `max_entries`."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def on_clear(clear: Callable[[], None]) -> None:
    """Has `clear_caches` call `clear` too (for a `functools` cache of compiled code)."""
    _OTHER_CLEARS.append(clear)


def clear_caches() -> None:
    """Forgets every compiled write `eqx_lean` keeps for reuse (for example to free memory).

    Later builds compile their writes again. JAX's own caches are cleared by
    `jax.clear_caches()`, which this does not call.
    """
    for cache in list(_ALL_CACHES):
        cache.clear()
    for clear in _OTHER_CLEARS:
        clear()
