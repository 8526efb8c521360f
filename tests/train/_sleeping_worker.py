"""A worker for tests/train/test_run_workers.py: writes its pid to the file named by argv[1], then sleeps."""

import os
import sys
import time
from pathlib import Path

Path(sys.argv[1]).with_name(f"pid{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
time.sleep(120)
