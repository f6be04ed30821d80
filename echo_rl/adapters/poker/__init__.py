"""Poker (no-limit hold'em) sandbox adapter: Appendix D of the ECHO-2 paper.

Modules: ``game`` (pokerkit table, seeded deals, raw logs), ``players`` (rule-based opponents
and the LLM player), ``render`` (observation text), ``pipeline`` (raw logs -> messages -> ids
-> masks -> records, off-policy ingestion), ``adapter`` (the ``poker`` adapter), ``eval``
(chip change against each opponent, Table 4 layout).
"""

from echo_rl.adapters.poker.adapter import PokerAdapter

__all__ = ["PokerAdapter"]
