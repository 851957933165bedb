"""`python -m evictlab.report SWEEP_DIR`: see evictlab.analysis.report."""

import sys

from evictlab.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
