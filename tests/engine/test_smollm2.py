"""The real SmolLM2-135M: the native engine continues chat prompts exactly as transformers does.

Uses the default model cache (`hub.pull` converts the embedded GGUF once, ~20 s, then reuses it). The
prompts go through our prompts reader and chat template, whose ids must equal transformers' own
`apply_chat_template`; then the engine's greedy continuation (three prompts decoded together in one
continuous batch) must equal `LlamaForCausalLM.generate` run on each prompt alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.engine import hub
from slipstream.engine.generator import Generator, Request
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_model
from slipstream.tasks.prompts import read_prompts

pytestmark = pytest.mark.timeout(300)  # a first pull on a cold cache converts the model

NEW_TOKENS = 24
PROMPTS = [
    "What is 17 + 25? Answer briefly.",
    "Name three primary colors.",
    "Write one sentence about the sea.",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return hub.pull("smollm2-135m")


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_chat_template_ids_flow_through(model_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    specs = read_prompts(prompts_file, Tokenizer.from_dir(model_dir))
    for spec, text in zip(specs, PROMPTS, strict=True):
        theirs = hf_tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        assert list(spec.prompt_ids) == list(theirs)


def test_greedy_continuation_matches_transformers(model_dir: Path, hf_model: Any) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=tuple(tokenizer.stop_ids))
    generator = Generator(load_model(model_dir), num_slots=len(prompts), max_len=128)
    ours = generator.generate(
        [Request(request_id=str(i), prompt_ids=ids, params=params) for i, ids in enumerate(prompts)]
    )
    for prompt, completion in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=sorted(tokenizer.stop_ids),
                pad_token_id=tokenizer.pad_id,
            )
        theirs = out[0, len(prompt) :].tolist()
        assert completion.token_ids == theirs, (
            tokenizer.decode(completion.token_ids),
            tokenizer.decode(theirs),
        )
        assert completion.finish_reason == ("stop" if theirs[-1] in tokenizer.stop_ids else "length")
        assert tokenizer.decode(completion.token_ids).strip()
