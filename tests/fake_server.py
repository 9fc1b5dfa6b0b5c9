"""`python -m tests.fake_server [--test-scheduler MODULE:FUNCTION] ARGS`: launch_server with a test scheduler
(by default the fake one, tests/fake_scheduler.py).

The test harness's way to swap the scheduler: the product takes its scheduler entry point only as a
Python argument of `server.launch_server.main`, never from the environment or its own flags.
"""

import sys

from server.launch_server import main

FAKE_ENTRYPOINT = "tests.fake_scheduler:run_fake_scheduler_process"


def _pop_scheduler(argv: list[str]) -> tuple[str, list[str]]:
    if argv[:1] == ["--test-scheduler"]:
        return argv[1], argv[2:]
    return FAKE_ENTRYPOINT, argv


if __name__ == "__main__":
    entrypoint, sys.argv[1:] = _pop_scheduler(sys.argv[1:])
    main(scheduler_entrypoint=entrypoint)
