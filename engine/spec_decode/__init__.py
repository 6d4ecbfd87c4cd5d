"""Speculative decoding (`--speculative-config`): who proposes the drafts and how a verify row keeps them.

`ngram_proposer.py` drafts by prompt lookup, `draft_proposer.py` with a small draft model (its own
`ModelRunner` on the target's block ids), `cost_gate.py` switches drafting off on steps where it costs more
than it saves, and `rejection_sampler.py` accepts drafts drawn from a distribution so that the output keeps
the target's. Import the modules themselves; this package re-exports nothing.
"""
