"""One deterministic instance of every wire message (shared by round-trip and golden-bytes tests)."""

import msgspec
import torch

from slipstream.protocols import Message, control, drafter, environment, learner, node, reward, rollout


def samples() -> dict[str, Message]:
    """kind → an instance with every field set; tensors small enough to inline unless noted."""
    sampling = rollout.SamplingSpec(temperature=0.7, top_p=0.9, top_k=20, max_tokens=128, stop_token_ids=[2])
    out: list[Message] = [
        control.Hello(
            role="rollout", rank=1, pid=4242, host="node-a", data_endpoint="ipc:///tmp/x", protocol_version=1
        ),
        control.Init(
            config=msgspec.Raw(msgspec.msgpack.encode({"lr": 1e-6})),
            run_dir="/runs/r1",
            peers={"rollout:0": "ipc:///tmp/r0"},
            heartbeat_s=0.5,
            threads=2,
        ),
        control.Ready(role="rollout", rank=1),
        control.Heartbeat(seq=7, sent_ns=123456789, handled=3, queued=1),
        control.Ping(seq=1, sent_ns=99),
        control.Pong(seq=1, sent_ns=99),
        control.Status(
            topic="progress", fields={"step": 3, "loss": 0.5, "ok": True, "note": "x", "none": None}
        ),
        control.Idle(role="rollout", rank=0, policy_version=4),
        control.Lease(lease_id=9, device="cpu:0", threads=1, cpus=[0]),
        control.Preempt(lease_id=9, reason="step done", sent_ns=5),
        control.Released(lease_id=9, latency_ns=1000),
        control.Shutdown(reason="done"),
        control.SaveCheckpoint(step=4, path="run/checkpoints/step-4/learner.pt"),
        control.CheckpointSaved(step=4, path="run/checkpoints/step-4/learner.pt", version=4, error=""),
        control.Failed(request="control.checkpoint", error="ValueError: bad path"),
        control.Dead(role="drafter", rank=0, reason="OOM", exit_code=137),
        control.Peers(peers={"rollout:1": "ipc:///tmp/r1"}),
        sampling,
        rollout.GenerateRequest(
            group_id=3,
            prompt_ids=torch.arange(6),
            num_samples=4,
            seed=11,
            sampling=sampling,
            policy_version=2,
            row_json='{"answer":"2"}',
            learn_at="learner:0",
            attempt=1,
        ),
        # A 2-turn episode's: the environment's token (mask False) has log-prob 0.
        rollout.Completion(
            group_id=3,
            sample_index=1,
            token_ids=torch.tensor([5, 6, 7]),
            logprobs=torch.tensor([-0.5, 0.0, -0.25]),
            finish_reason="stop",
            policy_version=2,
            accept_length=2.5,
            policy_mask=torch.tensor([True, False, True]),
            prompt_ids=torch.tensor([1, 2]),
            turns=2,
            env_wait_s=0.75,
            env_reward=1.0,
            error=None,
            text="<answer>2</answer>",
            attempt=1,
        ),
        rollout.IterationStats(
            rank=0,
            iteration=10,
            batch_size=4,
            arm="ngram:d4",
            drafted=16,
            accepted=9,
            committed=13,
            iter_s=0.05,
        ),
        reward.ScoreRequest(
            group_id=3,
            sample_index=1,
            prompt="1+1?",
            completion="<answer>2</answer>",
            row_json='{"answer":"2"}',
            policy_version=2,
        ),
        # The invalid form: it is the one a bad reward function produces, and it must travel.
        reward.Reward(
            group_id=3,
            sample_index=1,
            reward=None,
            error="timeout after 2.0 s",
            elapsed_s=2.0,
            policy_version=2,
        ),
        reward.RewardCalls(
            terms={"judge": reward.CallTotals(calls=2, samples=12, seconds=1.5, max_batch=8, invalid=1)}
        ),
        learner.SampleReceipt(
            group_id=3,
            sample_index=1,
            tokens=3,
            finish_reason="stop",
            policy_version=2,
            accept_length=2.5,
            text="<answer>2</answer>",
            opening="00ff00ff00ff00ff",
            turns=2,
            env_wait_s=0.25,
            env_reward=1.0,
            error=None,
            attempt=1,
        ),
        environment.OpenEpisode(episode_id="rollout:0/3:1/0", row_json='{"question":"1+1?"}'),
        environment.EpisodeOpened(
            episode_id="rollout:0/3:1/0",
            messages=[environment.ChatMessage(role="user", content="1+1?")],
            stop_sequences=["</calc>"],
            error=None,
            incarnation="41-ab",
        ),
        environment.Turn(episode_id="rollout:0/3:1/0", turn=1, text="<calc>1+1</calc>", token_ids=[5, 6]),
        environment.Answer(
            episode_id="rollout:0/3:1/0",
            turn=1,
            text="<result>2</result>",
            role="tool",
            done=True,
            reward=1.0,
            error=None,
            unknown=False,
            elapsed_s=0.5,
        ),
        environment.CloseEpisode(episode_id="rollout:0/3:1/0"),
        environment.EnvironmentUp(incarnation="41-ab"),
        environment.RolloutUp(owner="rollout:0", incarnation="42-cd"),
        learner.TrainStep(
            step=1,
            version=2,
            groups=[learner.GroupPlan(group_id=3, prompt_ids=torch.arange(4), rewards=[1.0, None])],
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            samples_path="run/samples/step-1.jsonl",
            replay=False,
        ),
        learner.PushWeights(version=3, to=["rollout:1"], head_to=["drafter:1"], delta_base={"rollout:1": 2}),
        learner.WeightUpdate(
            version=3,
            bucket=0,
            num_buckets=1,
            names=["w"],
            tensors=[torch.ones(2, 2, dtype=torch.bfloat16)],
            checksum="abc",
        ),
        learner.WeightAck(version=3, role="rollout", rank=0, ok=True, error=None),
        learner.WeightsPushed(version=3, head_only=False, full_bytes=100, wire_bytes=40, bytes=100, deltas=1),
        learner.StepStats(
            step=1,
            version=3,
            loss=0.25,
            grad_norm=1.5,
            tokens=100,
            elapsed_s=2.0,
            metrics={"ratio_mean": 1.0},
        ),
        drafter.HiddenStates(
            group_id=3,
            sample_index=1,
            token_ids=torch.arange(3),
            hidden=torch.full((3, 2), 0.5, dtype=torch.bfloat16),
            response_start=1,
            policy_version=2,
        ),
        drafter.DrafterUpdate(
            version=1,
            policy_version=2,
            names=["fc"],
            tensors=[torch.zeros(2, dtype=torch.float16)],
            checksum="d",
        ),
        drafter.HeadAck(rank=0, version=3, ok=False, why="bucket 0: checksum", checksum=""),
        drafter.DrafterStats(rank=0, version=1, steps=10, loss=0.5, buffer_tokens=1000, elapsed_s=1.0),
        drafter.DrafterDelta(
            rank=1,
            base_version=4,
            policy_version=2,
            steps=3,
            tokens=300,
            elapsed_s=0.5,
            final=False,
            names=["fc"],
            tensors=[torch.full((2,), -0.5)],
        ),
        node.AgentHello(
            node=1, host="node-b", address="10.0.0.2", pid=77, cores=16, gpus=8, protocol_version=5
        ),
        node.Launch(
            name="rollout:3",
            actor="slipstream.actors.rollout:RolloutActor",
            rank=3,
            env={"OMP_NUM_THREADS": "1"},
            cpus=[3],
            data_port=29519,
            handshake_timeout_s=120.0,
        ),
        node.Launched(name="rollout:3", pid=4321, error=""),
        node.Exited(name="rollout:3", pid=4321, code=-9),
        node.Kill(name="rollout:3", signal=9),
        node.StopAgent(reason="done"),
    ]
    return {m.kind: m for m in out}


def equal(a: object, b: object) -> bool:
    """Structural equality that compares tensors by dtype, shape and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, msgspec.Raw):
        return isinstance(b, msgspec.Raw) and bytes(a) == bytes(b)
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(equal(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(equal(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a == b
