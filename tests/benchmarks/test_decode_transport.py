"""`bench decode` and `bench transport` print the JSON they document (typed results), on tiny workloads.

Figures from runs this small mean nothing; what is asserted is every key and its kind.
"""

import json
from pathlib import Path

import msgspec
import pytest

from slipstream.benchmarks import decode, transport
from tests.engine.conftest import build_checkpoint


@pytest.mark.timeout(120)
def test_decode_json_carries_every_documented_field(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")
    arms = (decode.ARMS[0], decode.ARMS[1], decode.ARMS[4])  # plain, n-gram chain, self-draft chain
    result = decode.run(str(model), batches=[1, 2], max_tokens=4, arms=arms, log=False)
    printed = json.loads(msgspec.json.encode(result))
    assert set(printed) == {
        "model", "threads", "rows", "batches", "prompt_tokens", "max_tokens", "temperature", "repeats",
        "prompt_source", "ignore_eos", "torch", "self_mode", "timing", "drafter", "device", "wall_s",
    }  # fmt: skip
    assert printed["batches"] == [1, 2] and printed["drafter"] is None and printed["ignore_eos"] is True
    assert [(r["batch"], r["spec"]) for r in printed["rows"]] == [
        (b, spec) for b in (1, 2) for spec in ("off", "ngram", "self")
    ]
    for row in printed["rows"]:
        assert set(row) == set(decode.DecodeRow.__struct_fields__)
        assert row["tokens_per_s"] > 0 and len(row["tokens_per_s_rounds"]) == 1
    plain = printed["rows"][0]
    assert plain["mode"] is None and plain["ratio"] == 1.0 and plain["accept_length"] == 1.0
    assert "accept" in decode.render(result)


@pytest.mark.timeout(120)
def test_transport_json_carries_every_documented_field() -> None:
    printed = json.loads(msgspec.json.encode(transport.run(rtt_rounds=20, stream_msgs=50, tensor_msgs=1)))
    assert set(printed) == {
        "tensor_msg_gbps", "memcpy_gbps", "ratio", "zmq_frames_gbps", "rtt_us_p50", "rtt_us_p99",
        "msgs_per_s", "tensor_mib", "tensor_msgs", "rtt_rounds", "transport", "torch_threads", "across",
    }  # fmt: skip
    assert printed["transport"] == "ipc" and printed["tensor_msgs"] == 1
    assert all(printed[k] > 0 for k in ("tensor_msg_gbps", "memcpy_gbps", "zmq_frames_gbps", "msgs_per_s"))
    # The paths between nodes, side by side: plaintext tcp and CURVE, each with its round trip and frames.
    assert set(printed["across"]) == {"tcp", "tcp+curve"}
    for path in printed["across"].values():
        assert set(path) == {"rtt_us_p50", "rtt_us_p99", "zmq_frames_gbps"} and all(
            v > 0 for v in path.values()
        )
