"""Run a command; print its wall time and its peak resident memory (largest child).

python .ci/timed.py python -m pytest
"""

import resource
import subprocess
import sys
import time


start = time.perf_counter()
code = subprocess.call(sys.argv[1:])
seconds = time.perf_counter() - start
peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
command = " ".join(sys.argv[1:])
print(f"[{command}] {seconds:.0f} s wall, peak memory {peak_mib:.0f} MiB")
sys.exit(code)
