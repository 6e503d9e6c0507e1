"""`python -m slipstream.runtime --actor pkg.mod:Class --rank 0 …`: one actor process (`host.main`);
`python -m slipstream.runtime --fork-server FD`: a fork server that forks actor processes (fork_server.py).

The supervisor starts actors through this package entry point rather than `-m slipstream.runtime.host`
because multiprocessing re-imports a process's main module in every child it starts by spawn or
forkserver, unless that module is a package's `__main__`. The verifier's reward workers come from a
forkserver: with `host` as the main module each of them imported torch and the whole actor runtime,
nearly tripling a worker's resident size (docs/benchmarks.md, "Figures behind runtime/ and tasks/").
A forked actor keeps its server's main module, this one, for the same reason.
"""

import sys

if sys.argv[1:2] == ["--fork-server"]:
    from slipstream.runtime.fork_server import serve

    sys.exit(serve(int(sys.argv[2])))

from slipstream.runtime.host import main

sys.exit(main())
