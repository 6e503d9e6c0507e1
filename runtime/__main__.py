"""`python -m slipstream.runtime --actor pkg.mod:Class --rank 0 …`: one actor process (`host.main`).

The supervisor starts actors through this package entry point rather than `-m slipstream.runtime.host`
because multiprocessing re-imports a process's main module in every child it starts by spawn or
forkserver, unless that module is a package's `__main__`. The verifier's reward workers come from a
forkserver: with `host` as the main module each of them imported torch and the whole actor runtime,
nearly tripling a worker's resident size (docs/benchmarks.md, "Figures behind runtime/ and tasks/").
"""

import sys

from slipstream.runtime.host import main

sys.exit(main())
