"""When this process started, stamped as the CLI package is imported.

Its own module, imported by the package's __init__, so that report.process_start can read
it without importing the CLI package's body, which is what the command modules import.

Not /proc's start time: that is the fork, which exec keeps, so a shell that waited (or ran
for minutes) before `exec python` would count as interpreter start-up. Up to this import
the process has been the interpreter starting, one thread on the CPU, so the CPU time it
has used since the fork is that start-up (a waiting shell uses next to none); it leaves
out only the interpreter's waits on a cold disk. This works the same on every platform.
"""

import time

STARTED_AT = time.time() - time.process_time()
