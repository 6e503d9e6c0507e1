"""Drafters: the interface (`base`), the model-free n-gram drafter, the oracle (benchmark ceiling) and the
hybrid (n-gram where it matches, else the EAGLE head).

The EAGLE-style head plugs into the same `Drafter` interface from its own module.
"""

from slipstream.engine.drafters.base import Draft, Drafter, DraftState, stack_chains
from slipstream.engine.drafters.hybrid import HybridDrafter
from slipstream.engine.drafters.ngram import NGramDrafter
from slipstream.engine.drafters.oracle import OracleDrafter

__all__ = ["Draft", "DraftState", "Drafter", "HybridDrafter", "NGramDrafter", "OracleDrafter", "stack_chains"]
