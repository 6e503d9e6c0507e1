"""Drafters: the interface (`base`), the model-free n-gram drafter, the EAGLE drafter (which runs the head
of `engine/eagle.py`), the oracle (benchmark ceiling), the history drafter (earlier steps' responses to the prompt, `suffix`) and
the hybrid (one drafter's draft where it has one, else the EAGLE head's).
"""

from slipstream.engine.drafters.base import Draft, Drafter, DraftState, stack_chains
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.drafters.hybrid import HybridDrafter
from slipstream.engine.drafters.ngram import NGramDrafter
from slipstream.engine.drafters.oracle import OracleDrafter
from slipstream.engine.drafters.suffix import SuffixDrafter

__all__ = [
    "Draft",
    "DraftState",
    "Drafter",
    "EagleDrafter",
    "HybridDrafter",
    "NGramDrafter",
    "OracleDrafter",
    "SuffixDrafter",
    "stack_chains",
]
