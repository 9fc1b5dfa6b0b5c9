"""`python -m tests.fake_server ARGS`: launch_server with the fake scheduler (tests/fake_scheduler.py).

The test harness's way to swap the scheduler: the product takes its scheduler entry point only as a
Python argument of `server.launch_server.main`, never from the environment.
"""

from server.launch_server import main

FAKE_ENTRYPOINT = "tests.fake_scheduler:run_fake_scheduler_process"

if __name__ == "__main__":
    main(scheduler_entrypoint=FAKE_ENTRYPOINT)
