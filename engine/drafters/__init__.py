"""Drafters: the interface (`base`), the model-free n-gram drafter and the oracle (benchmark ceiling).

The EAGLE-style head plugs into the same `Drafter` interface from its own module.
"""

from slipstream.engine.drafters.base import Draft, Drafter, DraftState, stack_chains
from slipstream.engine.drafters.ngram import NGramDrafter
from slipstream.engine.drafters.oracle import OracleDrafter

__all__ = ["Draft", "DraftState", "Drafter", "NGramDrafter", "OracleDrafter", "stack_chains"]
