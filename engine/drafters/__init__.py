"""Drafters: the interface (`base`), the model-free n-gram drafter, the EAGLE drafter (which runs the head
of `engine/eagle.py`), the oracle (benchmark ceiling) and the hybrid (n-gram where it matches, else EAGLE).
"""

from slipstream.engine.drafters.base import Draft, Drafter, DraftState, stack_chains
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.drafters.hybrid import HybridDrafter
from slipstream.engine.drafters.ngram import NGramDrafter
from slipstream.engine.drafters.oracle import OracleDrafter

__all__ = [
    "Draft",
    "DraftState",
    "Drafter",
    "EagleDrafter",
    "HybridDrafter",
    "NGramDrafter",
    "OracleDrafter",
    "stack_chains",
]
