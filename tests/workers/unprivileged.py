"""Run by `tests/test_compilation_cache_directory.py`: runs a command as an ordinary user would,
held by file permissions: where this process is root, it first drops the capabilities that let
root write and read past them (`CAP_DAC_OVERRIDE`, `CAP_DAC_READ_SEARCH`) from its bounding set,
so that the command it then executes has neither. Otherwise it executes the command as it is.

Its own process, because a process cannot give back a capability it holds in effect without
executing another program; dropping them from the bounding set does not touch the test's own
process. Exits with `UNAVAILABLE` when the capabilities cannot be dropped (a root without
`CAP_SETPCAP`, or a system without `prctl`), for the test to skip.

    python tests/workers/unprivileged.py COMMAND [ARGS...]
"""

import ctypes
import os
import sys


UNAVAILABLE = 77
_PR_CAPBSET_DROP = 24  # <linux/prctl.h>
_CAP_DAC_OVERRIDE = 1  # <linux/capability.h>
_CAP_DAC_READ_SEARCH = 2


def main(command: list[str]) -> None:
    if os.geteuid() == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
                if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        except (OSError, AttributeError) as e:
            print(f"cannot drop root's file-permission capabilities: {e}", file=sys.stderr)
            sys.exit(UNAVAILABLE)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
