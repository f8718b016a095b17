"""Run by `tests/test_compilation_cache.py`: runs the example's command line
(`python -m examples.mistral7b ARGS...`) in this process with JAX's compilation-cache events
counted, then prints the counts as one JSON line after the command's own output, keyed by the
event's name without its `/jax/compilation_cache/` prefix (`{"cache_hits": 12, ...}`).

Its own process, because what is measured is a run of the command as a user starts it: the cache
is process-wide JAX configuration the command sets up, and a second run finds its programs only
on disk, in a process that has compiled nothing yet. `examples` must be importable
(`PYTHONPATH` holding the checkout's root).

    PYTHONPATH=. python tests/workers/counted_cli.py build --preset tiny
"""

import collections
import json
import sys

import jax


PREFIX = "/jax/compilation_cache/"


def main(arguments: list[str]) -> None:
    counts: collections.Counter[str] = collections.Counter()
    # Registered before the command imports or compiles anything of its own.
    jax.monitoring.register_event_listener(lambda event, **_: counts.update([event]))
    from examples.mistral7b.__main__ import main as command_line

    sys.argv = ["python -m examples.mistral7b", *arguments]
    command_line()
    cache_events = {k.removeprefix(PREFIX): v for k, v in counts.items() if k.startswith(PREFIX)}
    print(json.dumps(cache_events))


if __name__ == "__main__":
    main(sys.argv[1:])
