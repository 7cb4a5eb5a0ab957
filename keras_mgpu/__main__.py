"""`python -m keras_mgpu`: the `keras-mgpu` command (demo, info, report)."""

import sys

from keras_mgpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
