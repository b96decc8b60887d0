"""The restore stage: matching a saved tree to live state, coalesced reads, verification."""
