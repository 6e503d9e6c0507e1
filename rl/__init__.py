"""The RL control plane: the GRPO loop and what it is made of, above the actors and the process runtime.

loop (the loop top to bottom), run (its verbs), step_work (a step's state and its record), run_config
(TrainConfig and what it resolves to), run_plan (the actors it makes: names, placement, specs), run_dir
(metrics records, samples, checkpoints, resume state), coordinator (the one reader of the supervisor's
inbox: a handler per message type, the verbs), step (the step handle and its metrics), recovery (dead
actors restarted and handed what they lost), leases (idle devices to drafters), ledger (exactly-once
results). It imports actors' configs, engine, tasks, runtime and protocols; cli/ and benchmarks/ import
it, nothing below does (tests/test_layers.py).
"""
