"""The APScheduler 4 tests run in their own environment (see tests/test_apscheduler4.py).

In the main environment ``apscheduler`` is 3.x: collect nothing here.
"""

from importlib.metadata import version

if int(version("apscheduler").split(".")[0]) < 4:
    collect_ignore_glob = ["test_*.py"]
