"""Start a Shepherd worker: ``python worker.py`` does what ``shepherd worker`` does, with the same flags.

The worker itself is processes/worker.py.
"""

import sys

from shepherd.cli import main

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
