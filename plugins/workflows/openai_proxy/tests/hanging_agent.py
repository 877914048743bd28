"""A script agent that records its process id and hangs without a call (killed at the timeout)."""

import os
import sys
import time
from pathlib import Path

# written whole under a dotted name, then renamed: a reader never sees an empty record
record = Path(sys.argv[1], os.environ["OPENAI_API_KEY"])
partial = record.with_name(f".{record.name}.partial")
partial.write_text(str(os.getpid()))
os.replace(partial, record)
time.sleep(3600)
