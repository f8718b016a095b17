"""Run by `tests/test_docs.py`: one Python interpreter that runs a page's code blocks one after
another in one namespace, as a reader pasting them into `python` would. Reads the blocks as JSON
lines on stdin, `{"code": "...", "where": "docs/page.md:12"}`; whatever a block prints goes to
stderr (the test's log), and stdout carries one status line per block, `ok` or `failed`.

Its own process, because a reader's session starts fresh, with the page's environment (its
device count, read when JAX starts) and in a scratch directory: the blocks write files there
and import from it.

    python tests/workers/doc_session.py < BLOCKS.jsonl
"""

import json
import os
import sys
import traceback
from typing import Any


def main() -> None:
    # `python` itself puts the working directory first on `sys.path`; for this file it put this
    # folder there instead.
    sys.path[0] = ""
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the blocks' own output, `print` included, goes to the log
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for line in sys.stdin:
        block = json.loads(line)
        try:
            exec(compile(block["code"], block["where"], "exec"), namespace)
            status = "ok"
        except BaseException:
            traceback.print_exc()
            status = "failed"
        sys.stdout.flush()
        sys.stderr.flush()
        report.write(status + "\n")
        report.flush()


if __name__ == "__main__":
    main()
