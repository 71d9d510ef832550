"""When the CLI package was imported: the process start where /proc cannot tell it.

Its own module, imported by the package's __init__, so that report.process_start can read
it without importing the CLI package's body, which is what the command modules import.
"""

import time

IMPORTED_AT = time.time()
