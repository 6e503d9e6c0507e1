"""The base of every wire message and the protocol version peers compare in the handshake."""

from typing import Annotated, ClassVar

import msgspec

PROTOCOL_VERSION = (
    11  # 3: Heartbeat.ticks, SaveCheckpoint; 4: clock stamps and trace in Hello/Init, draft-depth stats;
    # 5: node agents (protocols/node.py), Hello.local_endpoint, weight deltas across hosts; 6: typed answers
    # (CheckpointSaved, WeightsPushed, HeadAck) instead of Status topics, Failed; TrainStep trains only
    # (pushes are PushWeights, with delta_base; checkpoints SaveCheckpoint); 7: WeightUpdate.ipc (CUDA IPC);
    # 8: RewardCalls (reward time and batch sizes per term); 9: multi-turn episodes (Completion's policy mask,
    # opening, turns, env reward and error; ScoredGroup.policy_masks; GenerateRequest.row_json; environment.*,
    # RolloutUp among them); 10: Completion.env_wait_s (an episode's environment wait); 11: bulk data off the
    # coordinator (GenerateRequest.learn_at, Completion.text, SampleReceipt, TrainStep's GroupPlans; no
    # ScoredGroup on the wire)
)

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
NonNegF = Annotated[float, msgspec.Meta(ge=0.0)]


class Message(msgspec.Struct, frozen=True, kw_only=True, array_like=True, forbid_unknown_fields=True):
    """A wire message. Subclasses set `kind`, the string that travels in the first frame."""

    kind: ClassVar[str] = ""
