"""A module whose import never ends on its own: a fork server's preload that stands for
importing torch on a slow machine, for as long as a test needs (tests/test_ranks.py)."""

import time

while True:
    time.sleep(1)
