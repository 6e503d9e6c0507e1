"""The actor runtime: what every process and the coordinator share, below the actors.

codec (MessagePack bodies, zero-copy tensor frames, validation), transport (ZeroMQ sockets, endpoints,
CURVE), shm (the same-host shared-memory lane), io_thread/inbox/actor/host (one actor process), supervisor
(spawn, handshake, liveness and hang detection, restart, shutdown) and control_socket (its ROUTER),
launcher and agent (where a process starts), placement (devices and cores), config, logs, spans,
progress. The RL step's mechanics (dealing, leases, exactly-once results) are rl/'s.
It imports protocols/ only (tests/test_layers.py).
"""
