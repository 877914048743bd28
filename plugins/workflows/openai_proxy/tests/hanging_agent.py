"""A script agent that records its process id and hangs without a call (killed at the timeout)."""

import os
import sys
import time
from pathlib import Path

Path(sys.argv[1], os.environ["OPENAI_API_KEY"]).write_text(str(os.getpid()))
time.sleep(3600)
