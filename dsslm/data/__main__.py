"""`python -m dsslm.data prepare --input PATH [PATH ...] --out DATA_DIR ...`"""
import sys

from dsslm.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
