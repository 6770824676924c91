"""The verification scheme's name: one constant, importable without torch.

It names the algorithms of layer hashes (:mod:`.integrity`), position MACs
(:mod:`.position_truth`) and marginal sums (:mod:`.marginals`), and is part of every
truth record's key: change it with any of them, and during a rolling upgrade the two
schemes keep two truths instead of replacing each other's.
"""

SCHEME = "nb1"
