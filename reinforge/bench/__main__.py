"""``python -m reinforge.bench [rollout|train|agent|modes|dpo|serve|table|kernels] ...``, the same as ``reinforge bench``."""

import sys

from reinforge.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
