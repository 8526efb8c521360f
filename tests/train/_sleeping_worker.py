"""A worker for tests/train/test_run_workers.py: writes its pid to the file named by argv[1], then sleeps.

The pid file appears whole (written under another name, then renamed): a test that polls for it must never
read it half-written (it once read an empty file under load)."""

import os
import sys
import time
from pathlib import Path

pid_file = Path(sys.argv[1]).with_name(f"pid{os.environ.get('RANK', '0')}")
tmp = pid_file.with_name(pid_file.name + ".tmp")
tmp.write_text(str(os.getpid()))
os.replace(tmp, pid_file)
time.sleep(120)
