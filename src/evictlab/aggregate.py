"""`python -m evictlab.aggregate SWEEP_DIR...`: see evictlab.analysis.aggregate."""

import sys

from evictlab.analysis.aggregate import main

if __name__ == "__main__":
    sys.exit(main())
