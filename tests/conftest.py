"""Session-wide test settings.

scripts/generate.py keeps a persistent XLA compilation cache under ~/.cache by
default; the tests run it in-process and in subprocesses, and must not write
into the user's home or reuse programs compiled by an earlier run. The one test
of the cache (tests/test_generate_cli.py) passes a temporary directory.
"""

import os

os.environ["PAGEDJAX_COMPILATION_CACHE"] = "off"
