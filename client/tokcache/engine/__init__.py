"""The read side of the cache: boundaries, encoders, affixes, memos and the lookup."""
